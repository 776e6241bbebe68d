"""Rank functions behind ``slapo-tune verify`` (importable, for spawned ranks)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._verify import verify
from .errors import VerificationError
from .problem import ProblemSpec
from .session import Session
from .template import set_attention


def verify_point(ctx, spec: ProblemSpec, knobs: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Verify one schedule point against the unscheduled model on this rank; returns a summary."""
    problem = spec.resolve()
    plan = problem.plan(knobs)
    session = Session(problem, plan, seed=seed, device=ctx.device)
    reference = problem.model.build("meta")
    set_attention(reference, plan.attn)
    batch = session.synthetic_batch(seed)
    try:
        report = verify(session.stage, reference, batch, step=session.step, seed=seed)
        ok, text = True, str(report)
    except VerificationError as exc:
        report, ok, text = None, False, str(exc)
    return {
        "ok": ok,
        "report": text,
        "rank": ctx.rank,
        "stage": session.stage.info.index,
        "loss": None if report is None else report.loss,
        "reference_loss": None if report is None else report.reference_loss,
        "loss_error": None if report is None else report.loss_error,
        "max_grad_error": None if report is None else report.max_grad_error,
        "params": None if report is None else report.params_compared,
        "compared": [] if report is None else report.compared,
    }
