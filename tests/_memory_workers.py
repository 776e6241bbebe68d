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


def held_buffers_rank(ctx, spec, point: dict, steps: int = 3) -> list[tuple[int, list[int]]]:
    """For each of ``steps`` steps: the bytes of the pipeline receive buffers the step keeps
    (:meth:`TrainStep.held_buffers`) and their storages' addresses."""
    from slapo_tune.session import Session

    problem = spec.resolve()
    session = Session(problem, problem.plan(point), seed=0)
    batch = session.synthetic_batch()
    out = []
    for _ in range(steps):
        session.train_step(batch)
        held = session.step.held_buffers()
        out.append((sum(t.untyped_storage().nbytes() for t in held), [t.untyped_storage().data_ptr() for t in held]))
    return out
