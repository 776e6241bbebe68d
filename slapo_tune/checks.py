"""Rank functions behind ``slapo-tune verify`` (importable, for spawned ranks)."""

from __future__ import annotations

from typing import Any

from .data import synthetic_batch
from .errors import VerificationError
from .realize import ModelSpec, realize
from .template import Workload, set_attention


def verify_point(ctx, spec: ModelSpec, template_name: str, point: dict[str, Any], workload: Workload,
                 seed: int = 0) -> dict[str, Any]:
    """Verify one schedule point against the unscheduled model on this rank; returns a summary."""
    from search_spaces import load_template

    from ._verify import verify

    template = load_template(template_name)
    run = realize(spec, template, point, workload, seed=seed, device=ctx.device)
    reference = spec.build("meta")
    set_attention(reference, point["attn"])
    batch = synthetic_batch(reference.config.vocab_size, workload.global_batch, workload.seq_len, seed=seed)
    try:
        report = verify(run.stage, reference, batch, n_microbatches=run.accumulation,
                        pipeline_schedule=point["pipeline_schedule"], seed=seed)
        ok, text = True, str(report)
    except VerificationError as exc:
        report, ok, text = None, False, str(exc)
    return {
        "ok": ok,
        "report": text,
        "rank": ctx.rank,
        "stage": run.stage.info.index,
        "loss": None if report is None else report.loss,
        "reference_loss": None if report is None else report.reference_loss,
        "loss_error": None if report is None else report.loss_error,
        "max_grad_error": None if report is None else report.max_grad_error,
        "params": None if report is None else report.params_compared,
        "compared": [] if report is None else report.compared,
    }
