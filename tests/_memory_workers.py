"""Rank functions of the memory tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _train_step(run, optimizer, batch) -> None:
    run.step(batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def real_steps_rank(ctx, spec, template_name: str, points: list[dict], workload) -> list[dict]:
    """For each point: what measurements report (:func:`measure_point_rank`: MemTracker), and the
    peaks of one more real step watched at once by the cost model's tracker (what exact mode counts
    with) and by MemTracker (``both``)."""
    from search_spaces import load_template
    from slapo_tune.cost_model._tracker import PeakTracker
    from slapo_tune.cost_model.measure import StepMemTracker, measure_point_rank
    from slapo_tune.data import synthetic_batch
    from slapo_tune.realize import realize
    from slapo_tune.runtime import default_optimizer

    out = []
    for point in points:
        measured = measure_point_rank(ctx, spec, template_name, point, workload, timed_steps=1)
        dist.barrier()
        run = realize(spec, load_template(template_name), point, workload, seed=0)
        optimizer = default_optimizer(run.stage.parameters())
        batch = synthetic_batch(run.stage.model.config.vocab_size, workload.global_batch, workload.seq_len)
        _train_step(run, optimizer, batch)  # the optimizer state exists from here on
        ours, theirs = PeakTracker(), StepMemTracker()
        ours.track(run.stage, optimizer)
        theirs.track_external(run.stage, optimizer)
        with theirs, ours:
            _train_step(run, optimizer, batch)
        measured["both"] = (ours.peak, theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        out.append(measured)
        dist.barrier()
    return out
