"""Rank function for tests/test_zero.py: the collectives FSDP issues during one training step."""

from __future__ import annotations

import torch.distributed as dist

from slapo_tune.problem import ProblemSpec
from slapo_tune.session import Session


def count_collectives(ctx, spec: ProblemSpec, points: list[dict]) -> list[dict[str, int]]:
    """For each point, the all-gathers and reduce-scatters FSDP starts during one step (after a
    warm-up step), counted where FSDP calls them (``dist.all_gather_single`` /
    ``dist.reduce_scatter_single``)."""
    problem = spec.resolve()
    out = []
    for point in points:
        session = Session(problem, problem.plan(point), seed=0)
        batch = session.synthetic_batch()
        session.train_step(batch)
        counts = {"all_gather": 0, "reduce_scatter": 0}
        originals = {name: getattr(dist, f"{name}_single") for name in counts}
        for name in counts:
            setattr(dist, f"{name}_single", _counting(originals[name], counts, name))
        try:
            session.train_step(batch)
        finally:
            for name, fn in originals.items():
                setattr(dist, f"{name}_single", fn)
        out.append(counts)
        dist.barrier()
    return out


def _counting(collective, counts: dict[str, int], name: str):
    def call(*args, **kwargs):
        counts[name] += 1
        return collective(*args, **kwargs)

    return call
