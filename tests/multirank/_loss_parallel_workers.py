"""Rank functions for the vocabulary-parallel loss tests (run in spawned processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slapo_tune.parallel._vocab_loss import vocab_parallel_cross_entropy


def _reference(logits, labels, shift):
    if shift:
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def run_cross_entropy(ctx, vocab):
    """The vocabulary-parallel loss and its gradient on this rank's slice against torch's
    cross-entropy of the whole logits (same seed on every rank), shifted and not, with labels
    ignored and labels on every rank's slice."""
    out = {}
    for shift in (True, False):
        torch.manual_seed(0)
        logits = (torch.randn(3, 7, vocab, dtype=torch.float64) * 4).float()
        labels = torch.randint(0, vocab, (3, 7))
        labels[0, 2] = labels[1, 5] = -100
        whole = logits.clone().requires_grad_(True)
        ref = _reference(whole, labels, shift)
        ref.backward()
        width = vocab // ctx.world_size
        cols = slice(ctx.rank * width, (ctx.rank + 1) * width)
        local = logits[..., cols].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, labels, None, shift=shift)
        (loss * 3).backward()
        out[shift] = {"loss_error": abs(loss.item() - ref.item()), "loss": loss.item(),
                      "grad_error": (local.grad - 3 * whole.grad[..., cols]).abs().max().item()}
    # bf16 logits: the loss in fp32 (as Hugging Face upcasts), the gradient back in bf16
    torch.manual_seed(0)
    logits = torch.randn(3, 7, vocab).bfloat16()
    labels = torch.randint(0, vocab, (3, 7))
    whole = logits.clone().requires_grad_(True)
    ref = _reference(whole.float(), labels, True)
    ref.backward()
    local = logits[..., cols].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, None)
    loss.backward()
    out["bf16"] = {"loss_error": abs(loss.item() - ref.item()), "loss": loss.item(), "grad_dtype": str(local.grad.dtype),
                   "grad_error": (local.grad.float() - whole.grad[..., cols].float()).abs().max().item()}
    return out


def run_template_points(ctx, cases):
    """verify_point for each (key, spec, knobs), with the width of the logits the stage returns."""
    from slapo_tune.checks import verify_point
    from slapo_tune.session import Session

    out = {}
    for key, spec, knobs in cases:
        res = verify_point(ctx, spec, knobs)
        problem = spec.resolve()
        session = Session(problem, problem.plan(knobs), device=ctx.device)
        ids = session.synthetic_batch(0)["input_ids"][:1]
        with torch.no_grad():
            res["logits_width"] = session.stage(ids).shape[-1]
        out[key] = res
    return out
