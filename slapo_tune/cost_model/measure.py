"""Measured ground truth: step times and the tensor-level peak of real training steps, per rank.

Time is taken on ordinary steps, memory on one dedicated step (tracking every tensor slows a step
several-fold), after a warm-up step that creates the optimizer state. Gloo's worker threads drop
their references to a collective's buffers a moment after the collective returns, so a step's peak
sometimes includes one buffer that should already be gone (seen: +5 % on a 3 MiB tiny model,
one run in four); the smallest peak of two tracked steps is the reproducible figure.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..data import synthetic_batch
from ..runtime import default_optimizer
from ..template import Workload
from ._tracker import tracked_step


def measure_point_rank(ctx, spec, template_name: str, point: Mapping[str, Any], workload: Workload,
                       timed_steps: int = 3, warmup_steps: int = 1, seed: int = 0,
                       tracked_steps: int = 2) -> dict[str, Any]:
    """Rank function: warm-up, timed steps (each with its optimizer update), then a memory step."""
    from search_spaces import load_template

    from ..realize import realize

    torch.manual_seed(seed)
    run = realize(spec, load_template(template_name), point, workload, seed=seed, device=ctx.device)
    optimizer = default_optimizer(run.stage.parameters())
    batch = synthetic_batch(run.stage.model.config.vocab_size, workload.global_batch, workload.seq_len, seed)
    losses, times = [], []
    for i in range(warmup_steps + timed_steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(run.step(batch))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup_steps:
            times.append(time.perf_counter() - t0)
    result = {"rank": ctx.rank, "stage": run.stage.info.index, "step_times": times, "losses": losses}
    if tracked_steps:
        peak = min((tracked_step(run.step, run.stage, optimizer, batch) for _ in range(tracked_steps)),
                   key=lambda b: b.total)
        result.update(peak.as_dict())
    return result


def measure_points_rank(ctx, spec, template_name: str, points: list[Mapping[str, Any]], workload: Workload,
                        timed_steps: int = 3, tracked_steps: int = 2) -> list[dict[str, Any]]:
    """Many points in one launch (ranks start once)."""
    out = []
    for point in points:
        out.append(measure_point_rank(ctx, spec, template_name, point, workload, timed_steps,
                                      tracked_steps=tracked_steps))
        dist.barrier()
    return out
