"""Rank functions of the memory tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def real_steps_rank(ctx, spec, points: list[dict]) -> list[dict]:
    """For each point: what measurements report (:func:`measure_point_rank`: MemTracker), and the
    peaks of one more real step watched at once by the cost model's tracker (what exact mode counts
    with) and by MemTracker (``both``)."""
    from slapo_tune.cost_model._tracker import PeakTracker
    from slapo_tune.cost_model.measure import measure_point_rank
    from slapo_tune.memory import StepMemTracker
    from slapo_tune.session import Session

    problem = spec.resolve()
    out = []
    for point in points:
        measured = measure_point_rank(ctx, spec, point, timed_steps=1)
        dist.barrier()
        session = Session(problem, problem.plan(point), seed=0)
        batch = session.synthetic_batch()
        session.train_step(batch)  # the optimizer state exists from here on
        ours, theirs = PeakTracker(), StepMemTracker()
        ours.track(session.stage, session.optimizer)
        held = session.step.held_buffers()  # a pipeline's receive buffers: given to both alike
        for buffer in held:
            ours._add(buffer, "activations")
        theirs.track_external(session.stage, session.optimizer, *held)
        with theirs, ours:
            session.train_step(batch)
        measured["both"] = (ours.peak, theirs.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        out.append(measured)
        dist.barrier()
    return out


def peaks_over_microbatches_rank(ctx, specs: list, point: dict) -> list[dict]:
    """For each problem (the same point, a different global batch, so a different micro-batch
    count): the measured peak of a step (MemTracker), and the receive buffers the step kept after
    it (:meth:`TrainStep.held_buffers`)."""
    from slapo_tune.cost_model.measure import measure_point_rank
    from slapo_tune.session import Session

    out = []
    for spec in specs:
        measured = measure_point_rank(ctx, spec, point, timed_steps=0, tracked_steps=1)
        problem = spec.resolve()
        session = Session(problem, problem.plan(point), seed=0)
        session.train_step(session.synthetic_batch())
        measured["held"] = len(session.step.held_buffers())
        out.append(measured)
        dist.barrier()
    return out
