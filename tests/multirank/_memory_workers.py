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


def receive_buffers_alive_rank(ctx, specs: list, point: dict) -> list[list[tuple[str, int, int, int]]]:
    """For each problem: one real step of an interleaved pipeline, and at the start of each compute
    action of this rank (forward, backward, weight pass: its kind, stage and micro-batch) how many
    of the receive buffers the runtime's stages made are still alive (weak references to their
    storages: alive while anything, autograd included, holds them)."""
    import weakref

    from slapo_tune.runtime import _lazy_receive_stage
    from slapo_tune.session import Session

    stage_class = _lazy_receive_stage()
    made: list[weakref.ref] = []
    actions: list[tuple[str, int, int, int]] = []
    originals = {name: stage_class.__dict__[name] for name in
                 ("_allocate", "forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")}

    def allocate(infos, device):
        before = [info.buffer for info in infos]
        originals["_allocate"].__func__(infos, device)
        made.extend(weakref.ref(info.buffer.untyped_storage()) for old, info in zip(before, infos, strict=True)
                    if info.buffer is not None and info.buffer is not old)

    def counting(name: str, kind: str):
        def run(self, chunk_id, *args, **kwargs):
            actions.append((kind, self.stage_index, chunk_id, sum(ref() is not None for ref in made)))
            return originals[name](self, chunk_id, *args, **kwargs)
        return run

    stage_class._allocate = staticmethod(allocate)
    stage_class.forward_one_chunk = counting("forward_one_chunk", "F")
    stage_class.backward_one_chunk = counting("backward_one_chunk", "B")
    stage_class.backward_weight_one_chunk = counting("backward_weight_one_chunk", "W")
    out = []
    try:
        for spec in specs:
            problem = spec.resolve()
            session = Session(problem, problem.plan(point), seed=0)
            batch = session.synthetic_batch()
            session.train_step(batch)  # the first step builds the stages
            made.clear()
            actions.clear()
            session.train_step(batch)
            out.append(list(actions))
            dist.barrier()
    finally:
        for name, original in originals.items():
            setattr(stage_class, name, original)
    return out
