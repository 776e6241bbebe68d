"""Rank functions of the session tests (importable by spawned ranks)."""

from __future__ import annotations


def measure_with_a_busy_rank(ctx, spec, knobs: dict, busy_rank: int) -> dict:
    """Session.measure where ``busy_rank`` waits for a core through its first timed step (its
    run-queue clock jumps by a second during it) and no other rank ever does."""
    import slapo_tune.session as session_module

    problem = spec.resolve()
    session = session_module.Session(problem, problem.plan(knobs), seed=0)
    clock = {"reads": 0}

    def run_queue_wait() -> float:
        clock["reads"] += 1  # two reads per timed step: before and after
        return 1.0 if ctx.rank == busy_rank and clock["reads"] >= 2 else 0.0

    session_module.run_queue_wait = run_queue_wait
    measured = session.measure(session.synthetic_batch(), warmup_steps=1, timed_steps=2, tracked_steps=0)
    return {"times": measured.times, "remeasured": measured.remeasured, "steps": len(measured.losses)}
