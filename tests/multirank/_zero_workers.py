"""Rank function for tests/multirank/test_zero.py: the collectives FSDP issues during one training step."""

from __future__ import annotations

import torch.distributed as dist

from slapo_tune.problem import ProblemSpec
from slapo_tune.session import Session


def count_collectives(ctx, spec: ProblemSpec, points: list[dict]) -> list[dict[str, int]]:
    """For each point, the all-gathers and reduce-scatters FSDP starts during one step (after a
    warm-up step), counted where FSDP calls them (``dist.all_gather_single`` /
    ``dist.reduce_scatter_single``)."""
    problem = spec.resolve()
    out = []
    for point in points:
        session = Session(problem, problem.plan(point), seed=0)
        batch = session.synthetic_batch()
        session.train_step(batch)
        counts = {"all_gather": 0, "reduce_scatter": 0}
        originals = {name: getattr(dist, f"{name}_single") for name in counts}
        for name in counts:
            setattr(dist, f"{name}_single", _counting(originals[name], counts, name))
        try:
            session.train_step(batch)
        finally:
            for name, fn in originals.items():
                setattr(dist, f"{name}_single", fn)
        out.append(counts)
        dist.barrier()
    return out


def _counting(collective, counts: dict[str, int], name: str):
    def call(*args, **kwargs):
        counts[name] += 1
        return collective(*args, **kwargs)

    return call


def bf16_gradients_alive(ctx, spec: ProblemSpec, points: list[dict], steps: int = 3) -> list[dict]:
    """For each point, the step losses and the most bytes of bf16 parameter gradients (``.grad``
    of the parameters backward writes) alive at once during the last step. Read where autograd
    writes them: a post-accumulate-grad hook on every parameter the stage computes with (FSDP's
    unsharded ones, or the replicated bf16 ones) sums the bf16 ``.grad`` alive across the stage."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    problem = spec.resolve()
    out = []
    for point in points:
        session = Session(problem, problem.plan(point), seed=0)
        batch = session.synthetic_batch()
        losses = [float(session.train_step(batch))]  # FSDP makes its unsharded parameters here
        params = []
        for module in session.stage.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                params += [p._unsharded_param for p in (group.fsdp_params if group else [])]
        if not params:  # replicated: the module's own parameters
            params = list(session.stage.parameters())
        peak = [0]

        def alive(_param, peak=peak, params=params) -> None:
            peak[0] = max(peak[0], sum(p.grad.nbytes for p in params
                                       if p.grad is not None and p.grad.dtype == torch.bfloat16))

        handles = [p.register_post_accumulate_grad_hook(alive) for p in params]
        for _ in range(steps - 1):
            peak[0] = 0
            losses.append(float(session.train_step(batch)))
        for h in handles:
            h.remove()
        out.append({"losses": losses, "peak_bf16_grads": peak[0]})
        dist.barrier()
    return out
