"""Analytic memory and time: closed-form terms, microseconds per point.

Memory per pipeline stage is a weighted sum of *terms*, each a byte count derived from the model's
sizes and the point's knobs (tensor parallelism divides what it shards, checkpointed blocks keep
only their input, a GPipe stage holds all its micro-batches in flight, a 1F1B stage ``s`` holds
``pp - s``, the last stage also holds the logits...). The weights are how many times a term's
bytes are alive at the peak; defaults come from the textbook counts and :mod:`.calibration`
fits them to exact-mode (or measured) points per device, model family and dtype.

Time is compute (FLOPs at an achievable rate, recomputation included) plus a fixed cost per block
and micro-batch, plus tensor-parallel, data-parallel and pipeline communication (alpha-beta), with
the pipeline bubble: good enough to rank points.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..template import Template, Workload, accumulation
from .hardware import Hardware

MEMORY_TERMS = (
    "weights",  # parameters held by the rank (sharded by tp, and by dp under zero=3)
    "gradients",  # their gradients, alive from the first micro-batch on when accumulating
    "gradients_single",  # the same without accumulation: created while activations are freed
    "optimizer",  # AdamW's two moments per held parameter
    "optimizer_temp",  # the optimizer step's temporaries: a few copies of the largest parameter
    "gathered",  # zero=3: a block (and its prefetched successor) plus the stage root, unsharded
    "act_replicated",  # per-token activations every tp rank keeps (norm inputs, residuals)
    "act_parallel",  # per-token activations inside the tensor-parallel region (Q/K/V, MLP width)
    "act_scores",  # eager attention's score matrices
    "act_scores_sdpa",  # the same under SDPA (fused kernels keep none; math fallbacks keep them)
    "act_fused",  # extra per-token tensors of decomposed / fused layers (fuse=on)
    "act_checkpointed",  # inputs of checkpointed blocks
    "recompute",  # one block's activations rebuilt during its backward
    "logits",  # logits and the loss's softmax saved per micro-batch in flight (last stage)
    "logits_grad",  # the gradient of one micro-batch's logits (last stage, loss phase)
    "constant",  # 1 MiB units
)

# The peak is reached in one of several phases of a step; terms not listed here are alive in all
# of them. Loss: the logits, their softmax and gradient. Backward: a checkpointed block rebuilt.
# Optimizer: AdamW's temporaries, once activations are gone.
PHASES = {
    "loss": ("logits_grad",),
    "backward": ("recompute",),
    "optimizer": ("optimizer_temp",),
}
PHASE_TERMS = {t for terms in PHASES.values() for t in terms}
ACTIVATION_TERMS = ("act_replicated", "act_parallel", "act_scores", "act_scores_sdpa", "act_fused",
                    "act_checkpointed", "logits")


_PHASE_ITEMS = tuple(PHASES.items())


def combine(terms: Mapping[str, float], weights: Mapping[str, float]) -> tuple[float, str]:
    """Peak bytes of a stage from its terms, and the phase that reaches it."""
    always = activations = 0.0
    for k, v in terms.items():
        if k in ACTIVATION_TERMS:
            activations += weights[k] * v
        elif k not in PHASE_TERMS:
            always += weights[k] * v
    best, phase = -1.0, "loss"
    for name, members in _PHASE_ITEMS:
        value = 0.0 if name == "optimizer" else activations
        for k in members:
            value += weights[k] * terms.get(k, 0.0)
        if value > best:
            best, phase = value, name
    return always + best, phase


# How many times each term's bytes are alive at the peak, before calibration (activation weights
# follow Korthikanti et al. 2022: ~17 hidden-sized tensors per token and layer for GPT-style blocks).
DEFAULT_WEIGHTS = {
    "weights": 1.0,
    "gradients": 1.0,
    "gradients_single": 1.0,
    "optimizer": 1.0,
    "optimizer_temp": 2.0,
    "gathered": 1.0,
    "act_replicated": 5.0,
    "act_parallel": 1.0,
    "act_scores": 2.0,
    "act_scores_sdpa": 0.0,
    "act_fused": 1.0,
    "act_checkpointed": 1.0,
    "recompute": 1.0,
    "logits": 2.0,
    "logits_grad": 1.0,
    "constant": 1.0,
}
DEFAULT_UNCERTAINTY = 0.15  # relative, before calibration


@dataclass(frozen=True)
class ModelLayout:
    """The parameter and activation sizes of one model, found once from its meta-device build."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    block_sharded: int  # per block: parameters tensor parallelism splits
    block_replicated: int  # per block: parameters every tp rank keeps
    pre_sharded: int  # before the blocks (token embedding)
    pre_replicated: int  # before the blocks (positions, embedding norms)
    post_sharded: int  # after the blocks (LM head) if not tied to the embedding
    post_replicated: int  # after the blocks (final norm, head transform)
    tied_head: bool

    @property
    def parameters(self) -> int:
        return (self.layers * (self.block_sharded + self.block_replicated) + self.pre_sharded
                + self.pre_replicated + self.post_sharded + self.post_replicated)


def layout_of(config, template: Template) -> ModelLayout:
    """Measure a model from its config: which parameters sit in a block, before and after the
    blocks. Only a two-block copy is built (on the meta device); blocks are alike."""
    import copy

    from .._pipeline import _dry_run, _topmost
    from ..models import model_from_config

    layers = config.num_hidden_layers
    small_config = copy.deepcopy(config)
    small_config.num_hidden_layers = min(2, layers)
    model = model_from_config(small_config, "meta")
    blocks_path = template.blocks_path(model)
    block0 = model.get_submodule(blocks_path)[0]

    def split(params) -> tuple[int, int]:
        params = list(params)
        sharded = sum(p.numel() for p in params if p.dim() >= 2)
        return sharded, sum(p.numel() for p in params if p.dim() < 2)

    block_sharded, block_rep = split(block0.parameters())
    calls = _dry_run(model)
    start = calls[f"{blocks_path}.0"].order
    pre, post = [], []
    for path, m in model.named_modules():
        if (not path or path not in calls or path == blocks_path or path.startswith(blocks_path + ".")
                or blocks_path.startswith(path + ".") or not any(True for _ in m.parameters())):
            continue
        (pre if calls[path].order < start else post).append(path)
    pre_params = {id(p): p for path in _topmost(pre) for p in model.get_submodule(path).parameters()}
    post_params = {id(p): p for path in _topmost(post) for p in model.get_submodule(path).parameters()}
    tied = bool(set(pre_params) & set(post_params))
    post_only = [p for k, p in post_params.items() if k not in pre_params]
    pre_sharded, pre_rep = split(pre_params.values())
    post_sharded, post_rep = split(post_only)
    heads = config.num_attention_heads
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = (getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
             or getattr(config, "n_inner", None) or 4 * hidden)
    gated = any(hasattr(m, "gate_proj") for _, m in block0.named_modules())
    return ModelLayout(
        family=getattr(config, "model_type", "model"), layers=layers, hidden=hidden, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate=inter, vocab=config.vocab_size, gated_mlp=gated,
        block_sharded=block_sharded, block_replicated=block_rep, pre_sharded=pre_sharded,
        pre_replicated=pre_rep, post_sharded=post_sharded, post_replicated=post_rep, tied_head=tied,
    )


PARAM_BYTES = 4  # parameters and gradients are fp32 (16-bit training computes under autocast)
MOMENT_BYTES = 8  # AdamW's two fp32 moments: with them, 16 bytes of model state per parameter
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def in_flight(point: Mapping[str, Any], stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    pp = point["pp"]
    if pp == 1:
        return 1
    if point["pipeline_schedule"] == "gpipe":
        return micro_batches
    return min(pp - stage, micro_batches)


@functools.lru_cache(maxsize=4096)
def checkpointed_count(layers_on_stage: int, ratio: float, total_layers: int, pp: int) -> int:
    from ..parallelize import checkpointed_indices

    chosen = checkpointed_indices(total_layers, ratio, "uniform")
    # uniform spreading gives every stage its share; count the worst stage's
    return max(sum(1 for i in chosen if s * layers_on_stage <= i < (s + 1) * layers_on_stage) for s in range(pp))


@dataclass
class StageTerms:
    stage: int
    terms: dict[str, float]
    params: int  # parameters held by the rank


def memory_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload) -> list[StageTerms]:
    """The byte count of every memory term, per pipeline stage."""
    tp, pp, dp = point["tp"], point["pp"], point["dp"]
    b, s, B = point["micro_batch"], workload.seq_len, DTYPE_BYTES[workload.dtype]
    P = PARAM_BYTES
    m = accumulation(point, workload)
    per_stage = layout.layers // pp
    ckpt = checkpointed_count(per_stage, point["ckpt_ratio"], layout.layers, pp)
    full = per_stage - ckpt
    sharded = point["zero"] == 3 and dp > 1
    zero_div = dp if sharded else 1
    q = layout.heads * layout.head_dim
    kv = layout.kv_heads * layout.head_dim
    attn_width = 2 * q + 2 * kv  # q, k, v and the attention output
    mlp_width = layout.intermediate * (3 if layout.gated_mlp else 2)
    tokens = b * s
    rep_1 = tokens * layout.hidden * B
    par_1 = tokens * (attn_width + mlp_width) / tp * B
    scores = b * (layout.heads / tp) * s * s * B
    scores_1 = scores if point["attn"] == "eager" else 0.0
    sdpa_1 = scores if point["attn"] == "sdpa" else 0.0
    fused_1 = tokens * layout.intermediate / tp * B if point["fuse"] == "on" else 0.0
    block = layout.block_sharded / tp + layout.block_replicated
    largest = max(layout.block_sharded / 4, layout.pre_sharded, layout.post_sharded) / tp
    out = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        ends = 0.0
        if first:
            ends += layout.pre_sharded / tp + layout.pre_replicated
        if last:
            ends += layout.post_sharded / tp + layout.post_replicated
            if layout.tied_head and not first:
                ends += layout.pre_sharded / tp  # the last stage's copy of the tied embedding
        params = per_stage * block + ends
        flight = in_flight(point, stage, m)
        logits_flight = m if (pp > 1 and point["pipeline_schedule"] == "gpipe") else 1
        # zero=3 reduce-scatters gradients only after the last micro-batch: until then they are whole
        whole = params if (not sharded or m > 1) else 0.0
        grads = (whole + (params / dp if sharded else 0.0)) * P
        terms = {
            "weights": params / zero_div * P,
            "gradients": grads if m > 1 else 0.0,
            "gradients_single": grads if m == 1 else 0.0,
            "optimizer": params / zero_div * MOMENT_BYTES,
            "optimizer_temp": largest / zero_div * P,
            "gathered": (2 * block + ends) * P if sharded else 0.0,
            "act_replicated": rep_1 * full * flight,
            "act_parallel": par_1 * full * flight,
            "act_scores": scores_1 * full * flight,
            "act_scores_sdpa": sdpa_1 * full * flight,
            "act_fused": fused_1 * full * flight,
            "act_checkpointed": rep_1 * ckpt * flight,
            "recompute": (rep_1 + par_1 + scores_1 + sdpa_1 + fused_1) if ckpt else 0.0,
            "logits": tokens * layout.vocab * B * logits_flight if last else 0.0,
            "logits_grad": tokens * layout.vocab * B if last else 0.0,
            "constant": 2**20,
        }
        out.append(StageTerms(stage, terms, int(params / zero_div)))
    return out


@dataclass
class MemoryPrediction:
    """Peak bytes per stage, the worst stage and its breakdown, and the model's uncertainty."""

    per_stage: list[int]
    breakdown: dict[str, int]
    uncertainty: float
    params_per_rank: int
    worst_stage: int = 0

    @property
    def peak(self) -> int:
        return max(self.per_stage)

    @property
    def upper(self) -> int:
        return int(self.peak * (1 + self.uncertainty))

    @property
    def lower(self) -> int:
        return int(self.peak * (1 - self.uncertainty))


def predict_memory(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                   weights: Mapping[str, float] | None = None,
                   uncertainty: float = DEFAULT_UNCERTAINTY) -> MemoryPrediction:
    w = {**DEFAULT_WEIGHTS, **(weights or {})}
    stages = memory_terms(layout, point, workload)
    totals = [combine(st.terms, w)[0] for st in stages]
    worst = max(range(len(totals)), key=totals.__getitem__)
    _, phase = combine(stages[worst].terms, w)
    inactive = PHASE_TERMS - set(PHASES[phase]) | (set(ACTIVATION_TERMS) if phase == "optimizer" else set())
    breakdown = {k: int(w[k] * v) for k, v in stages[worst].terms.items() if k not in inactive}
    return MemoryPrediction([int(t) for t in totals], breakdown, uncertainty, stages[worst].params, worst)


# ---------------------------------------------------------------- time
TIME_TERMS = ("compute", "overhead", "tp_comm", "dp_comm", "pp_comm")
DEFAULT_TIME_WEIGHTS = {k: 1.0 for k in TIME_TERMS}


@dataclass
class TimePrediction:
    step: float  # seconds per optimizer step
    breakdown: dict[str, float] = field(default_factory=dict)

    def throughput(self, workload: Workload) -> float:
        """Samples per second."""
        return workload.global_batch / self.step if self.step > 0 else 0.0


def _ring(bytes_: float, n: int, hw: Hardware, kind: str = "all_reduce") -> float:
    if n <= 1 or bytes_ <= 0:
        return 0.0
    spans = n > hw.devices_per_node
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * hw.latency + factor * bytes_ / hw.bandwidth(n, spans)


def time_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware) -> dict[str, float]:
    """Seconds per step of each time term (before weights)."""
    tp, pp, dp = point["tp"], point["pp"], point["dp"]
    b, s, B = point["micro_batch"], workload.seq_len, DTYPE_BYTES[workload.dtype]
    m = accumulation(point, workload)
    per_stage = layout.layers // pp
    ckpt = checkpointed_count(per_stage, point["ckpt_ratio"], layout.layers, pp)
    tokens = b * s
    block_params = layout.block_sharded / tp + layout.block_replicated
    attn_flops = 4 * b * s * s * layout.heads * layout.head_dim / tp  # QK^T and AV, forward
    block_fwd = 2 * tokens * block_params + attn_flops
    stage_fwd = per_stage * block_fwd
    head_fwd = 2 * tokens * (layout.pre_sharded if layout.tied_head else layout.post_sharded) / tp
    flops_mb = 3 * (stage_fwd + head_fwd) + ckpt * block_fwd  # forward + backward, recomputation
    world = tp * pp * dp
    rate = hw.flops
    if hw.cores:  # CPU: ranks share the cores; more ranks than cores time-slice
        threads = max(1, hw.cores // world)
        rate = hw.flops * threads / max(1.0, world / hw.cores)
    compute = (m + pp - 1) * flops_mb / rate
    overhead = (m + pp - 1) * per_stage * hw.overhead_per_layer * (1 + (2 if tp > 1 else 0))
    act_bytes = tokens * layout.hidden * B
    tp_comm = (m + pp - 1) * per_stage * 4 * _ring(act_bytes, tp, hw)
    pp_comm = 2 * (m + pp - 1) * (hw.latency + act_bytes / hw.intra_bandwidth) if pp > 1 else 0.0
    stage_param_bytes = per_stage * block_params * PARAM_BYTES
    if dp > 1 and point["zero"] == 3:
        dp_comm = (2 * m * _ring(stage_param_bytes, dp, hw, "all_gather")
                   + _ring(stage_param_bytes, dp, hw, "all_gather"))
    else:
        dp_comm = _ring(stage_param_bytes, dp, hw)
    return {"compute": compute, "overhead": overhead, "tp_comm": tp_comm, "dp_comm": dp_comm, "pp_comm": pp_comm}


def predict_time(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, hw: Hardware,
                 weights: Mapping[str, float] | None = None) -> TimePrediction:
    w = {**DEFAULT_TIME_WEIGHTS, **(weights or {})}
    terms = time_terms(layout, point, workload, hw)
    breakdown = {k: w[k] * v for k, v in terms.items()}
    return TimePrediction(sum(breakdown.values()), breakdown)


def model_flops_per_step(layout: ModelLayout, workload: Workload) -> float:
    """Useful training FLOPs of one step (6 x parameters x tokens + attention), for MFU."""
    tokens = workload.global_batch * workload.seq_len
    attn = 12 * layout.layers * layout.hidden * workload.seq_len * tokens
    return 6 * layout.parameters * tokens + attn


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.inf
