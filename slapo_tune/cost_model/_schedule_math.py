"""Pipeline schedule arithmetic: the micro-batches a stage holds in flight (GPipe, 1F1B, torch's
interleaved 1F1B), the blocks a rank runs and which of them are checkpointed, the stages one of
which holds a step's peak, and the published closed forms of the bubble and of the micro-batches
in flight. Integers and floats of the knobs only: the memory and the time model read them."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._partition import (
    CKPT_SPREAD,
    checkpointed_indices,
    chunk_block_counts,
    rank_block_count,
    rank_stages,
    stage_block_range,
)
from ..plan import knob_value

if TYPE_CHECKING:  # annotations only: the layout's module imports nothing of this one
    from ._layout import ModelLayout


def flights(point: Mapping[str, Any], stage: int, micro_batches: int) -> tuple[float, float]:
    """Micro-batches whose activations a stage holds: at most, before its first backward; and
    at most once gradients exist (after the first backward, when accumulating).

    GPipe runs every forward first; 1F1B's warm-up holds ``pp - stage``, and every later forward
    refills that many, as long as forwards remain. Interleaved (``vpp`` > 1), in micro-batches of
    the rank's whole set of stages: :func:`interleaved_warmup` chunk forwards and the first 1F1B
    step's, over ``vpp`` (rank 0: ``pp + (pp - 1) / vpp`` where 1F1B holds ``pp``).
    """
    return _flights(point["pp"], point["pipeline_schedule"], stage, micro_batches, knob_value(point, "vpp"))


def _flights(pp: int, schedule: str, stage: int, m: int, vpp: int = 1) -> tuple[float, float]:
    if pp == 1:
        return 1, 1
    if schedule == "gpipe":
        return m, max(1, m - 1)
    if vpp > 1:
        warmup, total = interleaved_warmup(pp, vpp, m, stage), m * vpp
        fresh = min(warmup + 1, total)
        # every later 1F1B step runs its forward before its backward: as many again, while forwards remain
        held = fresh if total - warmup >= 2 else max(1, total - 1)
        return fresh / vpp, held / vpp
    warmup = min(pp - stage, m)
    return warmup, warmup if m > warmup else max(1, warmup - 1)


def interleaved_warmup(pp: int, vpp: int, m: int, rank: int) -> int:
    """Chunk forwards pipeline ``rank`` runs before its first backward under torch's
    ``ScheduleInterleaved1F1B`` (``schedules._get_warmup_ops``): ``m`` micro-batches in
    ``max(1, m // pp)`` rounds of ``r = m // rounds``; the last rank runs ``(vpp - 1) r``, each rank
    before it 2 more; at most all ``m vpp``. Rank ``r``'s forward ``k`` runs its local chunk
    ``(k // r) % vpp``; each 1F1B step then runs a forward before its backward, so ``warmup + 1``
    chunks are in flight at most: ``vpp pp + pp - 1`` on rank 0 (``m`` a multiple of ``pp``),
    ``pp + (pp - 1) / vpp`` micro-batches of the rank's ``vpp`` chunks, Narayanan et al. (2021)'s
    ``pp (1 + (pp - 1) / (pp vpp))``."""
    per_round = m // max(1, m // pp)
    return min((vpp - 1) * per_round + 2 * (pp - 1 - rank), m * vpp)


@functools.lru_cache(maxsize=4096)
def interleaved_chunks_in_flight(pp: int, vpp: int, m: int, rank: int) -> tuple[int, ...]:
    """Per local chunk of ``rank``, the micro-batches whose activations it holds at the most (at the
    first 1F1B step's forward; see :func:`interleaved_warmup`)."""
    per_round = m // max(1, m // pp)
    counts = [0] * vpp
    for step in range(min(interleaved_warmup(pp, vpp, m, rank) + 1, m * vpp)):
        counts[(step // per_round) % vpp] += 1
    return tuple(counts)


def rank_blocks(total_layers: int, pp: int, rank: int, vpp: int = 1) -> list[int]:
    """The blocks pipeline ``rank`` runs, in its local order: the model is cut into ``pp * vpp``
    stages (:func:`~slapo_tune._partition.stage_block_counts`: equal, or the first and last the
    fewer) and rank ``r`` holds stages ``r, r + pp, ...``."""
    return [i for stage in rank_stages(rank, pp, pp * vpp) for i in range(*stage_block_range(total_layers, pp * vpp, stage))]


@functools.lru_cache(maxsize=4096)
def checkpointed_per_chunk(ratio: float, total_layers: int, pp: int, rank: int, vpp: int = 1) -> tuple[int, ...]:
    """How many blocks of each of ``rank``'s ``vpp`` chunks are checkpointed (spread as the templates do)."""
    chosen = set(checkpointed_indices(total_layers, ratio, CKPT_SPREAD))
    return tuple(sum(1 for i in range(*stage_block_range(total_layers, pp * vpp, stage)) if i in chosen)
                 for stage in rank_stages(rank, pp, pp * vpp))


@functools.lru_cache(maxsize=4096)
def blocks_in_flight(total_layers: int, pp: int, rank: int, vpp: int, micro_batches: int) -> float:
    """The blocks of ``rank`` a micro-batch in flight holds: all of them, or interleaved, averaged
    over the chunks in flight at the most (:func:`interleaved_chunks_in_flight`) as
    :func:`checkpointed_in_flight` averages the checkpointed ones. Times :func:`flights`' micro-batches
    (``sum(counts) / vpp``), the blocks those chunks hold: with equal chunks the rank's blocks, with
    the ends short (the first rank's first chunk and the last rank's last one, which the warm-up
    runs most and least) fewer or more. torch's steady state then holds as many, but on the last
    rank one block more (a full chunk's forward follows its short chunk's backward)."""
    sizes = chunk_block_counts(total_layers, pp, rank, vpp)
    if vpp == 1:
        return sizes[0]
    counts = interleaved_chunks_in_flight(pp, vpp, micro_batches, rank)
    return vpp * sum(n * size for n, size in zip(counts, sizes)) / sum(counts)


def first_chunk_share(total_layers: int, pp: int, rank: int, vpp: int, micro_batches: int) -> float:
    """The share of a micro-batch in flight (:func:`blocks_in_flight`) the rank's first chunk holds:
    what the end of a backward of that chunk frees (1 / vpp with equal chunks)."""
    first = chunk_block_counts(total_layers, pp, rank, vpp)[0]
    return first / blocks_in_flight(total_layers, pp, rank, vpp, micro_batches)


@functools.lru_cache(maxsize=4096)
def checkpointed_per_stage(ratio: float, total_layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """How many of each pipeline rank's blocks are checkpointed (uniform spreading)."""
    return tuple(sum(checkpointed_per_chunk(ratio, total_layers, pp, s, vpp)) for s in range(pp))


@functools.lru_cache(maxsize=4096)
def checkpointed_in_flight(ratio: float, total_layers: int, pp: int, rank: int, vpp: int, micro_batches: int) -> float:
    """The checkpointed blocks of ``rank`` a micro-batch in flight holds: all of them, or
    interleaved, averaged over the chunks in flight at the most (:func:`interleaved_chunks_in_flight`)."""
    chunks = checkpointed_per_chunk(ratio, total_layers, pp, rank, vpp)
    ckpt = sum(chunks)
    if vpp > 1 and ckpt:
        counts = interleaved_chunks_in_flight(pp, vpp, micro_batches, rank)
        return vpp * sum(n * c for n, c in zip(counts, chunks)) / sum(counts)
    return ckpt


def checkpointed_count(layers_on_stage: int, ratio: float, total_layers: int, pp: int, vpp: int = 1) -> int:
    """The most checkpointed blocks on any stage (the recomputation the slowest stage does)."""
    return max(checkpointed_per_stage(ratio, total_layers, pp, vpp))


def dominant_stages(layout: ModelLayout, point: Mapping[str, Any]) -> list[int]:
    """The pipeline stages one of which has the peak, whatever the (non-negative) weights: the
    first and the last, and of the stages between, the first of those checkpointing the same
    blocks. Those hold no embeddings, head or logits, so their terms differ only in what they
    checkpoint and in the micro-batches they hold, which never grow with the stage's index."""
    return list(_dominant_stages(layout.layers, point["pp"], point["ckpt_ratio"], knob_value(point, "vpp")))


@functools.lru_cache(maxsize=4096)
def _dominant_stages(layers: int, pp: int, ratio: float, vpp: int) -> tuple[int, ...]:
    chosen, seen = [0], set()
    for stage in range(1, pp - 1):
        # interleaved, too: a later rank's warm-up holds a prefix of an earlier one's chunk forwards
        # and as many blocks (an uneven split: the middle stages hold one more than the ends), chunk by chunk
        positions = (_stage_ckpt_positions(ratio, layers, pp, stage, vpp), chunk_block_counts(layers, pp, stage, vpp))
        if positions not in seen:
            seen.add(positions)
            chosen.append(stage)
    return tuple(chosen + [pp - 1] if pp > 1 else chosen)


def _ckpt_positions(point: Mapping[str, Any], layout: ModelLayout, stage: int) -> frozenset[int]:
    return _stage_ckpt_positions(point["ckpt_ratio"], layout.layers, point["pp"], stage, knob_value(point, "vpp"))


@functools.lru_cache(maxsize=4096)
def _stage_ckpt_summary(ratio: float, total_layers: int, pp: int, stage: int, vpp: int = 1
                        ) -> tuple[int, int, int, bool, int]:
    """What :func:`~._stage.stage_builder` reads of a rank's checkpointed blocks: the first and the last
    local position (-1: none), how many, whether the block before the rank's last is one, and how
    many its first chunk holds."""
    positions = sorted(_stage_ckpt_positions(ratio, total_layers, pp, stage, vpp))
    top = rank_block_count(total_layers, pp, stage, vpp) - 1
    return (positions[0] if positions else -1, positions[-1] if positions else -1, len(positions),
            top - 1 in positions, checkpointed_per_chunk(ratio, total_layers, pp, stage, vpp)[0])


@functools.lru_cache(maxsize=4096)
def _stage_ckpt_positions(ratio: float, total_layers: int, pp: int, stage: int, vpp: int = 1) -> frozenset[int]:
    """The local indices (in :func:`rank_blocks` order) of the checkpointed blocks of a rank."""
    chosen = set(checkpointed_indices(total_layers, ratio, CKPT_SPREAD))
    return frozenset(j for j, i in enumerate(rank_blocks(total_layers, pp, stage, vpp)) if i in chosen)


# the published closed forms (Narayanan et al. 2021), for comparison (benchmarks.techniques)
def pipeline_bubble(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """The pipeline bubble's share of a step's ideal time, Narayanan et al. 2021 (§2.2): ``(p - 1) / m``
    for GPipe and 1F1B, ``(p - 1) / (v m)`` interleaved over ``v`` chunks per rank."""
    return (pp - 1) / (vpp * micro_batches)


def megatron_microbatches_in_flight(pp: int, vpp: int = 1) -> float:
    """Micro-batches whose activations the first stage holds at the most (in micro-batches of the
    rank's whole set of layers): ``p`` under 1F1B, ``p (1 + (p - 1) / (p v))`` under the interleaved
    schedule of Narayanan et al. 2021 (§2.2.2), as Korthikanti et al. 2022 (§4.2.3) count it.
    torch's schedule, which is what runs, holds as many when the micro-batches come in whole
    rounds of ``p`` (:func:`interleaved_warmup`, :func:`flights`)."""
    return pp * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else float(pp)
