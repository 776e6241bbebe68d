"""Rank function of the send-release tests (importable by spawned ranks)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def with_and_without_release(ctx, spec, point: dict) -> dict:
    """One interleaved step's gradients, loss and measured peak (MemTracker) with the send release,
    then with torch's retention (the release turned off); the most sends the release held at once
    and its bound (:func:`~slapo_tune.parallel._send_release.pending_gradient_sends`)."""
    from slapo_tune.memory import measured_peak
    from slapo_tune.parallel import _send_release
    from slapo_tune.session import Session

    problem = spec.resolve()
    session = Session(problem, problem.plan(point), seed=0)
    batch = session.synthetic_batch()
    step = session.step
    out = {"rank": dist.get_rank()}

    def run(mode: str) -> None:
        loss = step.run(batch)
        out[mode] = {"loss": loss.clone(), "most": step.send_release.most if step.send_release else None,
                     "grads": {n: p.grad.clone() for n, p in session.stage.named_parameters() if p.grad is not None}}
        dist.barrier()
        peak = measured_peak(lambda: step.run(batch), session.stage, session.optimizer, held=step.held_buffers())
        out[mode]["peak"] = peak.total
        dist.barrier()

    run("released")
    original = _send_release.releasing_sends
    _send_release.releasing_sends = lambda schedule: contextlib.nullcontext()
    try:
        run("retained")
    finally:
        _send_release.releasing_sends = original
    # compared here (tensors do not travel back from a rank that has ended)
    released, retained = out["released"].pop("grads"), out["retained"].pop("grads")
    out["grads"] = len(released)
    out["same_grads"] = released.keys() == retained.keys() and all(
        torch.equal(grad, retained[name]) for name, grad in released.items())
    out["same_loss"] = torch.equal(out["released"].pop("loss"), out["retained"].pop("loss"))
    rows, seq = step._shape  # what crosses a boundary: one micro-batch's hidden state (fp32)
    out["send_bytes"] = rows * seq * step.model.model.config.hidden_size * torch.finfo(torch.float32).bits // 8
    topo = step.topology
    out["bound"] = _send_release.pending_gradient_sends(topo.pp, len(step.model.chunks), step.n_microbatches,
                                                        topo.pp_rank)
    out["stages"] = [s.stage_index for s in step._schedule._stages]
    return out
