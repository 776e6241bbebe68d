"""How a schedule partitions a model and its batch: which blocks are checkpointed, where the
pipeline cuts fall, which micro-batch counts torch's interleaved schedule runs, and the gradient
buckets of replicated data parallelism.

Plain arithmetic without torch, shared by the runtime (:mod:`slapo_tune.parallelize`,
:mod:`slapo_tune.parallel._data_parallel`, which re-export it), the templates' spaces and the cost model,
so that planning never imports torch.
"""

from __future__ import annotations

import functools
import math

from .errors import ScheduleError


def interleaved_microbatches_ok(n_microbatches: int, pp: int) -> bool:
    """Whether torch's interleaved 1F1B runs ``n_microbatches`` over ``pp`` ranks: at least one per
    rank, in whole rounds (``max(1, n // pp)`` rounds of equal size)."""
    return n_microbatches >= pp and n_microbatches % max(1, n_microbatches // pp) == 0


# how the templates spread a checkpoint ratio over the blocks, which the cost model predicts (a
# "spread", as ``ckpt_policy`` names what a checkpointed block recomputes)
CKPT_SPREAD = "uniform"


def checkpointed_indices(num_layers: int, ratio: float, spread: str = CKPT_SPREAD) -> list[int]:
    """Which of ``num_layers`` blocks to checkpoint for a ``ratio`` in [0, 1].

    ``round(ratio * num_layers)`` blocks are chosen. ``"first"`` takes the first k (they hold
    activations longest under pipelining); ``"uniform"`` spreads them evenly, so every pipeline
    stage saves about the same memory.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ScheduleError(f"checkpoint ratio must be in [0, 1], got {ratio}")
    k = int(math.floor(ratio * num_layers + 0.5))
    if spread == "first":
        return list(range(k))
    if spread != "uniform":
        raise ScheduleError(f"checkpoint spread must be 'uniform' or 'first', got {spread!r}")
    if k == 0:
        return []
    return sorted({int(i * num_layers / k) for i in range(k)})


# Replicated data parallelism (ZeRO level 0) averages the gradients through flat buckets of this
# many bytes (or one larger gradient): the runtime's buckets and the cost model's dp_buckets term
GRADIENT_BUCKET_BYTES = 32 * 2**20


def stage_block_counts(num_layers: int, pp: int) -> list[int]:
    """How many of ``num_layers`` blocks each of ``pp`` stages holds, first stage first.

    As even as possible (counts differ by at most one); when ``pp`` does not divide the blocks,
    the ``k = pp - num_layers % pp`` stages with the fewer blocks are the ends of the pipeline, the
    stages that also hold the embedding and the head (as Megatron-LM's first/last-stage layer
    counts): the first ``ceil(k / 2)`` and the last ``floor(k / 2)``. 126 blocks at pp=16: 7, then
    fourteen 8s, then 7; 4 at pp=3: 1, 2, 1; 6 at pp=4: 1, 2, 2, 1.
    """
    if pp < 1 or pp > num_layers:
        raise ScheduleError(f"cannot cut {num_layers} blocks into {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    if extra == 0:
        return [base] * pp
    small = pp - extra
    head, tail = (small + 1) // 2, small // 2
    return [base] * head + [base + 1] * extra + [base] * tail


def stage_boundaries(num_layers: int, pp: int) -> list[int]:
    """Indices of the blocks after which to cut ``pp`` stages of the sizes
    :func:`stage_block_counts` gives (the first and last stages the fewer when uneven)."""
    cuts, end = [], 0
    for count in stage_block_counts(num_layers, pp)[:-1]:
        end += count
        cuts.append(end - 1)
    return cuts


def stage_block_range(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """The blocks ``[start, stop)`` that stage ``stage`` of ``pp`` holds."""
    counts = stage_block_counts(num_layers, pp)
    start = sum(counts[:stage])
    return start, start + counts[stage]


def rank_stages(rank: int, pp: int, stages: int) -> range:
    """The stages pipeline ``rank`` runs when a model is cut into ``stages`` (a multiple of ``pp``):
    ``rank, rank + pp, ...``, torch's interleaved order (one stage each without interleaving). The
    builder, the block counts and the cost model all read this one rule."""
    return range(rank, stages, pp)


@functools.lru_cache(maxsize=4096)
def chunk_block_counts(num_layers: int, pp: int, rank: int, vpp: int = 1) -> tuple[int, ...]:
    """How many blocks each of pipeline ``rank``'s ``vpp`` stages (its chunks, in its local order)
    holds when ``num_layers`` blocks are cut into ``pp * vpp`` stages (:func:`stage_block_counts`)
    and rank ``r`` holds stages ``r, r + pp, ...``: equal, or interleaved with the ends short, the
    first rank's first chunk and the last rank's last one the fewer."""
    counts = stage_block_counts(num_layers, pp * vpp)
    return tuple(counts[stage] for stage in rank_stages(rank, pp, pp * vpp))


@functools.lru_cache(maxsize=4096)
def rank_block_count(num_layers: int, pp: int, rank: int, vpp: int = 1) -> int:
    """How many blocks pipeline ``rank`` holds (the sum of its :func:`chunk_block_counts`)."""
    return sum(chunk_block_counts(num_layers, pp, rank, vpp))


def rank_block_counts(num_layers: int, pp: int, vpp: int = 1) -> list[int]:
    """:func:`rank_block_count` of every pipeline rank, first rank first (``[num_layers]``
    without a pipeline): what ``plan`` prints and the schedule file records."""
    vpp = vpp if pp > 1 else 1
    return [rank_block_count(num_layers, pp, r, vpp) for r in range(pp)]
