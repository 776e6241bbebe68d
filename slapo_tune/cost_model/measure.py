"""Measured ground truth: the tensor-level peak of a real training step, per rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..data import synthetic_batch
from ..runtime import default_optimizer
from ..template import Workload
from ._tracker import MemoryBreakdown, tracked_step


def measured_memory_rank(ctx, spec, template_name: str, point: Mapping[str, Any], workload: Workload,
                         seed: int = 0) -> dict[str, Any]:
    """Rank function: one untracked step (creates optimizer state), then one tracked step."""
    from search_spaces import load_template

    from ..realize import realize

    torch.manual_seed(seed)
    run = realize(spec, load_template(template_name), point, workload, seed=seed, device=ctx.device)
    optimizer = default_optimizer(run.stage.parameters())
    config = run.stage.model.config
    batch = synthetic_batch(config.vocab_size, workload.global_batch, workload.seq_len, seed)
    run.step(batch)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peak: MemoryBreakdown = tracked_step(run.step, run.stage, optimizer, batch)
    return {"rank": ctx.rank, "stage": run.stage.info.index, **peak.as_dict()}
