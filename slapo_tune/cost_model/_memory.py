"""The memory model's terms and what they are made of.

Memory per pipeline stage is a weighted sum of *terms*, each a byte count derived from the model's
sizes and the point's knobs (tensor parallelism divides what it shards, checkpointed blocks keep
only their input, a GPipe stage holds all its micro-batches in flight, a 1F1B stage ``s`` holds
``pp - s``, the last stage also holds the logits...). The weights are how many times a term's
bytes are alive at the peak; defaults come from the textbook counts and :mod:`.calibration`
fits them to exact-mode (or measured) points per device, model family and precision. Model
states follow the precision (fp32, amp-bf16, bf16 with fp32 master weights; fp8 as bf16) and the ZeRO level
(:func:`model_state_bytes`). What a block keeps is measured by the activation probe
(:mod:`._probe`), including what sequence parallelism puts on a sequence shard and what a
selectively checkpointed block keeps (:func:`block_activations`). The events of each stage, what
FSDP gathers and buffers during a step and the peak are :mod:`._stage`'s. Korthikanti et al.'s
per-layer activation formulas (:func:`megatron_activation_bytes`) are kept for comparison.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from ..plan import Workload, knob_value
from ..precision import Precision
from ._columns import _at_least_zero, _pick
from ._layout import ModelLayout, cp_gathers_keys, scores_materialised

MEMORY_TERMS = (
    "weights",  # parameters the rank holds between steps (sharded by tp; by dp under zero>=1: fp32 shards)
    "master",  # bf16: fp32 master weights (replicated: beside the bf16 weights; sharded: the shards)
    "gradients",  # fp32 gradients alive across micro-batches: whole (zero 0-1, pipelined) or shards (2-3)
    "gradients_single",  # the same without accumulation: created while activations are freed
    "grads_unsharded",  # gradients backward just made, in the compute dtype, before upcast or reduction (FSDP, autocast)
    "grads_transient",  # a gradient just made, before it is added in: a weight's, a tied embedding's, the embedding's
    "optimizer",  # AdamW's two fp32 moments per held parameter
    "optimizer_temp",  # the optimizer step's temporaries: a few copies of the largest parameter
    "gathered",  # FSDP: parameters gathered whole in the compute dtype (zero 1-2: the stage; 3: a block)
    "ag_buffer",  # FSDP: flat all-gather buffers, kept until the next unit's copy-out (or prefetched)
    "rs_buffer",  # FSDP: a reduce-scatter's fp32 input (whole unit) and output (its shard) buffers
    "rs_copy",  # gloo: the full-size copy of a reduce-scatter's input it reduces on (NCCL: none)
    "compute_copies",  # amp-bf16: autocast's bf16 copies of the weights (cached all step where replicated)
    "act_replicated",  # per-token activations every tp rank keeps (norm inputs, residuals)
    "act_parallel",  # per-token activations inside the tensor-parallel region (Q/K/V, MLP width)
    "act_scores",  # what attention keeps per score element (eager: softmax; fused SDPA: none)
    "act_fused",  # extra per-token tensors of decomposed / fused layers (fuse=on)
    "act_checkpointed",  # inputs of checkpointed blocks
    "act_selective",  # what selectively checkpointed blocks keep besides their input: matmul outputs
    "recompute",  # one block's activations rebuilt during its backward
    "backward_temp",  # a block's backward temporaries: MLP-wide gradients
    "score_grads",  # an attention backward's gradients of materialised scores (eager, SDPA's math fallback)
    "logits",  # per micro-batch in flight (last stage): the loss's fp32 log-softmax, a pipeline stage's output
    # (loss_parallel: the vocab / tp slice of each)
    "logits_grad",  # the loss's backward: two fp32 logits-sized gradients (log-softmax's and its input's;
    # loss_parallel: made in place of the softmax; one compute-dtype slice, the head's output or the cast,
    # and the head's backward beside it)
    "pp_recv",  # pipeline receive buffers in flight: activations (stages after the first), gradients (before the last)
    "pp_sends",  # interleaved pipelines: input gradients a rank has sent, not yet proven received (_send_release)
    "dp_buckets",  # the flat buffer gradients are averaged through (replicated data parallelism)
    "constant",  # 1 MiB units (none by default; a calibration may find some)
)

# What checkpointed blocks keep, per checkpointed block (the other activation terms: per full block).
CHECKPOINTED = frozenset({"act_checkpointed", "act_selective"})
# Activations: what forward passes keep for their backward (the logits included).
ACTIVATION_TERMS = ("act_replicated", "act_parallel", "act_scores", "act_fused", "act_checkpointed", "act_selective",
                    "logits")


def combine(events: Mapping[str, Mapping[str, float]], weights: Mapping[str, float]) -> tuple[float, str]:
    """Peak bytes of a stage: the largest weighted sum over its events, and that event."""
    best, name = -1.0, ""
    for event, terms in events.items():
        value = 0.0
        for k, v in terms.items():  # a plain loop: plan evaluates ~60k events for a 70B model
            if v:
                value += weights[k] * v
        if value > best:
            best, name = value, event
    return best, name


# How many times each term's bytes are alive at the peak, before calibration (activation weights
# follow Korthikanti et al. 2022: ~17 hidden-sized tensors per token and layer for GPT-style blocks).
DEFAULT_WEIGHTS = {
    "weights": 1.0,
    "master": 1.0,
    "gradients": 1.0,
    "gradients_single": 1.0,
    "grads_unsharded": 1.0,
    "grads_transient": 1.0,
    "optimizer": 1.0,
    "optimizer_temp": 2.0,
    "gathered": 1.0,
    "ag_buffer": 1.0,
    "rs_buffer": 1.0,
    "rs_copy": 1.0,
    "compute_copies": 1.0,
    "act_replicated": 1.0,
    "act_parallel": 1.0,
    "act_scores": 1.0,
    "act_fused": 1.0,
    "act_checkpointed": 1.0,
    "act_selective": 1.0,
    "recompute": 1.0,
    "backward_temp": 2.0,
    "score_grads": 1.0,
    "logits": 1.0,
    "logits_grad": 1.0,
    "pp_recv": 1.0,
    "pp_sends": 1.0,
    "dp_buckets": 1.0,
    # nothing of a fixed size is alive beyond the counted tensors (a real step's peak, measured):
    # a 1 MiB allowance made tiny models' predictions 13 % high on median; calibration may fit one
    "constant": 0.0,
}
# Relative, before calibration; pruning keeps a point unless even peak x (1 - this) exceeds the
# budget. Measured against every point of the recorded grids (benchmarks/data, torch's MemTracker
# on real steps), the uncalibrated model predicts -6.7 % to +18.8 % (GPT-2 tiny, world 2) and -5.1 %
# to +7.5 % (GPT-2 384-wide, world 1): a +18.8 % over-prediction needs at least 0.16.
DEFAULT_UNCERTAINTY = 0.2


# Bytes per parameter of the model states (slapo_tune.precision). Gradients are fp32 at every
# precision: fp32 parameters' own, bf16's master gradients, or FSDP's reduce dtype (fp32).
GRAD_BYTES = 4
SCORE_GRAD_BYTES = 8  # two fp32 gradients per attention-score element, where not measured (block_activations)
LOSS_BYTES = 4  # Hugging Face's losses upcast the logits: the log-softmax they keep is fp32 at every precision
MASTER_BYTES = 4  # bf16: fp32 master weights (MasterWeights where replicated, FSDP's fp32 shards where sharded)
SHARD_BYTES = 4  # FSDP's parameter shards are fp32 at every precision (the masters under bf16)
MOMENT_BYTES = 8  # AdamW's two fp32 moments


@functools.lru_cache(maxsize=64)
def model_state_bytes(mode: Precision, zero: int, dp: int) -> Mapping[str, float]:
    """Bytes per parameter of each model state held between steps, the closed forms of ZeRO:
    replicated fp32 / amp-bf16 16 (weights 4, gradients 4, AdamW 8), bf16 18 (bf16 weights 2,
    fp32 master 4, gradients 4, AdamW 8); sharded (``zero`` >= 1 over ``dp`` > 1 ranks) 16 / dp
    at every precision (fp32 shards 4, gradient shards 4, AdamW 8; under bf16 the shards are the
    masters and the bf16 weights exist only gathered)."""
    if zero and dp > 1:
        states = {"weights": 0.0 if mode.master else SHARD_BYTES / dp, "master": MASTER_BYTES / dp if mode.master else 0.0,
                  "gradients": GRAD_BYTES / dp, "optimizer": MOMENT_BYTES / dp}
    else:
        states = {"weights": float(mode.param_bytes), "master": float(MASTER_BYTES) if mode.master else 0.0,
                  "gradients": float(GRAD_BYTES), "optimizer": float(MOMENT_BYTES)}
    return MappingProxyType(states)  # cached: read-only


@dataclass
class StageTerms:
    stage: int
    params: int  # parameters held by the rank (its shard under sharded data parallelism)
    base: dict[str, float] = field(default_factory=dict)  # alive all step (model states, receive buffers)
    moments: dict[str, dict[str, float]] = field(default_factory=dict)  # what else is alive at each moment
    _events: dict[str, dict[str, float]] | None = field(default=None, repr=False, compare=False)

    @property
    def events(self) -> dict[str, dict[str, float]]:
        """Everything alive at each moment of the step (the base with each moment's own terms)."""
        if self._events is None:
            self._events = {name: {**self.base, **terms} for name, terms in self.moments.items()}
        return self._events

    def peak(self, weights: Mapping[str, float]) -> tuple[float, str]:
        """The largest weighted sum over the events, and that event (:func:`combine`, without
        summing the base once per event)."""
        total, name = combine(self.moments, weights)
        return total + sum(weights[k] * v for k, v in self.base.items()), name

    @property
    def terms(self) -> dict[str, float]:
        """Each term's largest byte count over the events."""
        out: dict[str, float] = {}
        for terms in self.events.values():
            for k, v in terms.items():
                if v > out.get(k, 0.0):
                    out[k] = v
        return out


class BlockActivations(NamedTuple):
    """Bytes one block keeps for its backward per micro-batch, on one rank (see :func:`block_activations`)."""

    replicated: float  # every tensor-parallel rank's (norm inputs, residuals, the regions' inputs; sp: a shard)
    parallel: float  # inside the tensor-parallel regions (Q/K/V, attention output, MLP width)
    scores: float  # per attention-score element (eager: the softmax; fused SDPA: none)
    fused: float  # decomposed / fused layers' extra tensors (fuse=on, where not probed)
    input: float  # the block's input: all a fully checkpointed block keeps, what stages receive
    selective: float  # besides its input, what a selectively checkpointed block keeps: matmul outputs
    selective_parallel: float  # the column-parallel part of ``selective`` (a plain block saves it too)
    # the gradients a block's attention backward holds at once where it materialises the scores
    score_grads: float = 0.0

    def kept(self, checkpointed: str | None = None) -> float:
        """All a block keeps: not checkpointed (None), ``"full"`` or ``"selective"``."""
        if checkpointed == "full":
            return self.input
        if checkpointed == "selective":
            return self.input + self.selective
        return self.replicated + self.parallel + self.scores + self.fused


def block_activations(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                      backend: str = "gloo") -> BlockActivations:
    """What one block of ``layout`` keeps per micro-batch under ``point``, from the activation
    probe's counts in the workload's precision, as measured (:func:`~._probe.activation_probe`; textbook
    counts where it could not run, which the layout's ``probe_fallbacks`` say):
    tensor parallelism divides the ``parallel`` part and the scores; sequence parallelism (``sp``)
    the part of ``replicated`` between the regions and the block's input; a selective
    checkpoint's matmul outputs (``selective``) are there only with ``ckpt_policy`` selective.
    ``backend`` ``nccl`` (CUDA ranks): SDPA runs a fused kernel (FlashAttention-2 or the
    memory-efficient one, attention dropout included) that keeps no scores, whatever the probe's
    CPU run kept (torch's math fallback under dropout); the time model charges it as such."""

    tp, b, attn, fuse = point["tp"], point["micro_batch"], point["attn"], point["fuse"]
    cp = knob_value(point, "cp")
    sp = tp > 1 and knob_value(point, "sp") == "on"
    selective = point["ckpt_ratio"] > 0 and knob_value(point, "ckpt_policy") == "selective"
    mode = workload.mode
    s, B = workload.seq_len, mode.activation_bytes
    q = layout.heads * layout.head_dim
    kv = layout.kv_heads * layout.head_dim
    attn_width = 2 * q + 2 * kv  # q, k, v and the attention output
    mlp_width = layout.intermediate * (3 if layout.gated_mlp else 2)
    # context parallelism: a rank's chunk of each sequence (s / cp tokens), whose queries attend to
    # the whole sequence's keys
    tokens = b * s / cp
    # a block's saved bytes per token, measured by the probe in the workload's precision: the part
    # every tensor-parallel rank keeps and the part it divides; the textbook counts (B bytes an
    # element) where the model could not be probed in it (the layout's probe_fallbacks say why)
    measured = dict(layout.token_bytes.get(mode.measured_as, {}))
    key = f"{attn}/{fuse}"
    fused_extra = 0.0
    if f"{key}/rep" in measured:
        rep_bytes, par_bytes = measured[f"{key}/rep"], measured[f"{key}/par"]
    elif f"{attn}/off/rep" in measured:
        rep_bytes, par_bytes = measured[f"{attn}/off/rep"], measured[f"{attn}/off/par"]
        fused_extra = layout.intermediate * B if fuse == "on" else 0.0
    else:
        rep_bytes, par_bytes = B * 5 * layout.hidden, B * (attn_width + mlp_width)
        fused_extra = layout.intermediate * B if fuse == "on" else 0.0
    if mode.fp8:
        # fp8: what bf16 keeps, less what the linear layers' inputs save as FP8 casts (fp8_saved_bytes)
        rep_save, par_save = fp8_saved_bytes(layout, mode)
        rep_bytes, par_bytes = max(0.0, rep_bytes - rep_save), max(0.0, par_bytes - par_save)
        for key_ in [k for k in measured if k.startswith("seq/")]:  # the regions' inputs, kept as shards
            measured[key_] = max(0.0, measured[key_] - rep_save)
    # sequence parallelism: the replicated bytes (norm inputs, residuals, dropout masks between the
    # tensor-parallel regions, and the regions' inputs, kept as shards and gathered again in
    # backward) are on a sequence shard; the textbook count: all of them
    seq_bytes = measured.get(f"seq/{fuse}", measured.get("seq/off", rep_bytes))
    seq_bytes = min(rep_bytes, seq_bytes) if sp else 0.0
    rep_1 = tokens * (rep_bytes - seq_bytes + seq_bytes / tp)
    par_1 = tokens * par_bytes / tp
    # cp > 1: attention keeps the keys and values gathered over the whole sequence (repeated to the
    # query heads under grouped-query attention) for its backward where it gathers them
    # (cp_gathers_keys); the chunked flash kernels keep only the rank's own, as without cp
    gathered_width = 2 * (q if layout.kv_heads < layout.heads else kv)
    gathers = cp_gathers_keys(layout, attn, mode, gpu=backend == "nccl")
    par_1 = par_1 + _pick((cp > 1) & gathers, b * s * gathered_width * B / tp, 0.0)
    # selective recomputation keeps the matmul outputs of a checkpointed block (row-parallel ones
    # whole: partial sums before their reduction; column-parallel ones divided), recomputes the rest
    sel_rep = measured.get("sel/rep", B * 2 * layout.hidden)
    sel_par = measured.get("sel/par", B * (q + 2 * kv + layout.intermediate * (2 if layout.gated_mlp else 1)))
    sel_par_1 = tokens * sel_par / tp if selective else 0.0
    sel_1 = tokens * sel_rep + sel_par_1 if selective else 0.0
    materialised = scores_materialised(layout, attn, workload.mode, gpu=backend == "nccl")
    score_bytes = layout.score_bytes.get(mode.measured_as, {}).get(attn, 2.0 * B if attn == "eager" else 0.0) \
        if materialised else 0.0
    scores_1 = b * (layout.heads / tp) * (s / cp) * s * score_bytes
    # the backward of materialised scores holds two score-sized gradients at once (the softmax's
    # output's and its input's), in the dtype the softmax ran in (measured; textbook: fp32)
    grad_bytes = layout.score_bytes.get(mode.measured_as, {}).get(f"{attn}/grad", SCORE_GRAD_BYTES)
    score_grads_1 = b * (layout.heads / tp) * (s / cp) * s * grad_bytes if score_bytes else 0.0
    fused_1 = tokens * fused_extra / tp
    # a block's input: checkpointed blocks keep it, pipeline stages receive it (a sequence shard
    # under sequence parallelism); the residual stream is in the parameters' dtype (fp32 under
    # autocast, which casts only what the matrix products read)
    hidden_1 = tokens * layout.hidden * mode.param_bytes / (tp if sp else 1)
    return BlockActivations(rep_1, par_1, scores_1, fused_1, hidden_1, sel_1, sel_par_1, score_grads_1)


def fp8_saved_bytes(layout: ModelLayout, mode) -> tuple[float, float]:
    """Bytes per token one block's saved activations lose when its linear layers save FP8 casts of
    their inputs (precision fp8) instead of the compute dtype's: (the part every tensor-parallel rank
    keeps, the part tensor parallelism divides, before dividing it). Each distinct linear input is
    counted once (Q, K and V share theirs, as do a gated MLP's gate and up projections: one cast under
    torch.compile or Transformer Engine's fused layers): the attention's and the MLP's inputs (hidden
    wide, replicated), the attention output's projection input and the MLP's down projection input
    (tensor-parallel). Nothing else changes: norms, the attention core and softmax stay bf16."""
    saved = mode.activation_bytes - mode.linear_input_bytes
    return (saved * 2 * layout.hidden,
            saved * (layout.heads * layout.head_dim + layout.intermediate))


# precision fp8: the fp32 amax and scale of a linear layer's input, weight and output gradient
FP8_SCALE_BYTES = 6 * 4


def fp8_transient_bytes(layout: ModelLayout, tp: Any, blocks: Any) -> Any:
    """Precision fp8: bytes of the FP8 weight copies and scales alive at any moment of a step, on a
    rank holding ``blocks`` blocks: the FP8 cast of the largest linear weight (an MLP matrix) and
    its transposed cast for the backward's input gradient (each made when its layer runs, freed
    after), and every linear layer's amax/scale scalars (:data:`FP8_SCALE_BYTES`)."""
    linears = 4 + (3 if layout.gated_mlp else 2)  # Q, K, V, output; the MLP's
    return 2 * layout.hidden * layout.intermediate / tp + blocks * linears * FP8_SCALE_BYTES


def vector_peak(st: StageTerms, weights: Mapping[str, float], n: int) -> np.ndarray:
    """:meth:`StageTerms.peak`'s total for terms that are arrays of ``n`` points (see
    :func:`~._stage.stage_builder`): per point, the same float operations in the same order (a zero term
    :func:`combine` skips adds zero here)."""
    best = np.full(n, -1.0)
    for terms in st.moments.values():
        value = 0.0
        for k, v in terms.items():
            if v.__class__ is float and not v:
                continue  # adds nothing
            w = weights[k]
            value = value + (v if w == 1.0 else w * v)  # 1.0 * v is v, bit for bit
        best = np.maximum(best, value)
    return best + sum(weights[k] * v for k, v in st.base.items())


class LinearFeatures(NamedTuple):
    """What the terms of a ``linear`` :func:`~._stage.stage_builder` are multiples of, for one point: a
    constant, the fields of :class:`BlockActivations` the terms read and the activations a
    checkpointed block's backward rebuilds."""

    constant: float
    replicated: float
    parallel: float
    scores: float
    fused: float
    input: float
    selective: float
    recompute: float
    score_grads: float

    @classmethod
    def of(cls, acts: BlockActivations) -> LinearFeatures:
        rebuilt = _at_least_zero(acts.replicated + acts.parallel + acts.scores + acts.fused - acts.selective_parallel)
        return cls(1.0, acts.replicated, acts.parallel, acts.scores, acts.fused, acts.input, acts.selective, rebuilt,
                   acts.score_grads)


UNIT_ACTIVATIONS = BlockActivations(*[1.0] * len(BlockActivations._fields))
# the feature (index in LinearFeatures) each term is a multiple of; every other term is a constant
LINEAR_FIELD = MappingProxyType({"act_replicated": 1, "act_parallel": 2, "act_scores": 3, "act_fused": 4,
                                 "act_checkpointed": 5, "pp_recv": 5, "pp_sends": 5, "act_selective": 6, "recompute": 7,
                                 "score_grads": 8})
_TERM_FIELD = MappingProxyType({k: LINEAR_FIELD.get(k, 0) for k in MEMORY_TERMS})


def linear_terms(st: StageTerms, weights: Mapping[str, float], n: int
                 ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The events of a ``linear`` stage (:func:`~._stage.stage_builder`) of a batch of ``n`` rows as an
    (n, events, features) array: each row's events' weighted multiples of :class:`LinearFeatures`,
    the base's included, whose product with a point's features is :meth:`StageTerms.peak`'s sum
    for that event, the same products added in another order; and where a weighted term is
    negative, the array of their magnitudes (the rounding of either sum is bounded by its
    product, no more by the total's). None where a term is unknown."""
    field = _TERM_FIELD
    try:  # each term as (its feature, its weighted bytes)
        base = [(field[k], weights[k] * v) for k, v in st.base.items()]
        moments = [[(field[k], weights[k] * v) for k, v in terms.items()] for terms in st.moments.values()]
    except KeyError:  # a term without a feature or a weight
        return None

    def matrix(size: Callable = lambda t: t) -> np.ndarray:
        rows = np.zeros((n, len(LinearFeatures._fields)))
        for f, t in base:
            rows[:, f] += size(t)
        events = np.repeat(rows[:, None, :], len(moments), axis=1)
        for j, terms in enumerate(moments):
            for f, t in terms:
                events[:, j, f] += size(t)
        return events

    negative = any(_any_negative(t) for _, t in itertools.chain(base, *moments))
    return matrix(), matrix(np.abs) if negative else None


def _any_negative(t: float | np.ndarray) -> bool:
    """Whether a weighted term, a number or an array of the batch's rows, is negative anywhere
    (``np.any`` of a number costs microseconds, and a space's groups ask it of millions of terms)."""
    return bool((t < 0).any()) if isinstance(t, np.ndarray) else t < 0


@dataclass
class MemoryPrediction:
    """Peak bytes per stage, the worst stage and its breakdown, and the model's uncertainty.

    Only the stages that can hold the peak are evaluated up front (:func:`~._schedule_math.dominant_stages`); the
    others are when ``per_stage`` is first read."""

    peaks: dict[int, int]  # peak bytes of the stages evaluated so far
    breakdown: dict[str, int]
    uncertainty: float
    params_per_rank: int
    worst_stage: int = 0
    stages: int = 1
    rest: Callable[[list[int]], dict[int, int]] | None = field(default=None, repr=False, compare=False)

    @property
    def per_stage(self) -> list[int]:
        missing = [s for s in range(self.stages) if s not in self.peaks]
        if missing:
            self.peaks.update(self.rest(missing))
        return [self.peaks[s] for s in range(self.stages)]

    @property
    def peak(self) -> int:
        return self.peaks[self.worst_stage]

    @property
    def upper(self) -> int:
        return int(self.peak * (1 + self.uncertainty))

    @property
    def lower(self) -> int:
        return optimistic(self.peak, self.uncertainty)


def optimistic(peak: float, uncertainty: float) -> int:
    """The optimistic end of a predicted peak: what pruning compares with the budget."""
    return int(peak * (1 - uncertainty))


# ---------------------------------------------------------------- published reference
# The closed forms the techniques were published with, for comparison (benchmarks.techniques, and a
# test that the analytic model moves the same way). Megatron's counts are for its fused kernels and
# 2-byte activations; the analytic model counts what Hugging Face blocks keep (the activation probe).
RECOMPUTE = ("none", "selective", "full")


def megatron_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, sp: bool = False,
                              recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps, Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models", Table 2), 16-bit activations:
    ``sbh (34 + 5as/h)`` without parallelism, ``sbh (10 + 24/t + 5as/(ht))`` with tensor
    parallelism, ``sbh/t (34 + 5as/h)`` with tensor and sequence parallelism; selective
    recomputation drops the attention-score term ``5as/h``; full recomputation keeps only the
    layer's input, ``2sbh`` (``/t`` with sequence parallelism)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)
