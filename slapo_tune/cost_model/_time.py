"""The time model: seconds per step of each time term, of one point or of many at once.

Time is compute (FLOPs at an achievable rate that a GPU's small products reach less of,
recomputation included), memory-bound passes at memory bandwidth, plus a fixed cost per block and
micro-batch (on a GPU, only where FSDP1's rate limiter makes the host wait: :class:`FsdpHost`),
plus tensor-parallel, data-parallel (per ZeRO level: all-reduce, or all-gathers in the compute
dtype and fp32 reduce-scatters, partly hidden behind compute on a GPU) and
pipeline communication (alpha-beta over NVLink inside a node and every NIC of a node across nodes),
with the pipeline bubble ((pp - 1) / (vpp m) of the step). On llm-foundry's published GPU runs it is
within 15 % of every one (benchmarks/published_runs.py).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..plan import Workload, accumulation, knob_value
from ..precision import Precision
from ._columns import _each, _max, _min
from ._layout import ModelLayout, cp_gathers_keys, scores_materialised
from ._memory import GRAD_BYTES
from ._schedule_math import checkpointed_count
from .hardware import Hardware, choose, larger

TIME_TERMS = ("compute", "attention", "elementwise", "overhead", "grad_accumulation", "tp_comm", "dp_comm", "pp_comm")
DEFAULT_TIME_WEIGHTS = {k: 1.0 for k in TIME_TERMS}


@dataclass
class TimePrediction:
    step: float  # seconds per optimizer step
    breakdown: dict[str, float] = field(default_factory=dict)

    def throughput(self, workload: Workload) -> float:
        """Samples per second."""
        return float(samples_per_second(workload.global_batch, self.step))


def samples_per_second(global_batch: int, step: Any) -> Any:
    """Samples per second of a step of ``step`` seconds (0 where it takes none); elementwise over
    arrays of points."""
    return choose(step > 0, global_batch / choose(step > 0, step, 1.0), 0.0)


def _ring(bytes_: Any, n: Any, hw: Hardware, kind: str = "all_reduce", stride: Any = 1) -> Any:
    """A collective over ``n`` ranks ``stride`` apart (alpha-beta): across nodes once the group
    spans more devices than a node holds. A ring takes ``n - 1`` steps per pass. On GPUs an
    all-reduce runs as NCCL picks by size: a ring, or its double binary tree, ``2 log2(n)`` steps
    that move every byte twice (up reduced, down broadcast), whichever is faster: the tree for
    small messages over many ranks (a gradient all-reduce over hundreds of data-parallel ranks),
    the ring for large ones. Elementwise over arrays of points (see :func:`time_columns`)."""
    spans = n * stride > hw.devices_per_node
    # the ring's ranks in one node (ranks stride apart: a node holds devices_per_node / stride of them)
    per_node = _min(n, _max(hw.devices_per_node // stride, 1))
    bandwidth = hw.bandwidth(n, spans, per_node)
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    seconds = steps * hw.latency + factor * bytes_ / bandwidth
    if kind == "all_reduce" and not hw.cores:
        tree = 2 * np.ceil(np.log2(_max(n, 2))) * hw.latency + 2 * bytes_ / bandwidth
        seconds = _min(seconds, tree)
    return choose((n <= 1) | (bytes_ <= 0), 0.0, seconds)


def fsdp_collectives(level: Any, micro_batches: Any, pp: Any, schedule: Any) -> tuple[Any, Any]:
    """(all-gathers, reduce-scatters) of a stage's parameters per step at ZeRO ``level`` 1-3.

    One stage: level 1 gathers once and reduces once per step (each unit: a block, the root);
    level 2 gathers and reduces every
    micro-batch; level 3 gathers twice (forward, backward) and reduces every micro-batch. A
    pipeline defers reduction and resharding after backward to the step's last backward: level 1
    and 2 gather once; level 3 still reshards after every forward, so each forward gathers and a
    1F1B backward gathers again (GPipe's backwards all follow the last forward: one gathering).
    Elementwise over arrays of points (the first case that holds, in that order).
    """
    m = micro_batches
    one_stage = (pp == 1) | (m == 1)
    gathers = choose(level == 1, 1, choose(one_stage, choose(level == 2, m, 2 * m),
                                           choose(level == 2, 1, choose(schedule == "gpipe", m + 1, 2 * m))))
    return gathers, choose(level == 1, 1, choose(one_stage, m, 1))


# Elements a block's non-matmul kernels read and write per token in forward, in Hugging Face's eager
# code (each op a pass: it reads its inputs and writes its output), counted from the modules:
# LayerNorm is one kernel (read, write: 2 h); Llama's RMSNorm six ops in fp32 (to, pow, mean, rsqrt,
# mul, weight mul: ~12 h); two residual additions (read 2, write 1: 6 h); rotary embeddings on q and
# k (rotate_half's slices and cat, two products, a sum: ~8 per element); the MLP's activation over
# its width (:func:`activation_passes`); fused (bias + activation in one compiled kernel): one read
# and one write (2, gated 3). Eager attention adds its score passes
# per score element (scale, mask, softmax, dropout, cast: ~8); fused SDPA keeps the scores on chip.
# Backward makes about 1.5 times the forward's traffic: an op's gradient reads its saved input and
# the incoming gradient and writes one (3 passes where forward makes 2).
NORM_PASSES = {"layer": 2, "rms": 12}
RESIDUAL_PASSES = 6
ROTARY_PASSES = 8
# An activation torch runs as one kernel (exact GELU, tanh GELU as ``gelu_pytorch_tanh``, ReLU, SiLU)
# reads and writes once: 2 passes; Hugging Face's Python compositions read and write per op: GPT-2's
# ``gelu_new`` (NewGELU: mul, pow, mul, add, mul, tanh, add, mul) 18, ``gelu_fast`` (nine ops) 21,
# ``quick_gelu`` (mul, sigmoid, mul) 7. A gated MLP adds the gate's product (reads 2, writes 1)
ACTIVATION_OP_PASSES = {"gelu_new": 18, "gelu_fast": 21, "quick_gelu": 7}
ONE_KERNEL_PASSES = 2
GATE_PASSES = 3
FUSED_ACTIVATION_PASSES = {False: 2, True: 3}
SCORE_PASSES = 8
BACKWARD_TRAFFIC = 1.5
# The share of compute FSDP's prefetched traffic hides behind on a GPU (at least 1 - FSDP_OVERLAP of
# it exposed): the collectives run on their own streams beside the blocks' kernels. Fitted on the
# published runs not held out with the per-block cost and the products' shape efficiency
# (Hardware.overhead_per_layer, gemm_half_dim) and the GPUs' rates: python -m benchmarks.fit_constants.
# The fit is flat along a trade: a larger per-block cost against more overlap (with causal attention
# charged at half, 1.0 and 5.75 ms per block beat 0.5 and 2.5 ms, the previous fit, on the median);
# NCCL's kernels do take SMs and HBM bandwidth from the products they overlap, which the per-block
# cost then carries
FSDP_OVERLAP = 1.0


class FsdpHost(str, enum.Enum):
    """Whether an FSDP implementation makes the host wait for the GPU once per unit (a block),
    which exposes the host's own time per block and micro-batch (``Hardware.overhead_per_layer``:
    its hooks, the unit's kernel launches) between the GPU's kernels.

    - ``RUNS_AHEAD``: the host never waits; collectives wait on streams. PyTorch's FSDP2
      (``fully_shard``, our runtime's ZeRO levels: its docs, "does not require blocking the CPU
      like in FSDP1's limit_all_gathers=True"), Megatron-FSDP (its all-gathers and reduce-scatters
      are ``async_op=True`` works whose ``wait()`` orders NCCL's stream before the current one).
    - ``WAITS_PER_UNIT``: FSDP1's rate limiter (``limit_all_gathers=True``, its default since
      torch 2.1, set by llm-foundry's benchmark runs: submit_benchmarks.py): ``_unshard`` calls ``event.synchronize()`` on the free
      event of the unit two back before each all-gather.

    tests/unit/test_fsdp_host.py checks both facts against the pinned torch's source.
    """

    RUNS_AHEAD = "runs-ahead"
    WAITS_PER_UNIT = "waits-per-unit"


class GradAccumulation(str, enum.Enum):
    """How each micro-batch's weight gradients join the accumulated ones.

    - ``SEPARATE_PASS``: the weight-gradient product writes a new gradient, and a kernel per
      parameter adds it to the accumulated one (reads both, writes one). PyTorch autograd's
      ``AccumulateGrad`` (our runtime), and Megatron-Core's without the fusion below.
    - ``IN_GEMM``: the weight-gradient GEMM accumulates into the fp32 main gradient itself (its
      epilogue reads and writes the accumulator: a compute-bound GEMM hides it): Megatron-Core's
      ``gradient_accumulation_fusion`` (Transformer Engine's ``fuse_wgrad_accumulation``, APEX's
      ``wgrad_gemm_accum_fp32``), which Megatron-Bridge turns on wherever Transformer Engine is
      installed (``fusions.can_enable_gradient_accumulation_fusion``).
    """

    SEPARATE_PASS = "separate-pass"
    IN_GEMM = "in-gemm"


@dataclass(frozen=True)
class Runtime:
    """What a training runtime does that the time model charges: our runtime's is the default
    (:data:`OUR_RUNTIME`); a published run's framework may differ (benchmarks/published_runs.py)."""

    fsdp_host: FsdpHost = FsdpHost.RUNS_AHEAD
    grad_accumulation: GradAccumulation = GradAccumulation.SEPARATE_PASS

    def __post_init__(self):
        # the data file's strings become the enums (a ValueError names a value that is neither)
        object.__setattr__(self, "fsdp_host", FsdpHost(self.fsdp_host))
        object.__setattr__(self, "grad_accumulation", GradAccumulation(self.grad_accumulation))


OUR_RUNTIME = Runtime()  # FSDP2 (runs ahead), autograd's accumulation


# A GPU's fused attention (SDPA: FlashAttention-2 / memory-efficient kernels) runs its FLOPs at
# about 0.75 of a large GEMM's rate (FlashAttention-2, Dao 2023: 50-73 % of A100 peak forward and
# backward, against ~80 % for cuBLAS GEMMs)
FLASH_EFFICIENCY = 0.75


def block_traffic(layout: ModelLayout, point: Mapping[str, Any], seq_len: int, mode: Precision,
                  gpu: bool = False) -> Any:
    """Elements one block's memory-bound kernels read and write in forward, per token (see
    :data:`NORM_PASSES`); tensor parallelism divides what is inside its regions. On a GPU, SDPA is
    a fused kernel (no score passes); on a CPU it writes scores where the probe found them kept
    in precision ``mode``. Fusion saves passes on a GPU only: on a CPU the templates fuse with the eager
    backend (inductor would need a C++ toolchain and minutes of compilation per trial), which runs
    the same element-wise operators (measured on the recorded GPT-2 grid: fused / unfused step time
    1.00 on median over 58 pairs). Elementwise over arrays of points (:func:`time_columns`)."""
    tp, attn = point["tp"], point["attn"]
    gated = layout.gated_mlp
    q, kv = layout.heads * layout.head_dim, layout.kv_heads * layout.head_dim
    outside = (2 * NORM_PASSES["rms" if gated else "layer"] + RESIDUAL_PASSES) * layout.hidden
    passes = FUSED_ACTIVATION_PASSES[gated], activation_passes(layout)
    inside = choose((point["fuse"] == "on") & gpu, *passes) * layout.intermediate
    if gated:
        inside += ROTARY_PASSES * (q + kv)
    kernels = set(attn.tolist()) if isinstance(attn, np.ndarray) else {attn}
    written = [a for a in kernels if scores_materialised(layout, a, mode, gpu)]
    scores = np.isin(attn, written) if isinstance(attn, np.ndarray) else attn in written
    inside += choose(scores, SCORE_PASSES * layout.heads * seq_len, 0)
    # sequence parallelism runs what is outside the regions on a sequence shard
    sp = (tp > 1) & (point["sp"] == "on")
    return outside / choose(sp, tp, 1) + inside / tp


def activation_passes(layout: ModelLayout) -> int:
    """Element-wise passes of the MLP's activation (and a gated MLP's product) per element of its
    width, unfused (see :data:`ACTIVATION_OP_PASSES`). A layout from before the activation was
    recorded (``""``) counts GPT-2's composition, or a gated MLP's SiLU."""
    name = layout.activation or ("silu" if layout.gated_mlp else "gelu_new")
    return ACTIVATION_OP_PASSES.get(name, ONE_KERNEL_PASSES) + (GATE_PASSES if layout.gated_mlp else 0)


def gemm_seconds(hw: Hardware, m: Any, k: Any, n: Any, dtype_bytes: int, ranks: Any = 1, fp8: bool = False,
                 linear: bool = False) -> Any:
    """One ``m x k @ k x n`` product: a GPU's roofline (FLOPs at its large-GEMM rate, or its
    operands' bytes at memory bandwidth, whichever is longer); a CPU's measured rate by the
    product's rows (:meth:`Hardware.gemm_rate`) on a rank's share of the cores when ``ranks`` run
    on it at once: ``cores // ranks`` threads each, time-sliced when there are more ranks than cores.
    ``fp8``: FP8 operands (1 byte each, the output in ``dtype_bytes``) at the GPU's FP8 rate
    (:attr:`Hardware.fp8_flops`). ``linear``: a linear layer's product, whose smallest dimension sets
    the share of the GPU's rate it reaches (:attr:`Hardware.gemm_half_dim`); attention's batched
    products over a head's few dimensions are bound by their traffic instead (the roofline).
    Elementwise over arrays of points (:func:`time_columns`)."""
    flops = 2 * m * k * n
    if hw.cores:
        return flops / hw.gemm_rate(m, larger(1, hw.cores // ranks)) * larger(1.0, ranks / hw.cores)
    if fp8:
        if not hw.fp8_flops:
            raise ValueError(f"{hw.name} has no FP8 rate (fp8_flops)")
        traffic, rate = (m * k + k * n) + dtype_bytes * m * n, hw.fp8_flops
    else:
        traffic, rate = dtype_bytes * (m * k + k * n + m * n), hw.flops
    if linear and hw.gemm_half_dim:
        # a product's smallest dimension D sets the share of the rate its tiles reach, D^2 / (D^2 + D0^2)
        # (tiles' fixed costs and the last partial wave weigh less as the product grows; the backward's
        # two products have the same three dimensions: the same share)
        smallest = _min(_min(m, k), n) / hw.gemm_half_dim
        rate = rate * smallest**2 / (smallest**2 + 1)
    return larger(flops / rate, traffic / hw.memory_bandwidth if hw.memory_bandwidth else 0.0)


# what the time terms read of a point
TIME_KNOBS = ("tp", "pp", "cp", "sp", "dp", "zero", "micro_batch", "ckpt_ratio", "ckpt_policy", "pipeline_schedule", "vpp",
              "attn", "fuse", "loss_parallel")


def point_columns(points: Iterable[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The :data:`TIME_KNOBS` of ``points`` as one array per knob (:func:`time_columns`' input; a
    point without a knob added since means what it always meant: :data:`~slapo_tune.plan.KNOB_DEFAULTS`)."""
    points = list(points)
    return {k: np.array([knob_value(p, k) for p in points]) for k in TIME_KNOBS}


def time_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware,
               fsdp_overlap: float = FSDP_OVERLAP, runtime: Runtime = OUR_RUNTIME) -> dict[str, float]:
    """Seconds per step of each time term (before weights) of one point (:func:`time_columns` of
    its knobs' values)."""
    point = {k: knob_value(point, k) for k in TIME_KNOBS}
    return {k: float(v) for k, v in time_columns(layout, point, workload, hw, fsdp_overlap, runtime).items()}


def time_columns(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware,
                 fsdp_overlap: float = FSDP_OVERLAP, runtime: Runtime = OUR_RUNTIME) -> dict[str, Any]:
    """Seconds per step of each time term (before weights), of one point or of many at once:
    ``point`` holds a value or one array per knob of :data:`TIME_KNOBS` (:func:`point_columns`);
    the terms are then arrays of as many elements, each the float operations of that point's own
    evaluation (branches on the knobs are selections: :func:`~.hardware.choose`).

    The slowest stage's ``m + (pp - 1) / vpp`` slots (its micro-batches and the bubble) of:
    ``compute``, its blocks' and head's matrix products (by each product's shape: a GPU's
    roofline, a CPU's measured rate by rows), forward, backward (twice the forward) and the
    recomputation of checkpointed blocks; ``attention``, the attention core (eager: batched
    products at the GEMM rate; SDPA on a GPU: a fused kernel at :data:`FLASH_EFFICIENCY`);
    ``elementwise``, the memory-bound kernels' traffic (:func:`block_traffic`) at memory bandwidth;
    ``overhead``, a fixed cost per block and micro-batch and per collective call (on a GPU, only
    where the host waits for the device: FSDP units under the ``runtime``'s ``fsdp_host``
    ``WAITS_PER_UNIT``, see :class:`FsdpHost`; our runtime's FSDP2 runs ahead, the default). Then
    ``grad_accumulation`` (a pass over the stage's gradients per micro-batch, none where the
    runtime accumulates in the GEMMs: :class:`GradAccumulation`) and communication:
    ``tp_comm`` (not overlapped), ``pp_comm`` and ``dp_comm`` (on a GPU, what the runtime overlaps
    with compute is left out: a pipeline's steady-state sends, FSDP's prefetched gathers and
    reductions after the first and before the last, but for ``1 - fsdp_overlap`` of them:
    :data:`FSDP_OVERLAP`, a parameter for the fit of the constants, benchmarks/fit_constants.py).
    """
    step = _step_of(layout, point, workload, hw)
    compute, attention, elementwise, overhead, grad_accumulation = _compute_terms(layout, point, workload, hw, step,
                                                                                  runtime)
    tp_comm, dp_comm, pp_comm = _communication_terms(layout, point, hw, step, (compute, attention, elementwise),
                                                     fsdp_overlap)
    return {"compute": compute, "attention": attention, "elementwise": elementwise, "overhead": overhead,
            "grad_accumulation": grad_accumulation, "tp_comm": tp_comm, "dp_comm": dp_comm, "pp_comm": pp_comm}


class _Step(NamedTuple):
    """What :func:`time_columns`' terms share of a point (:func:`_step_of` says what each is)."""

    mode: Any  # the workload's precision (slapo_tune.precision)
    tp: Any
    pp: Any
    dp: Any
    cp: Any
    b: Any
    s: int
    B: int
    m: Any
    sp: Any
    vpp: Any
    gpu: bool
    per_stage: Any
    ckpt: Any
    tokens: Any
    world: Any
    bandwidth: Any
    slots: Any
    level: Any
    stage_params: Any
    chunked: Any  # context parallelism runs the chunked flash kernels (not the gathered keys' mask)


def _step_of(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware) -> _Step:
    """The knobs :func:`time_columns` reads, the slowest stage's blocks, time slots and parameters."""

    mode = workload.mode
    tp, pp, dp, cp = point["tp"], point["pp"], point["dp"], point["cp"]
    b, s, B = point["micro_batch"], workload.seq_len, mode.activation_bytes
    m = accumulation(workload, dp, b)
    sp = (tp > 1) & (point["sp"] == "on")
    vpp = choose(pp > 1, point["vpp"], 1)
    gpu = not hw.cores
    # the slowest stage: the most blocks any holds (an uneven split: one more than the ends hold;
    # interleaved, the ranks between the ends hold (blocks + 2) / pp when the end chunks are one
    # block short, the same: the space offers no other uneven interleaving, test_space checks)
    per_stage = -(-layout.layers // pp)
    if isinstance(pp, np.ndarray):  # few distinct (ratio, pp, vpp) of many points: once each
        ckpt = np.asarray(_each(lambda r, n, v: checkpointed_count(0, r, layout.layers, n, v),
                                point["ckpt_ratio"], pp, vpp), dtype=np.int64)
    else:
        ckpt = checkpointed_count(per_stage, point["ckpt_ratio"], layout.layers, pp, vpp)
    tokens = b * s / cp  # context parallelism: this rank's chunk of each sequence
    world = tp * pp * dp * cp
    # CPU: ranks share the cores (threads each, see gemm_seconds) and the memory bandwidth; more
    # ranks than cores time-slice
    sliced = larger(1.0, world / hw.cores) if hw.cores else 1.0
    bandwidth = hw.memory_bandwidth / sliced
    # the slowest stage's time slots: its m micro-batches and the pipeline's fill and drain, pp - 1
    # slots of a stage's work, each 1 / vpp as long when a rank's blocks are cut into vpp chunks
    # (the bubble (pp - 1) / m, interleaved (pp - 1) / (vpp m): Narayanan et al. 2021). With the
    # end chunks one block short, every chunk of the slowest ranks is per_stage / vpp blocks; the
    # fill's first chunk is one block shorter, which this leaves counted (one block's time)
    slots = m + (pp - 1) / vpp
    level = choose(dp > 1, point["zero"], 0)  # the ZeRO level in effect: nothing is sharded over one rank
    # the slowest stage's parameters: its blocks', and the embedding's or the head's (both on one stage)
    block_params = layout.block_sharded / tp + layout.block_replicated
    edges = [layout.pre_sharded / tp + layout.pre_replicated, layout.post_sharded / tp + layout.post_replicated]
    stage_params = per_stage * block_params + choose(pp == 1, sum(edges), larger(*edges))
    chunked = np.logical_not(cp_gathers_keys(layout, point["attn"], mode, gpu))
    return _Step(mode, tp, pp, dp, cp, b, s, B, m, sp, vpp, gpu, per_stage, ckpt, tokens, world, bandwidth, slots,
                 level, stage_params, chunked)


def _block_linears(layout: ModelLayout, hw: Hardware, step: _Step) -> tuple[Any, Any, Any, Any]:
    """Seconds of one product of each of a block's linear layers on a micro-batch: the QKV
    projection, the attention's output projection, the MLP's first (gated: gate and up) and last
    layers; each of their two backward products (input and weight gradients) has the same
    dimensions, so takes as long. In FP8 under precision fp8 (the LM head and the attention core
    stay in bf16)."""
    q, kv = layout.heads * layout.head_dim, layout.kv_heads * layout.head_dim
    width = layout.intermediate * (2 if layout.gated_mlp else 1)
    tp, tokens = step.tp, step.tokens
    linear = functools.partial(gemm_seconds, hw, dtype_bytes=step.B, ranks=step.world, fp8=step.mode.fp8, linear=True)
    return (linear(tokens, layout.hidden, (q + 2 * kv) / tp), linear(tokens, q / tp, layout.hidden),
            linear(tokens, layout.hidden, width / tp), linear(tokens, layout.intermediate / tp, layout.hidden))


def attention_pairs(layout: ModelLayout, s: int, cp: Any, chunked: Any = True) -> Any:
    """Query-key pairs per head and sequence a GPU's fused attention (SDPA) computes on one rank.
    A causal layout's kernel (``is_causal``: FlashAttention-2) skips the blocks above the diagonal,
    computing the causal mask's kept pairs, s (s + 1) / 2 of s^2: half, as FlashAttention-2's paper
    counts causal FLOPs (and measures the efficiency :data:`FLASH_EFFICIENCY` cites). Under context
    parallelism (cp > 1) the runtime's chunked flash kernels (``chunked``: where it does not gather
    the keys, :func:`~._layout.cp_gathers_keys`) compute a rank's two chunks of c = s / (2 cp)
    queries against the keys before them, the whole earlier chunks and their own chunk's causal
    half: (2 cp - 1) c^2 + c (c + 1) = s (s + 1) / (2 cp), a cp-th of the causal pairs. Where it
    gathers the keys it calls SDPA with an explicit boolean mask, which no fused kernel skips blocks
    of: the whole chunk's s / cp queries against s keys, as for a non-causal layout. Elementwise
    over arrays of ``cp`` and ``chunked``."""
    causal = s * (s + 1) / 2 / cp
    return choose(layout.causal & ((cp == 1) | chunked), causal, s / cp * s)


def _compute_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware,
                   step: _Step, runtime: Runtime) -> tuple[Any, Any, Any, Any, Any]:
    """:func:`time_columns`' compute, attention, elementwise, overhead and grad_accumulation."""
    tp, cp, b, s, B, m, sp = step.tp, step.cp, step.b, step.s, step.B, step.m, step.sp
    gpu, per_stage, ckpt, tokens, world, bandwidth = step.gpu, step.per_stage, step.ckpt, step.tokens, step.world, \
        step.bandwidth
    slots, level, stage_params = step.slots, step.level, step.stage_params
    selective = point["ckpt_policy"] == "selective"
    gemm = functools.partial(gemm_seconds, hw, dtype_bytes=B, ranks=world)
    block_gemms = sum(_block_linears(layout, hw, step))
    vocab = (layout.pre_sharded if layout.tied_head else layout.post_sharded) / layout.hidden
    head_gemm = gemm(tokens, layout.hidden, vocab / tp, linear=True)
    heads = layout.heads / tp
    # SDPA on a GPU: a fused kernel, FlashAttention-2 keeps scores on chip, dropout too, and runs
    # QK^T and AV (2 x 2 d FLOPs) over the query-key pairs it computes; else QK^T and AV: per head,
    # an s x d @ d x s and an s x s @ s x d product, every score materialised, masked or not
    # (context parallelism: the chunk's s / cp queries against the whole sequence's s keys)
    attn_fwd = choose((point["attn"] == "sdpa") & gpu,
                        4 * b * heads * attention_pairs(layout, s, cp, step.chunked) * layout.head_dim
                        / (hw.flops * FLASH_EFFICIENCY),
                        b * heads * (gemm(s / cp, layout.head_dim, s) + gemm(s / cp, s, layout.head_dim)))
    traffic_fwd = (tokens * block_traffic(layout, point, s, workload.mode, gpu) * B / bandwidth
                   if hw.memory_bandwidth else 0.0)
    # forward and backward (twice the forward), and recomputation: a fully checkpointed block runs
    # its forward again, a selectively checkpointed one all but its matrix products
    passes = 1 + BACKWARD_TRAFFIC
    compute_mb = 3 * (per_stage * block_gemms + head_gemm) + choose(selective, 0, ckpt * block_gemms)
    attention_mb = 3 * per_stage * attn_fwd + ckpt * attn_fwd
    elementwise_mb = passes * per_stage * traffic_fwd + ckpt * traffic_fwd
    # over the slowest stage's time slots (_step_of)
    compute, attention, elementwise = slots * compute_mb, slots * attention_mb, slots * elementwise_mb
    # a fixed cost per block and micro-batch, and per two collective calls: tensor parallelism's
    # four all-reduces per block (forward and backward), sequence parallelism's ten (below). A GPU's
    # host runs ahead of the kernels it launches, except where an FSDP that waits per unit (FSDP1's
    # rate limiter, FsdpHost.WAITS_PER_UNIT; ZeRO-2 and 3 there: a unit per block) makes it wait:
    # once per block, its hooks before and after each forward and backward
    calls = choose(tp > 1, choose(sp, 5, 2), 0)
    waits = runtime.fsdp_host is FsdpHost.WAITS_PER_UNIT
    per_block = (choose(level >= 2, 1, 0) if waits else 0) if gpu else 1 + calls
    overhead = slots * per_stage * hw.overhead_per_layer * per_block
    # every micro-batch's backward writes a gradient for each of the stage's parameters and adds
    # it to the accumulated one: a pass over the stage's parameters that smaller micro-batches
    # repeat more often (none where the weight-gradient GEMMs accumulate: GradAccumulation.IN_GEMM)
    separate = runtime.grad_accumulation is GradAccumulation.SEPARATE_PASS
    grad_accumulation = m * 3 * stage_params * GRAD_BYTES / bandwidth if hw.memory_bandwidth and separate else 0.0
    return compute, attention, elementwise, overhead, grad_accumulation


def _communication_terms(layout: ModelLayout, point: Mapping[str, Any], hw: Hardware, step: _Step,
                         busy: tuple[Any, Any, Any], fsdp_overlap: float) -> tuple[Any, Any, Any]:
    """:func:`time_columns`' tp_comm, dp_comm and pp_comm (``busy``: its compute, attention and
    elementwise terms, what FSDP's prefetched collectives hide behind on a GPU, ``fsdp_overlap``
    of it: :data:`FSDP_OVERLAP`)."""
    mode, tp, pp, dp, cp, b, s, B, m, sp = step.mode, step.tp, step.pp, step.dp, step.cp, step.b, step.s, step.B, \
        step.m, step.sp
    vpp, gpu, per_stage, ckpt, tokens = step.vpp, step.gpu, step.per_stage, step.ckpt, step.tokens
    slots, level, stage_params = step.slots, step.level, step.stage_params
    kv = layout.kv_heads * layout.head_dim
    act_bytes = tokens * layout.hidden * B
    # forward and backward, two regions per block: all-reduces, or under sequence parallelism as
    # many all-gathers and reduce-scatters, which move the same bytes in as many ring steps where
    # the backend reduce-scatters on a ring (NCCL); gloo's (CPU ranks) costs what an all-reduce does
    # (measured, 4 MB over 2 ranks: 8.4 ms, all-reduce 9.5, all-gather 7.6). Sequence parallelism
    # also keeps a region's input as a shard and gathers it again in backward (at least once per
    # region: separate Q, K and V projections gather it each). Tensor-parallel ranks are adjacent
    # (the mesh is (pp, dp, tp)): inside a node unless tp is larger
    scatter = _ring(act_bytes, tp, hw) if hw.cores else _ring(act_bytes, tp, hw, "reduce_scatter")
    gather = _ring(act_bytes, tp, hw, "all_gather")
    # On a GPU a region whose gathered input feeds one column-parallel layer runs Megatron's
    # overlap (slapo_tune.parallelize._GatheredLinear): its backward re-gather runs beside the
    # layer's input-gradient product and its reduce-scatter beside the weight-gradient product, so
    # only what outlasts the product is charged. Fusion makes the consumer single: the fused QKV
    # projection, and a gated MLP's fused gate and up; other layouts' single layers are not counted
    # (GPT-2's MLP under fuse=on is traced into its graph and keeps the plain gather). A CPU's
    # collectives run on the same cores as the products: nothing is hidden there
    qkv, _, mlp_in, _ = _block_linears(layout, hw, step)
    fused = gpu & (point["fuse"] == "on")
    single = [(fused, qkv), (fused & layout.gated_mlp, mlp_in)]
    hidden = sum(choose(one, _min(gather, product) + _min(scatter, product), 0.0) for one, product in single)
    tp_comm = choose(sp, slots * per_stage * (6 * gather + 4 * scatter - hidden),
                     slots * per_stage * 4 * _ring(act_bytes, tp, hw))
    # the last stage's LM head all-gathers each micro-batch's logits over the vocabulary; under
    # loss_parallel they stay sharded and the loss all-reduces three numbers per token instead
    sharded_loss = (tp > 1) & (point["loss_parallel"] == "on")
    tp_comm = tp_comm + m * choose(sharded_loss, 3 * _ring(tokens * 4, tp, hw),
                                   _ring(tokens * layout.vocab * B, tp, hw, "all_gather"))
    # context parallelism (counted with tp_comm: the blocks' collectives on the critical path, not
    # overlapped): each attention all-gathers K and V of the whole sequence over the cp group (ranks
    # tp apart), again when a checkpointed block recomputes, and again in backward where the chunked
    # kernels kept only the rank's own; backward reduce-scatters their gradients; the loss
    # all-reduces its token count
    kv_bytes = b * s * kv / tp * B
    cp_gather = _ring(kv_bytes, cp, hw, "all_gather", stride=tp)
    # (gloo's reduce-scatter costs what its all-reduce does, as for sequence parallelism's above)
    cp_reduce = _ring(kv_bytes, cp, hw, stride=tp) if hw.cores else _ring(kv_bytes, cp, hw, "reduce_scatter", stride=tp)
    cp_gathers = per_stage * (1 + step.chunked) + ckpt
    tp_comm = tp_comm + choose(cp > 1, 2 * slots * (cp_gathers * cp_gather + per_stage * cp_reduce)
                               + m * _ring(4, cp, hw, stride=tp), 0.0)
    # a hidden state (a sequence shard under sequence parallelism) and its gradient cross each rank
    # boundary; interleaved, each micro-batch crosses vpp times as many. Stages are tp x dp ranks
    # apart: across nodes once that fills one. On a GPU the steady state's sends run beside compute;
    # the fill and drain's do not
    pp_bytes = choose(sp, act_bytes / tp, act_bytes)
    pp_link = choose(gpu & (tp * dp >= hw.devices_per_node), hw.inter_bandwidth, hw.intra_bandwidth)
    transfers = 2 * (pp - 1) if gpu else 2 * (vpp * m + pp - 1)
    pp_comm = choose(pp > 1, transfers * (hw.latency + pp_bytes / pp_link), 0.0)
    # data parallelism: level 0 all-reduces the fp32 gradients once per step, after the backward;
    # FSDP all-gathers the parameters in the compute dtype and reduce-scatters fp32 gradients, as
    # often as its level reshards (see memory_terms); a data-parallel group's ranks are tp apart
    dp_stride = tp
    gathers, reduces = fsdp_collectives(level, m, pp, point["pipeline_schedule"])
    gather_s = _ring(stage_params * mode.param_bytes, dp, hw, "all_gather", stride=dp_stride)
    reduce_s = _ring(stage_params * GRAD_BYTES, dp, hw, "reduce_scatter", stride=dp_stride)
    fsdp = gathers * gather_s + reduces * reduce_s
    if gpu:
        # FSDP prefetches the next block's gathers and reduces the previous block's gradients on
        # their own streams (level 2 and 3): one block's first gather and last reduction are exposed,
        # and of the rest what fsdp_overlap of the compute cannot hide, at least 1 - fsdp_overlap
        compute, attention, elementwise = busy
        units = larger(1, per_stage)
        exposed = (gather_s + reduce_s) / units
        prefetched = larger(fsdp - exposed, 0.0)
        hidden_behind = fsdp_overlap * (compute + attention + elementwise)
        fsdp = choose(level >= 2, exposed + larger(prefetched - hidden_behind, (1 - fsdp_overlap) * prefetched), fsdp)
    dp_comm = choose(level == 0, _ring(stage_params * GRAD_BYTES, dp, hw, stride=dp_stride), fsdp)
    # context-parallel ranks sum their gradients (after FSDP's reduction: a dp shard of them)
    dp_comm = dp_comm + _ring(stage_params * GRAD_BYTES / choose(level > 0, dp, 1), cp, hw, stride=tp)
    return tp_comm, dp_comm, pp_comm


def weighted_time(terms: Mapping[str, Any], weights: Mapping[str, float] | None = None) -> tuple[dict[str, Any], Any]:
    """The time terms weighted (calibrated weights over the defaults), and their sum: the step's
    seconds (floats, or arrays of points)."""
    w = {**DEFAULT_TIME_WEIGHTS, **(weights or {})}
    breakdown = {k: w[k] * v for k, v in terms.items()}
    return breakdown, sum(breakdown.values())


def predict_time(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware,
                 weights: Mapping[str, float] | None = None, runtime: Runtime = OUR_RUNTIME) -> TimePrediction:
    breakdown, step = weighted_time(time_terms(layout, point, workload, hw, runtime=runtime), weights)
    return TimePrediction(step, breakdown)


def predict_steps(layout: ModelLayout, points: Mapping[str, np.ndarray], workload: Workload, hw: Hardware,
                  weights: Mapping[str, float] | None = None, runtime: Runtime = OUR_RUNTIME) -> np.ndarray:
    """:func:`predict_time`'s step seconds of many points at once (``points``: :func:`point_columns`)."""
    return weighted_time(time_columns(layout, points, workload, hw, runtime=runtime), weights)[1]


def model_flops_per_step(layout: ModelLayout, workload: Workload) -> float:
    """Useful training FLOPs of one step (6 x parameters x tokens + attention), for MFU."""
    tokens = workload.global_batch * workload.seq_len
    attn = 12 * layout.layers * layout.hidden * workload.seq_len * tokens
    return 6 * layout.parameters * tokens + attn


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.inf
