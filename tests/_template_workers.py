"""Rank function for the template verification tests."""

from __future__ import annotations

import torch.distributed as dist

from slapo_tune.checks import verify_point


def verify_points(ctx, cases):
    out = {}
    for key, spec, template, point, workload in cases:
        out[key] = verify_point(ctx, spec, template, point, workload)
        dist.barrier()
    return out
