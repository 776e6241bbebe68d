"""Rank functions of the memory tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _train_step(run, optimizer, batch) -> None:
    run.step(batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def both_trackers_rank(ctx, spec, template_name: str, points: list[dict], workload) -> list[tuple[int, int]]:
    """For each point: one real step tracked at once by the cost model's tracker (what exact mode
    counts with) and by torch's MemTracker (what measurements count with); their two peaks."""
    from search_spaces import load_template
    from slapo_tune.cost_model._tracker import PeakTracker
    from slapo_tune.cost_model.measure import StepMemTracker
    from slapo_tune.data import synthetic_batch
    from slapo_tune.realize import realize
    from slapo_tune.runtime import default_optimizer

    out = []
    for point in points:
        run = realize(spec, load_template(template_name), point, workload, seed=0)
        optimizer = default_optimizer(run.stage.parameters())
        batch = synthetic_batch(run.stage.model.config.vocab_size, workload.global_batch, workload.seq_len)
        _train_step(run, optimizer, batch)  # the optimizer state exists from here on
        ours, theirs = PeakTracker(), StepMemTracker()
        ours.track(run.stage, optimizer)
        theirs.track_external(run.stage, optimizer)
        with theirs, ours:
            _train_step(run, optimizer, batch)
        out.append((ours.peak, theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]))
        dist.barrier()
    return out
