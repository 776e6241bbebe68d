"""Slapo's ``slapo.framework_dialect.deepspeed.pipeline``: which ranks hold each tied weight."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def analyze_tie_ranks(tie_weight_groups: Iterable[Sequence[tuple[str, int]]],
                      topology: Any) -> tuple[list[list[list[int]]], list[list[int]]]:
    """For each group of tied weights (``[(name, stage), ...]`` from
    ``slapo.pipeline.analyze_tie_weights``): the rank groups that must sum its gradient (the i-th
    rank of every stage holding it, as ``topology.filter_match(pipe=stage)`` lists a stage's ranks),
    and its stages, sorted."""
    tie_ranks, tie_stages = [], []
    for group in tie_weight_groups:
        stages = [stage for _, stage in group]
        ranks_per_stage = [list(topology.filter_match(pipe=stage)) for stage in stages]
        tie_ranks.append([sorted(column) for column in zip(*ranks_per_stage, strict=True)])
        tie_stages.append(sorted(stages))
    return tie_ranks, tie_stages
