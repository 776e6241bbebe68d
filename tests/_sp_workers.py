"""Rank function for tests/test_sequence_parallel.py: every sequence-parallel check in one launch."""

from __future__ import annotations

from slapo_tune.cost_model.measure import measure_points_rank

from _template_workers import verify_points


def verify_and_measure(ctx, cases, memory_spec, memory_points):
    """``verify_points`` over ``cases``, then each of ``memory_points`` measured on real steps
    (a warm-up step, then the peak of two tracked steps; no timed steps)."""
    verified = verify_points(ctx, cases)
    measured = measure_points_rank(ctx, memory_spec, memory_points, timed_steps=0, tracked_steps=2)
    return {"verify": verified, "memory": measured}
