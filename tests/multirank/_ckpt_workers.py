"""Rank function of the selective-checkpointing tests (importable by spawned ranks)."""

from __future__ import annotations


def verify_then_measure(ctx, cases, memory_spec, memory_points):
    """Verify ``cases`` (as :func:`_template_workers.verify_points`), then measure one real step of
    each of ``memory_points`` (warm-up, then two steps under MemTracker, the smaller peak kept): one launch for both."""
    from slapo_tune.cost_model.measure import measure_points_rank

    from _template_workers import verify_points

    verified = verify_points(ctx, cases)
    measured = measure_points_rank(ctx, memory_spec, memory_points, 0, 2)
    return verified, measured
