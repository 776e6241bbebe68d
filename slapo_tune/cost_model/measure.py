"""Measured ground truth for the cost model: step times and the peak memory of real training steps
of many points, per rank, through the same :class:`~slapo_tune.session.Session` trials use (the
peak by :func:`slapo_tune.memory.measured_peak`, a tool the predictions never use).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..problem import ProblemSpec
from ..session import Session


def measure_point_rank(ctx, spec: ProblemSpec, point: Mapping[str, Any], timed_steps: int = 3,
                       warmup_steps: int = 1, seed: int = 0, tracked_steps: int = 2) -> dict[str, Any]:
    """Rank function: warm-up, memory steps (the smallest peak is kept), then timed steps."""
    problem = spec.resolve()
    torch.manual_seed(seed)
    session = Session(problem, problem.plan(point), seed=seed, device=ctx.device)
    measured = session.measure(session.synthetic_batch(), warmup_steps=warmup_steps, timed_steps=timed_steps,
                               tracked_steps=tracked_steps)
    result = {"rank": ctx.rank, "stage": session.stage.info.index, "step_times": measured.times,
              "losses": measured.losses}
    if tracked_steps:
        result.update(measured.peak.as_dict())
    return result


def measure_points_rank(ctx, spec: ProblemSpec, points: list[Mapping[str, Any]], timed_steps: int = 3,
                        tracked_steps: int = 2) -> list[dict[str, Any]]:
    """Many points in one launch (ranks start once)."""
    out = []
    for point in points:
        out.append(measure_point_rank(ctx, spec, point, timed_steps, tracked_steps=tracked_steps))
        dist.barrier()
    return out
