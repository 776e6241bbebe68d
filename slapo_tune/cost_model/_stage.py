"""The memory of each pipeline stage: the byte count of every term at each event of a step
(:func:`memory_terms`, one stage at a time: :func:`stage_builder`) and the predicted peak
(:func:`predict_memory`).

What FSDP gathers and buffers during a step follows the ZeRO level and whether a pipeline defers its
reduction; an interleaved pipeline rank holds what torch's interleaved 1F1B warm-up leaves in flight
(:func:`~._schedule_math.interleaved_warmup`). :func:`stage_builder` reads a point's knobs once
(:func:`_read_knobs`, a :class:`_Knobs`), then per stage its sizes (:func:`_stage_of`, a
:class:`_Stage`) and its events: the forward's, each backward variant's, an interleaved rank's last
ones, the gradients' synchronisation and the optimizer step's. The knobs may be array columns
(:mod:`._columns`): every term is then an array, each element the float operations of its row alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from .._partition import GRADIENT_BUCKET_BYTES as DP_BUCKET_BYTES
from .._partition import chunk_block_counts, rank_block_count
from ..parallel._send_release import ReceiveBuffers
from ..plan import Workload, accumulation, knob_value
from ._columns import _any, _at_least_zero, _each, _int, _max, _min, _nonzero, _pick, _same, _scalar
from ._layout import ModelLayout
from ._memory import (
    CHECKPOINTED,
    DEFAULT_UNCERTAINTY,
    DEFAULT_WEIGHTS,
    GRAD_BYTES,
    LOSS_BYTES,
    UNIT_ACTIVATIONS,
    BlockActivations,
    MemoryPrediction,
    StageTerms,
    block_activations,
    fp8_transient_bytes,
    model_state_bytes,
)
from ._schedule_bounds import schedule_bounds
from ._schedule_math import (
    _flights,
    _stage_ckpt_summary,
    blocks_in_flight,
    checkpointed_in_flight,
    dominant_stages,
    first_chunk_share,
    interleaved_warmup,
)


def memory_terms(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                 backend: str = "nccl", stages: Iterable[int] | None = None) -> list[StageTerms]:
    """The byte count of every memory term at each event of a step, per pipeline stage (of
    ``stages`` only, if given). Moments another one outweighs term by term are left out.

    Model states follow :func:`model_state_bytes`. During the step, data parallelism adds what
    its ZeRO level keeps (see :mod:`slapo_tune.parallel._data_parallel`): level 0 averages whole fp32
    gradients through flat buckets; FSDP (levels 1-3) gathers parameters in the compute dtype and
    reduce-scatters fp32 gradients through a flat input buffer per unit (a block, or the stage
    root). Level 2 keeps the stage gathered from forward to the end of each micro-batch's backward,
    reducing block by block; level 1 is level 2 with the reduction and resharding deferred to the
    step's last backward (gradients whole, fp32 once a block's backward ends); level 3 gathers a
    block at a time (and prefetches the next). Under pipelining the schedule defers every level's
    reduction and resharding to the step's last backward. ``backend`` ``gloo`` also counts the full-size copy gloo
    makes of a reduce-scatter's input (it has no reduce-scatter of its own); NCCL reduces in place.
    """
    stage_terms = stage_builder(layout, point, workload, backend)
    return [stage_terms(stage) for stage in (range(point["pp"]) if stages is None else stages)]


def stage_builder(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                  backend: str = "nccl", acts: BlockActivations | None = None,
                  linear: bool = False) -> Callable[[int], StageTerms]:
    """:func:`memory_terms` one stage at a time: the knobs read once, a function of the stage.

    ``acts``: what a block keeps, if not ``point``'s (:func:`block_activations`, the only thing
    read of the knobs that change it). Its fields may be numpy arrays, one element per point: the
    terms are then arrays, each element the same float operations as for that point alone.

    ``linear``: every term is linear in what a block keeps (each a multiple of one of
    :class:`~._memory.LinearFeatures`, or none); the terms are then the multiples, whatever a block keeps
    (:func:`~._memory.linear_terms` reads them)."""
    return functools.partial(_stage_terms, _read_knobs(layout, point, workload, backend, acts, linear))


class _Knobs(NamedTuple):
    """What :func:`stage_builder` reads of a point and its workload, once for every stage
    (:func:`_read_knobs` says what each is)."""

    layout: ModelLayout
    linear: bool
    mode: Any  # the workload's precision (slapo_tune.precision)
    tp: Any
    pp: Any
    dp: Any
    ratio: Any
    schedule: Any
    pipelined: bool
    vpp: Any
    B: int
    Pb: int
    m: Any
    accumulating: bool
    level: int
    sharded: bool
    deferred: bool
    gpipe: bool
    grads_key: str
    interleaved: bool
    gloo: bool
    state_bytes: dict[str, Any]
    tokens: Any
    fused_loss: Any
    vocab_shards: Any
    rep_1: Any
    par_1: Any
    scores_1: Any
    fused_1: Any
    sel_1: Any
    sel_par_1: Any
    hidden_1: Any
    score_grads_1: Any
    mlp_par_share: Any
    mlp_rep_share: float
    temp_1: Any
    block: Any
    largest: Any
    copy_bytes: int
    head_matrix: Any
    mlp_matrix: Any
    embedding: Any
    tied_wait: Any


def _read_knobs(layout: ModelLayout, point: Mapping[str, Any], workload: Workload, backend: str,
                acts: BlockActivations | None, linear: bool) -> _Knobs:
    """:func:`stage_builder`'s knobs, read once."""

    # the knobs, read once (a Plan's mapping access is not free: plan evaluates ~15k points)
    tp, pp, dp, b = point["tp"], point["pp"], point["dp"], point["micro_batch"]
    zero, ratio, schedule = point["zero"], point["ckpt_ratio"], point["pipeline_schedule"]
    pipelined = _same(pp > 1)
    vpp = knob_value(point, "vpp") if pipelined else 1  # a point without it means what it always meant
    mode = workload.mode
    s, B = workload.seq_len, mode.activation_bytes
    Pb = mode.param_bytes  # what the model computes with: held (replicated) or gathered (FSDP)
    m = accumulation(workload, dp, b)
    accumulating = _same(m > 1)
    level = _scalar(_pick(dp > 1, zero, 0))  # the ZeRO level in effect: nothing is sharded over one rank
    sharded = level > 0
    # torch's pipeline schedule turns FSDP's gradient sync and resharding after backward off until
    # the step's last backward (with one micro-batch, the first backward is the last); so does the
    # runtime at ZeRO-1 on one stage (runtime._accumulate)
    deferred = sharded and accumulating and (pipelined or level == 1)
    # ZeRO-1 is level 2's units (a block each, kept gathered after forward) whose reduction is
    # always deferred as above: what it holds during a step is level 2's, deferred or not
    if sharded:
        level = max(level, 2)
    gpipe = _same(schedule == "gpipe")
    # the gradients a backward makes before any were accumulated (one micro-batch: the step's only)
    grads_key = "gradients" if accumulating else "gradients_single"
    interleaved = _same(vpp > 1)
    gloo = backend == "gloo"
    state_bytes = {k: _each(lambda d, k=k: model_state_bytes(workload.mode, level, d)[k], dp)
                   for k in ("weights", "master", "optimizer")}
    tokens = b * s / knob_value(point, "cp")  # context parallelism: this rank's chunk of each sequence
    # loss_parallel: the loss in place on the head's logits (the vocabulary-parallel cross-entropy,
    # over a vocab / tp slice when tp > 1); off: Hugging Face's loss (a point without the knob: off)
    fused_loss = knob_value(point, "loss_parallel") == "on"
    vocab_shards = _pick((tp > 1) & fused_loss, tp, 1)
    if linear:
        acts = UNIT_ACTIVATIONS
    elif acts is None:
        acts = block_activations(layout, point, workload, backend)
    rep_1, par_1, scores_1, fused_1 = acts.replicated, acts.parallel, acts.scores, acts.fused
    sel_1, sel_par_1, hidden_1 = acts.selective, acts.selective_parallel, acts.input
    score_grads_1 = acts.score_grads
    # of a block's activations, the share its MLP keeps (freed once the MLP's backward is done): the
    # textbook widths' of the tensor-parallel part, half of the replicated part (one of two norms)
    attn_width = 2 * layout.heads * layout.head_dim + 2 * layout.kv_heads * layout.head_dim
    mlp_width = layout.intermediate * (3 if layout.gated_mlp else 2)
    mlp_par_share, mlp_rep_share = mlp_width / (attn_width + mlp_width), 0.5
    temp_1 = tokens * layout.intermediate / tp * B  # one MLP-wide gradient, alive in a block's backward
    block = layout.block_sharded / tp + layout.block_replicated
    largest = max(layout.block_sharded / 4, layout.pre_sharded, layout.post_sharded) / tp
    # amp-bf16: autocast's bf16 copies of the weights matrix products use. Replicated, its cache
    # keeps one per weight for the whole step; under FSDP (cache off) each micro-batch in flight
    # saves its own for backward, as an activation
    copy_bytes = B if mode.autocast_type is not None else 0
    head_matrix = (layout.pre_sharded if layout.tied_head else layout.post_sharded) / tp
    # the largest weight gradient a block's backward makes at once (an MLP matrix), alive beside
    # what is accumulated before it is added in (the same for every attention kernel and fusion:
    # points differing only in those share these terms)
    mlp_matrix = layout.hidden * layout.intermediate / tp
    embedding = layout.pre_sharded / tp
    # a tied embedding's gradient from the head, held until the embedding's backward adds its own
    tied_wait = embedding if layout.tied_head and not pipelined else 0.0
    return _Knobs(
        layout=layout, linear=linear, mode=mode, tp=tp, pp=pp, dp=dp, ratio=ratio, schedule=schedule,
        pipelined=pipelined, vpp=vpp, B=B, Pb=Pb, m=m, accumulating=accumulating, level=level, sharded=sharded,
        deferred=deferred, gpipe=gpipe, grads_key=grads_key, interleaved=interleaved, gloo=gloo,
        state_bytes=state_bytes, tokens=tokens, fused_loss=fused_loss, vocab_shards=vocab_shards, rep_1=rep_1,
        par_1=par_1, scores_1=scores_1, fused_1=fused_1, sel_1=sel_1, sel_par_1=sel_par_1, hidden_1=hidden_1,
        score_grads_1=score_grads_1, mlp_par_share=mlp_par_share, mlp_rep_share=mlp_rep_share, temp_1=temp_1,
        block=block, largest=largest, copy_bytes=copy_bytes, head_matrix=head_matrix, mlp_matrix=mlp_matrix,
        embedding=embedding, tied_wait=tied_wait)


class _Stage(NamedTuple):
    """What the events of one pipeline stage are made of (:func:`_stage_of` says what each is)."""

    stage: int
    first: bool
    last: bool
    per_stage: Any
    emb_1: Any
    ckpt: Any
    first_ckpt: Any
    last_ckpt: Any
    n_ckpt: Any
    before_top_ckpt: Any
    first_chunk_ckpt: Any
    first_chunk: Any
    full: Any
    ends: Any
    params: Any
    shard: Any
    grads: Any
    grad_shards: Any
    head: Any
    fresh: Any
    held: Any
    logits_fresh: Any
    logits_held: Any
    per_mb: dict[str, Any]
    base: dict[str, Any]
    cache: dict[str, Any]
    whole: Any
    one: Any
    root: Any
    top: Any
    top_checkpointed: bool
    recompute: Any
    recopies: Any
    loss_1: Any
    out_1: Any
    logits_1: Any
    grad_1: Any
    steady_sends: Any
    done: Any
    receives: Any  # interleaved: (the most, at the rank's last backward, at the last loss) alive


def _stage_of(knobs: _Knobs, stage: int) -> _Stage:
    """The sizes of pipeline stage ``stage`` its events are made of."""
    layout, linear, mode, tp, pp, dp, ratio = knobs.layout, knobs.linear, knobs.mode, knobs.tp, knobs.pp, knobs.dp, \
        knobs.ratio
    schedule, pipelined, vpp, B, Pb, m = knobs.schedule, knobs.pipelined, knobs.vpp, knobs.B, knobs.Pb, knobs.m
    accumulating, sharded, gpipe, interleaved = knobs.accumulating, knobs.sharded, knobs.gpipe, knobs.interleaved
    state_bytes, tokens, fused_loss, vocab_shards = knobs.state_bytes, knobs.tokens, knobs.fused_loss, knobs.vocab_shards
    rep_1, par_1, scores_1, fused_1 = knobs.rep_1, knobs.par_1, knobs.scores_1, knobs.fused_1
    sel_1, sel_par_1, hidden_1 = knobs.sel_1, knobs.sel_par_1, knobs.hidden_1
    block, copy_bytes, head_matrix, embedding = knobs.block, knobs.copy_bytes, knobs.head_matrix, knobs.embedding
    G = GRAD_BYTES
    first, last = _same(stage == 0), _same(stage == pp - 1)
    # the blocks this rank holds (an uneven split gives the first and last stages the fewer)
    per_stage = _each(rank_block_count, layout.layers, pp, stage, vpp)
    # the first stage's backward ends in its embedding's, which makes a dense gradient of the
    # whole table (a tied one sums it with the head's, held since the head's backward: three
    # at once), beside every other gradient made
    emb_1 = embedding * Pb * (3 if layout.tied_head and last else 1) if first else 0.0
    ckpt = _each(checkpointed_in_flight, ratio, layout.layers, pp, stage, vpp, m)
    # the checkpointed blocks' local positions: the first and the last (-1: none), how many, and
    # whether the block before the stage's last is one (one array each, for array columns)
    first_ckpt, last_ckpt, n_ckpt, before_top_ckpt, first_chunk_ckpt = _each(
        _stage_ckpt_summary, ratio, layout.layers, pp, stage, vpp)
    # the blocks a micro-batch in flight holds, as ckpt counts its checkpointed ones: interleaved
    # with the ends short, not the rank's blocks (blocks_in_flight); the rank's first chunk's blocks
    in_flight = _each(blocks_in_flight, layout.layers, pp, stage, vpp, m)
    first_chunk = _each(_first_chunk_blocks, layout.layers, pp, stage, vpp)
    full = in_flight - ckpt
    ends = 0.0
    if first:
        ends += layout.pre_sharded / tp + layout.pre_replicated
    if last:
        ends += layout.post_sharded / tp + layout.post_replicated
        if layout.tied_head and not first:
            ends += layout.pre_sharded / tp  # the last stage's copy of the tied embedding
    params = per_stage * block + ends
    shard = params / dp if sharded else params
    grads = params * G  # the stage's whole fp32 gradients
    grad_shards = shard * G
    # the parameters whose gradients a last stage's backward makes first (the head, the final
    # norm, a tied embedding); an untied embedding's come after the blocks'
    head = layout.post_sharded / tp + layout.post_replicated + (layout.pre_sharded / tp if layout.tied_head else 0.0) \
        if last else 0.0
    fresh, held = _each(_flights, pp, schedule, stage, m, vpp)
    # interleaved: the receive buffers alive at the most, at the rank's last backward, at the last loss
    receives = _each(_receives, pp, vpp, m, stage, schedule) if interleaved else (0, 0, 0)
    logits_fresh, logits_held = (fresh, held) if gpipe and pipelined else (1, 1)
    per_mb = _nonzero({
        "act_replicated": rep_1 * full, "act_parallel": par_1 * full, "act_scores": scores_1 * full,
        "act_fused": fused_1 * full, "act_checkpointed": hidden_1 * ckpt, "act_selective": sel_1 * ckpt,
        "compute_copies": copy_bytes * (full * layout.block_sharded / tp + (head_matrix if last else 0.0))
        if sharded else 0.0,
    })
    base = _nonzero({
        "weights": params * state_bytes["weights"], "master": params * state_bytes["master"],
        "optimizer": params * state_bytes["optimizer"],
        # receive buffers (runtime._lazy_receive_stage) are made when a receive is posted and
        # go once consumed: a received activation is its micro-batch's stage input, kept by
        # autograd while that micro-batch is in flight (stages after the first); a received
        # gradient lives through one backward (stages before the last). O(pp) under 1F1B,
        # whatever the micro-batch count; GPipe holds every micro-batch's. Interleaved, the
        # counts differ from moment to moment: each moment's own (_stage_terms)
        "pp_recv": hidden_1 * (fresh * (1 - first) + 1 - last) if pipelined and not interleaved else 0.0,
        "constant": 2**20,
        # fp8: the FP8 weight casts and scales (autocast's copies are amp-bf16's compute_copies)
        "compute_copies": fp8_transient_bytes(layout, tp, per_stage) if mode.fp8 else 0.0,
    })
    cache = {} if sharded or not copy_bytes else {
        "compute_copies": copy_bytes * (per_stage * layout.block_sharded / tp + (head_matrix if last else 0.0))}
    whole = params * Pb  # the stage's parameters gathered
    one = block * Pb  # one block gathered
    root = ends * Pb  # the stage root (embeddings, final norm, head): FSDP keeps it gathered all step
    top = per_stage - 1
    top_checkpointed = _same(last_ckpt == top)
    # a checkpointed block's backward rebuilds its activations (selective: beside the matmul
    # outputs it kept, which include the column-parallel ones a plain block saves)
    if linear:
        recompute = _pick(ckpt != 0, 1.0, 0.0)  # the coefficient of LinearFeatures' recompute
    else:
        recompute = _pick(ckpt != 0, _at_least_zero(rep_1 + par_1 + scores_1 + fused_1 - sel_par_1), 0.0)
    # under FSDP (autocast's cache off) the rebuilt block casts its weights again and keeps the copies
    recopies = _pick((ckpt != 0) & sharded, copy_bytes * layout.block_sharded / tp, 0.0)
    # a micro-batch's logits on the last stage: Hugging Face's loss upcasts them and keeps the
    # log-softmax for backward (fp32 at every precision; the logits themselves are freed), and a
    # pipeline stage keeps its output (the logits, in the compute dtype) until its backward ends.
    # The loss's backward makes two fp32 gradients of that size beside the log-softmax
    # Under loss_parallel the vocabulary-parallel loss keeps one fp32 softmax of the head's logits
    # (a vocab / tp slice when tp > 1: they stay sharded), its backward turning it into the
    # gradient in place: beside it, the head's output while the loss runs, then the gradient's
    # cast to the compute dtype (one compute-dtype slice either way: "logits_grad")
    loss_1 = tokens * layout.vocab / vocab_shards * LOSS_BYTES if last else 0.0
    out_1 = tokens * layout.vocab / vocab_shards * B if last and pipelined else 0.0
    logits_1 = loss_1 + out_1
    # The head's backward then runs beside the logits' gradient (in the compute dtype): its input's
    # gradient (the whole sequence) and, when tp > 1, the all-reduced copy of it, and its weight's
    # gradient (from the second micro-batch on, beside the one accumulated). Without loss_parallel
    # the log-softmax is freed by then, and the moment outweighs the loss's two fp32 gradients where
    # the head's matrix is large beside a micro-batch's logits (a wide model, few tokens).
    head_backward = _pick(tp > 1, 2, 1) * tokens * layout.hidden * B + head_matrix * Pb
    head_1 = tokens * layout.vocab / vocab_shards * B + head_backward if last else 0.0
    # A pipeline's last stage holds a tied head (GPT-2's) as its own copy of the embedding; exact mode
    # shows that copy's gradient made once the logits' gradient is freed: the loss's moment holds.
    head_after_loss = 2 * loss_1 if layout.tied_head and pipelined else _max(2 * loss_1, head_1 - loss_1)
    grad_1 = _pick(fused_loss, head_1, head_after_loss)
    # an interleaved runtime lets a send go once its receive is proven posted
    # (runtime: slapo_tune.parallel._send_release): a chunk output sent forward always is by its own
    # backward (it lives in the stage until then anyway, counted with the micro-batch), an input
    # gradient sent backward once a later receive shows the peer past its receive. What stays is a
    # bound read off torch's action lists, the same whatever the timing: at most
    # pending_gradient_sends gradients (on a device, sends that complete sooner go sooner)
    steady_sends = 0.0
    if interleaved and accumulating:
        steady_sends = hidden_1 * _each(_sends_pending, pp, vpp, m, stage, schedule)
    # what a backward's end frees: a micro-batch's activations, or interleaved, its chunk's (the
    # rank's first: 1 / vpp of them when the chunks are equal)
    done = _each(first_chunk_share, layout.layers, pp, stage, vpp, m)
    return _Stage(
        stage=stage, first=first, last=last, per_stage=per_stage, emb_1=emb_1, ckpt=ckpt, first_ckpt=first_ckpt,
        last_ckpt=last_ckpt, n_ckpt=n_ckpt, before_top_ckpt=before_top_ckpt, first_chunk_ckpt=first_chunk_ckpt,
        first_chunk=first_chunk, full=full, ends=ends, params=params, shard=shard, grads=grads, grad_shards=grad_shards, head=head,
        fresh=fresh, held=held, logits_fresh=logits_fresh, logits_held=logits_held, per_mb=per_mb, base=base,
        cache=cache, whole=whole, one=one, root=root, top=top, top_checkpointed=top_checkpointed,
        recompute=recompute, recopies=recopies, loss_1=loss_1, out_1=out_1, logits_1=logits_1, grad_1=grad_1,
        steady_sends=steady_sends, done=done, receives=receives)


def _first_chunk_blocks(layers: int, pp: int, stage: int, vpp: int) -> int:
    return chunk_block_counts(layers, pp, stage, vpp)[0]


def _receives(pp: int, vpp: int, m: int, stage: int, schedule: str) -> ReceiveBuffers:
    """The receive buffers alive on interleaved pipeline rank ``stage``
    (:func:`~slapo_tune.parallel._send_release.receive_buffers`)."""
    return schedule_bounds(pp, vpp, m, "zb" if schedule == "zb" else "1f1b")[1][int(stage)]


def _sends_pending(pp: int, vpp: int, m: int, stage: int, schedule: str) -> int:
    """The input gradients interleaved pipeline rank ``stage`` may still hold sent (its bound)."""
    return schedule_bounds(pp, vpp, m, "zb" if schedule == "zb" else "1f1b")[0][int(stage)]


def _stage_terms(knobs: _Knobs, stage: int) -> StageTerms:
    """:func:`stage_builder`'s function of the stage: every event of pipeline stage ``stage``."""
    m, vpp, accumulating, sharded, interleaved = knobs.m, knobs.vpp, knobs.accumulating, knobs.sharded, \
        knobs.interleaved
    st = _stage_of(knobs, stage)
    events = _forward_events(knobs, st)
    fresh, held, logits_fresh, logits_held = st.fresh, st.held, st.logits_fresh, st.logits_held
    # the first backward runs with the most micro-batches in flight but no gradients yet; later
    # ones with gradients (accumulating) beside fewer micro-batches (as many: one stage, a
    # 1F1B stage holding fewer than all: the first backward's moments, dominated term by term,
    # are left out)
    variants = [("", held, logits_held, True)] if accumulating else []
    if not accumulating or _same((fresh != held) | (logits_fresh != logits_held)):
        variants.insert(0, ("_first", fresh, logits_fresh, False))
    # interleaved with no steady state (the warm-up runs every forward): the accumulating
    # moments are the cool-down's second backward, when only the chunk the rank runs backward
    # first (its last) has made gradients, not the whole stage
    cooling = interleaved and _same(m * vpp - _each(interleaved_warmup, knobs.pp, vpp, m, stage) < 2)
    for suffix, flight, logits_flight, accumulated in variants:
        before = set(events)
        sends = {"pp_sends": st.steady_sends} if accumulated and interleaved and accumulating else {}
        _backward_events(knobs, st, events, suffix, flight, logits_flight, accumulated, sends)
        _backward_end_events(knobs, st, events, suffix, flight, logits_flight, accumulated, sends)
        if accumulated and cooling and not sharded:
            for name in set(events) - before:
                if "gradients" in events[name]:
                    events[name]["gradients"] = events[name]["gradients"] / vpp  # not in place: shared
    if interleaved and not sharded:
        _interleaved_end_events(knobs, st, events)
    if interleaved:
        # an interleaved rank's receive buffers, read off torch's action lists: the step's most
        # while its micro-batches run, except at its last moments (their own: set there)
        for terms in events.values():
            terms.setdefault("pp_recv", knobs.hidden_1 * st.receives[0])
    # none once the step's last backward is done
    events["gradient_sync"] = _gradient_sync(knobs, st)
    # AdamW's temporaries (fp32: it steps fp32 parameters or masters), once activations are gone
    step_grads = {"gradients": st.grad_shards} if sharded else {knobs.grads_key: st.grads}
    events["optimizer"] = {"optimizer_temp": knobs.largest / (knobs.dp if sharded else 1) * 4, **step_grads}
    return StageTerms(stage, _int(st.shard), st.base, events)


def _gathered(knobs: _Knobs, st: _Stage, position: int, accumulated: bool) -> dict[str, float]:
    """What FSDP holds gathered while the backward runs block ``position`` (``per_stage``:
    before the stage's backward starts)."""
    sharded, level, deferred, gpipe, block = knobs.sharded, knobs.level, knobs.deferred, knobs.gpipe, knobs.block
    per_stage, whole, one, root = st.per_stage, st.whole, st.one, st.root
    G = GRAD_BYTES
    if not sharded:
        return {}
    if level == 2 and deferred:
        return {"gathered": whole}
    if level == 2:  # blocks stay gathered from forward until their own backward ends
        return {"gathered": _min(position + 1, per_stage) * one + root,
                "rs_buffer": _pick(position < per_stage - 1, G * block, 0.0)}
    # level 3: the running block and the next one's all-gather buffer (prefetched); deferred,
    # what this backward gathered stays (in GPipe's later backwards, the whole stage)
    running = {"ag_buffer": _pick((position > 0) & (position < per_stage), one, 0.0)}
    if deferred:
        blocks = per_stage if accumulated and gpipe else per_stage - position
        return {"gathered": blocks * one + root, **running}
    # the input buffer of the block reduced before this one is kept until the next reduce
    return {"gathered": _pick(position < per_stage, one, 0.0) + root, **running,
            "rs_buffer": _pick(position < per_stage - 1, G * block, 0.0)}


def _gradients(knobs: _Knobs, st: _Stage, position: int, accumulated: bool) -> dict[str, float]:
    """The gradients alive while the backward runs block ``position``."""
    layout, tp, dp, Pb, sharded, deferred = knobs.layout, knobs.tp, knobs.dp, knobs.Pb, knobs.sharded, knobs.deferred
    grads_key, block, copy_bytes, head_matrix = knobs.grads_key, knobs.block, knobs.copy_bytes, knobs.head_matrix
    mlp_matrix, tied_wait = knobs.mlp_matrix, knobs.tied_wait
    per_stage, last, head, grads, grad_shards = st.per_stage, st.last, st.head, st.grads, st.grad_shards
    G = GRAD_BYTES
    made = (per_stage - 1 - position) * block + head  # parameters whose gradients this backward made
    if not sharded:
        if not accumulated:
            return {grads_key: made * G, "grads_transient": mlp_matrix * G}
        # beside the accumulated gradients, the one just made (before it is added in), and
        # what waits for the end of the backward: amp-bf16's gradients of the step's cached
        # bf16 weight copies (their casts are the first micro-batch's autograd nodes, which run
        # after everything this one made), else a tied embedding's gradient from the head,
        # held until the embedding adds its own
        if copy_bytes:
            waiting = ((per_stage - 1 - position) * layout.block_sharded / tp + (head_matrix if last else 0.0))
            return {"gradients": grads, "grads_unsharded": waiting * copy_bytes,
                    "grads_transient": mlp_matrix * copy_bytes}
        return {"gradients": grads, "grads_transient": (tied_wait + mlp_matrix) * Pb}
    if deferred:
        # whole gradients until the step's reduce-scatter, fp32 once accumulated: FSDP upcasts a
        # unit's bf16 gradients to its reduce dtype (adds them to the fp32 ones) in the unit's
        # post-backward, as the block's backward ends, so the running block's bf16 gradients are
        # alive beside the fp32 ones, and the root's (the head's first) until the backward ends;
        # and, as without FSDP, the gradient just made and a tied embedding's from the head
        # (autocast's copies are made again each micro-batch: their gradients are added in at once)
        if Pb == G:  # nothing to upcast
            return {grads_key: made * G} if not accumulated else \
                {"gradients": grads, "grads_transient": tied_wait * Pb + mlp_matrix * (Pb + copy_bytes)}
        current = {"grads_unsharded": (block + head) * Pb}
        if not accumulated:
            return {grads_key: (made - head) * G, **current}
        return {"gradients": grads, **current, "grads_transient": mlp_matrix * (Pb + copy_bytes)}
    # levels 2 and 3, one stage: blocks reduce-scattered as their backward ends; the running
    # block's gradients and the root's (until the root's reduce at the end) unsharded
    current = {"grads_unsharded": (block + head) * Pb}
    if accumulated:
        return {"gradients": grad_shards, **current}
    return {grads_key: (made - head) * G / dp, **current}


def _reduce_scatter(knobs: _Knobs, unit: float, source: float) -> dict[str, float]:
    """A unit's reduce-scatter at its largest: FSDP's fp32 input buffer, copied in from the
    ``source`` bytes of gradients (counted by the caller, except under gloo: freed by then),
    and its output; gloo reduces on a full-size copy of the input, NCCL in place (the larger
    moment is then the copy-in, unless the output outweighs the source)."""
    dp, G = knobs.dp, GRAD_BYTES
    if knobs.gloo:
        return {"rs_buffer": unit * G * (1 + 1 / dp), "rs_copy": unit * G}
    return {"rs_buffer": unit * G + _at_least_zero(unit * G / dp - source)}


def _after_top(knobs: _Knobs, st: _Stage, flight: int) -> dict[str, float]:
    """Activations once the stage's last block has finished its backward."""
    hidden_1, sel_1 = knobs.hidden_1, knobs.sel_1
    per_mb, ckpt, full = st.per_mb, st.ckpt, st.full
    if st.top_checkpointed:
        acts = {k: v * flight for k, v in per_mb.items()}
        acts["act_checkpointed"] = hidden_1 * (ckpt * flight - 1)
        acts["act_selective"] = sel_1 * (ckpt * flight - 1)
        return acts
    acts = {k: v * (flight - 1) + v * _at_least_zero(full - 1) / full for k, v in per_mb.items()
            if k not in CHECKPOINTED}
    acts["act_checkpointed"] = hidden_1 * ckpt * flight
    acts["act_selective"] = sel_1 * ckpt * flight
    return acts


def _forward_events(knobs: _Knobs, st: _Stage) -> dict[str, dict[str, Any]]:
    """The forward's events: the most micro-batches in flight; FSDP's gathering."""
    level, sharded, deferred, accumulating = knobs.level, knobs.sharded, knobs.deferred, knobs.accumulating
    cache, per_mb, whole, one, root, logits_1 = st.cache, st.per_mb, st.whole, st.one, st.root, st.logits_1
    forward = {} if not sharded else {"gathered": whole} if level < 3 else {"gathered": one + root}
    events = {
        # the most micro-batches in flight, before this step's first backward: no gradients yet
        "forward": {**cache, **{k: v * st.fresh for k, v in per_mb.items()}, "logits": logits_1 * st.logits_fresh,
                    **forward},
    }
    if sharded:
        # the flat all-gather buffer of the unit just gathered and of the one before it, kept
        # until the next copy-out. Levels 1 and 2, deferred, gather the stage in the step's first
        # forward only
        forward["ag_buffer"] = 2 * one
        if level == 2 and deferred:
            events["forward_gather"] = {**cache, **per_mb, "logits": logits_1, **forward}
        else:
            events["forward"].update(forward)
    if accumulating and level >= 2 and not deferred:
        # levels 2 and 3 gather again for every micro-batch, beside the accumulated gradient shards
        events["forward_later"] = {"gradients": st.grad_shards, **{k: v * st.held for k, v in per_mb.items()},
                                   "logits": logits_1 * st.logits_held, **forward}
    return events


def _backward_events(knobs: _Knobs, st: _Stage, events: dict[str, dict[str, Any]], suffix: str, flight: Any,
                     logits_flight: Any, accumulated: bool, sends: dict[str, Any]) -> None:
    """Into ``events``, a backward variant's (``suffix``) moments from the loss to the rebuilding of
    checkpointed blocks, ``flight`` micro-batches in flight (the logits: ``logits_flight``)."""
    rep_1, par_1, fused_1, sel_1, hidden_1 = knobs.rep_1, knobs.par_1, knobs.fused_1, knobs.sel_1, knobs.hidden_1
    score_grads_1, temp_1 = knobs.score_grads_1, knobs.temp_1
    mlp_par_share, mlp_rep_share = knobs.mlp_par_share, knobs.mlp_rep_share
    cache, per_mb, per_stage, top, full, ckpt = st.cache, st.per_mb, st.per_stage, st.top, st.full, st.ckpt
    first_ckpt, last_ckpt, n_ckpt = st.first_ckpt, st.last_ckpt, st.n_ckpt
    loss_1, out_1, logits_1 = st.loss_1, st.out_1, st.logits_1
    recompute, recopies = st.recompute, st.recopies
    gathered = functools.partial(_gathered, knobs, st)
    gradients = functools.partial(_gradients, knobs, st)
    acts = {k: v * flight for k, v in per_mb.items()}
    # once the loss's backward is done, the micro-batch's log-softmax is freed
    logits = out_1 * logits_flight + loss_1 * (logits_flight - 1)
    alive = gradients(per_stage, True) if accumulated else {}
    alive.pop("grads_unsharded", None)
    alive.pop("grads_transient", None)
    # the loss of a micro-batch: its logits' gradients beside the logits
    events["loss" + suffix] = {**cache, **alive, **acts, "logits": logits_1 * logits_flight,
                               "logits_grad": st.grad_1, **gathered(per_stage, accumulated), **sends}
    # the stage's backward starts: every activation alive, the block's gradient temporaries
    events["backward_start" + suffix] = {
        **cache, **acts, "logits": logits, "backward_temp": temp_1,
        **gathered(top, accumulated), **gradients(top, accumulated), **sends}
    if not st.top_checkpointed and _any(score_grads_1):
        # the last block's attention backward: its MLP's activations freed, the gradients of
        # its materialised scores alive
        events["backward_attention" + suffix] = {
            **cache, **acts, "act_replicated": rep_1 * (full * flight - mlp_rep_share),
            "act_parallel": par_1 * (full * flight - mlp_par_share), "act_fused": fused_1 * (full * flight - 1),
            "logits": logits, "score_grads": score_grads_1,
            **gathered(top, accumulated), **gradients(top, accumulated), **sends}
    # The backward walks the blocks last to first, freeing each one's activations. A
    # checkpointed block is rebuilt beside the full blocks before it and the gradients of
    # the blocks after it: the last such block has the most activations beside it, the
    # first the most gradients.
    # (the checkpointed blocks up to the last one: all of them; up to the first: one)
    for name, position, inputs_before in (("backward", last_ckpt, n_ckpt), ("backward_early", first_ckpt, 1)):
        if _same(position < 0) or (name == "backward_early" and _same(position == last_ckpt)):
            continue
        full_before = position + 1 - inputs_before
        partial = _same(full != 0)
        current = {k: v * (flight - 1) + v * full_before / full if partial else v * (flight - 1)
                   for k, v in per_mb.items() if k not in CHECKPOINTED}
        current["act_checkpointed"] = hidden_1 * (ckpt * (flight - 1) + inputs_before)
        current["act_selective"] = sel_1 * (ckpt * (flight - 1) + inputs_before)
        if _any(recopies):
            current["compute_copies"] = current.get("compute_copies", 0.0) + recopies
        # the stage holds a micro-batch's output (the logits) until its backward is done
        events[name + suffix] = {**cache, **current, "logits": logits, "recompute": recompute,
                                 "backward_temp": temp_1, **gathered(position, accumulated),
                                 **gradients(position, accumulated), **sends}


def _backward_end_events(knobs: _Knobs, st: _Stage, events: dict[str, dict[str, Any]], suffix: str, flight: Any,
                         logits_flight: Any, accumulated: bool, sends: dict[str, Any]) -> None:
    """Into ``events``, a backward variant's (``suffix``) moments at its end: the embedding's
    gradient; FSDP's gradients made whole, or its first reduce-scatters."""
    layout, tp, Pb, level, sharded, deferred = knobs.layout, knobs.tp, knobs.Pb, knobs.level, knobs.sharded, \
        knobs.deferred
    grads_key, gloo, temp_1, block = knobs.grads_key, knobs.gloo, knobs.temp_1, knobs.block
    copy_bytes, head_matrix, embedding = knobs.copy_bytes, knobs.head_matrix, knobs.embedding
    first, last, per_stage, emb_1, params, grads = st.first, st.last, st.per_stage, st.emb_1, st.params, st.grads
    ends = st.ends
    cache, per_mb, logits_1, done, head = st.cache, st.per_mb, st.logits_1, st.done, st.head
    whole, one, root, top, recompute, recopies = st.whole, st.one, st.root, st.top, st.recompute, st.recopies
    gathered = functools.partial(_gathered, knobs, st)
    gradients = functools.partial(_gradients, knobs, st)
    G = GRAD_BYTES
    if not sharded and first:
        if accumulated:
            waiting = (per_stage * layout.block_sharded / tp + (head_matrix if last else 0.0)) * copy_bytes
            ended = {"gradients": grads, "grads_unsharded": waiting, "grads_transient": emb_1}
        else:
            ended = {grads_key: params * G, "grads_transient": emb_1 - embedding * Pb}
        events["backward_end" + suffix] = {
            **cache, **{k: v * (flight - done) for k, v in per_mb.items()},
            "logits": logits_1 * (logits_flight - 1), **ended, **sends}
    if deferred:
        # the backward ends with every gradient of the stage made, the stage gathered, the
        # other micro-batches in flight: the blocks' fp32 (upcast as each block's backward
        # ended), the root's bf16 until its own post-backward upcasts them
        made = {"gradients": grads, "grads_unsharded": ends * Pb if Pb != G else 0.0} \
            if accumulated else {grads_key: (params - ends) * G + ends * Pb}
        # the embedding's own gradient is among those made (the first stage's only: a later
        # stage has no transient of it)
        made["grads_transient"] = emb_1 if accumulated else _at_least_zero(emb_1 - embedding * Pb)
        events["backward_end" + suffix] = {
            **cache, **{k: v * (flight - done) for k, v in per_mb.items()},
            "logits": logits_1 * (logits_flight - 1), "gathered": whole, **made, **sends}
    if level >= 2 and not deferred:
        # levels 2 and 3: the first reduce-scatter of the backward (the last block's, just
        # resharded), then the next block's backward beside its kept input buffer
        after = _after_top(knobs, st, flight)
        reduced = {"gathered": top * one + root} if level == 2 else \
            {"gathered": root, "ag_buffer": _pick(top != 0, one, 0.0)}
        # the root's gradients stay unsharded until its own reduce-scatter ends the backward
        events["backward_reduce" + suffix] = {
            **after, **reduced, **(gradients(per_stage, True) if accumulated else {}),
            **_reduce_scatter(knobs, block, block * Pb),
            "grads_unsharded": head * Pb + (0.0 if gloo else block * Pb)}
        if _same(top != 0):
            rebuilt = st.before_top_ckpt
            events["backward_block" + suffix] = {
                **after, "backward_temp": temp_1, "recompute": _pick(rebuilt, recompute, 0.0),
                **gathered(top - 1, accumulated), **gradients(top - 1, accumulated)}
            if _any(rebuilt & (recopies != 0)):
                copies = events["backward_block" + suffix].get("compute_copies", 0.0)
                events["backward_block" + suffix]["compute_copies"] = copies + _pick(rebuilt, recopies, 0.0)


def _interleaved_end_events(knobs: _Knobs, st: _Stage, events: dict[str, dict[str, Any]]) -> None:
    """Into ``events``, an interleaved rank's last moments (replicated data parallelism): its last
    backward beside every send of the step, and on the last stage the step's last loss."""
    pp, vpp, m, temp_1, mlp_matrix, grad_1 = knobs.pp, knobs.vpp, knobs.m, knobs.temp_1, knobs.mlp_matrix, st.grad_1
    rep_1, par_1, scores_1, fused_1, sel_1, hidden_1 = knobs.rep_1, knobs.par_1, knobs.scores_1, knobs.fused_1, \
        knobs.sel_1, knobs.hidden_1
    stage, first, last, cache, grads, emb_1 = st.stage, st.first, st.last, st.cache, st.grads, st.emb_1
    first_chunk_ckpt, per_mb, logits_1 = st.first_chunk_ckpt, st.per_mb, st.logits_1
    G = GRAD_BYTES
    # interleaved runtime schedules let each send go once its receive is proven posted
    # (slapo_tune.parallel._send_release): at the rank's last backward, beside the stage's gradients and
    # that backward's temporaries (the first stage's: its embedding's gradient, emb_1), every chunk
    # output sent forward has gone with its backward; the input gradients sent backward that the
    # rank cannot yet know received stay (at most the schedule's bound); on the last stage also at
    # the step's last loss, the chunks still to run backward in flight (the warm-up's count)
    sent = st.steady_sends if _same(st.steady_sends != 0) else \
        hidden_1 * _each(_sends_pending, pp, vpp, m, stage, knobs.schedule)
    # the receive buffers then: the last backward's own (its stage input and received gradient)
    # and any of other micro-batches still alive, not the step's most (the base)
    recv_end, recv_loss = hidden_1 * st.receives[1], hidden_1 * st.receives[2]
    end = {**cache, "gradients": grads, "pp_sends": sent, "pp_recv": recv_end}
    end.update({"grads_transient": emb_1} if first else
               {"backward_temp": temp_1, "grads_transient": mlp_matrix * G})
    events["backward_last"] = end
    if _same(first_chunk_ckpt != 0):
        # the rank's last backward (its first chunk's, of the step's last micro-batch) rebuilds
        # that chunk's last checkpointed block beside every send but its own (made by it)
        chunk_full = st.first_chunk - first_chunk_ckpt
        events["backward_last_rebuild"] = {
            **cache, **_gradients(knobs, st, st.top, True), "pp_sends": sent, "pp_recv": recv_end,
            "act_replicated": rep_1 * chunk_full, "act_parallel": par_1 * chunk_full,
            "act_scores": scores_1 * chunk_full, "act_fused": fused_1 * chunk_full,
            "act_checkpointed": hidden_1 * first_chunk_ckpt, "act_selective": sel_1 * first_chunk_ckpt,
            "recompute": st.recompute, "backward_temp": temp_1}
    if last:
        waiting = _min(_each(interleaved_warmup, pp, vpp, m, stage), m * vpp - 1)
        events["loss_last"] = {**cache, "gradients": grads, "pp_sends": sent, "pp_recv": recv_loss,
                               **{k: v * waiting / vpp for k, v in per_mb.items()},
                               "logits": logits_1, "logits_grad": grad_1}


def _gradient_sync(knobs: _Knobs, st: _Stage) -> dict[str, Any]:
    """The gradients' synchronisation after the step's last backward, per ZeRO level."""
    dp, Pb, level, sharded, deferred, gpipe = knobs.dp, knobs.Pb, knobs.level, knobs.sharded, knobs.deferred, \
        knobs.gpipe
    grads_key, gloo, block, largest = knobs.grads_key, knobs.gloo, knobs.block, knobs.largest
    grads, grad_shards, fresh = st.grads, st.grad_shards, st.fresh
    ends, whole, one, root = st.ends, st.whole, st.one, st.root
    G = GRAD_BYTES
    if not sharded:
        # replicated data parallelism averages the fp32 gradients through flat buckets (a bucket
        # holds 32 MiB of gradients, or one larger gradient)
        return {grads_key: grads,
                "dp_buckets": _pick(dp > 1, _min(grads, _max(DP_BUCKET_BYTES, largest * G)), 0.0)}
    if deferred:
        # the step's last backward reduce-scatters block by block the gradients accumulated whole
        # (the first block's move into the reduce-scatter's input), the rest of the stage still
        # gathered: every block at level 2 and after GPipe's backwards; 1F1B's last stage has
        # just resharded everything in its last forward and gathers again
        regathered = level == 3 and not gpipe and _same(fresh == 1)
        return {"gradients": grads - (block * G if gloo else 0.0), **_after_top(knobs, st, 1),
                **({"gathered": root, "ag_buffer": one} if regathered else {"gathered": whole - one}),
                **_reduce_scatter(knobs, block, block * G)}
    # the root's reduce-scatter ends the backward, beside every block's gradient shards
    return {grads_key: grad_shards,
            **_reduce_scatter(knobs, ends, ends * Pb), "grads_unsharded": 0.0 if gloo else ends * Pb}


def predict_memory(layout: ModelLayout, point: Mapping[str, Any], workload: Workload,
                   weights: Mapping[str, float] | None = None,
                   uncertainty: float = DEFAULT_UNCERTAINTY, backend: str = "nccl") -> MemoryPrediction:
    w = {**DEFAULT_WEIGHTS, **(weights or {})}

    def peaks_of(stages: Iterable[int]) -> tuple[list[StageTerms], list[tuple[float, str]]]:
        terms = memory_terms(layout, point, workload, backend, stages)
        return terms, [st.peak(w) for st in terms]

    stages, peaks = peaks_of(dominant_stages(layout, point))
    worst = max(range(len(peaks)), key=lambda i: peaks[i][0])
    st, event = stages[worst], peaks[worst][1]
    breakdown = {k: int(w[k] * v) for k, v in {**st.base, **st.moments[event]}.items() if v}
    return MemoryPrediction({s.stage: int(total) for s, (total, _) in zip(stages, peaks)}, breakdown, uncertainty,
                            st.params, st.stage, point["pp"],
                            lambda missing: {s.stage: int(total) for s, (total, _) in zip(*peaks_of(missing))})
