"""Rank function for tests/multirank/test_sequence_parallel.py: every sequence-parallel check in one launch."""

from __future__ import annotations

import torch.distributed as dist

from slapo_tune.cost_model.measure import measure_points_rank

from _template_workers import verify_points


def verify_and_measure(ctx, cases, memory_spec, memory_points):
    """``verify_points`` over ``cases``, then each of ``memory_points`` measured on real steps
    (a warm-up step, then the peak of two tracked steps; no timed steps)."""
    verified = verify_points(ctx, cases)
    measured = measure_points_rank(ctx, memory_spec, memory_points, timed_steps=0, tracked_steps=2)
    return {"verify": verified, "memory": measured}


def count_async_collectives(ctx, cases):
    """``verify_points`` over ``cases``, counting per case the all-gathers and reduce-scatters this
    rank issues with ``async_op=True`` (torch.distributed's own functions, wrapped for the count)."""
    counts = {"all_gather": 0, "reduce_scatter": 0}

    def counting(name, collective):
        def call(*args, **kwargs):
            counts[name] += bool(kwargs.get("async_op"))
            return collective(*args, **kwargs)
        return call

    originals = {name: getattr(dist, name) for name in counts}
    for name, collective in originals.items():
        setattr(dist, name, counting(name, collective))
    out = {}
    try:
        for key, spec, point in cases:
            counts.update(all_gather=0, reduce_scatter=0)
            verified = verify_points(ctx, [(key, spec, point)])[key]
            out[key] = {"verify": verified, **counts}
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
    return out
