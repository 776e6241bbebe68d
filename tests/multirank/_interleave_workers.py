"""Rank function for the interleaved-pipeline tests."""

from __future__ import annotations

import torch.distributed as dist

from slapo_tune.checks import verify_point
from slapo_tune.errors import ScheduleError
from slapo_tune.runtime import TrainStep
from slapo_tune.schedule._schedule import state_of
from slapo_tune.session import Session


def verify_and_describe(ctx, cases, layout_case):
    """Verify every case; then, for ``layout_case``, which stages and blocks this rank holds, and
    what TrainStep says to a schedule interleaving cannot run."""
    out = {key: verify_point(ctx, spec, point) for key, spec, point in cases}
    dist.barrier()
    spec, point = layout_case
    problem = spec.resolve()
    session = Session(problem, problem.plan(point), device=ctx.device)
    chunks = session.stage.chunks
    blocks = problem.template.blocks_path(problem.model.build("meta"))

    def refusal(schedule: str) -> str:
        try:
            TrainStep(session.stage, n_microbatches=session.plan.accumulation, schedule=schedule)
        except ScheduleError as exc:
            return str(exc)
        return ""

    refused = refusal("gpipe")
    accepted = refusal("zb")
    block = chunks[0].model.get_submodule(chunks[0].info.first_block)
    state_of(block, create=True).checkpoint_policy = "selective"  # as checkpoint(policy="selective") leaves it
    selective = refusal("zb")
    out["layout"] = {
        "stages": [c.info.index for c in chunks],
        "num_stages": [c.info.num_stages for c in chunks],
        "blocks": [sorted({name.split(".")[len(blocks.split("."))] for name, _ in c.model.named_parameters()
                           if name.startswith(blocks + ".")}) for c in chunks],
        "is_first": session.stage.info.is_first, "is_last": session.stage.info.is_last,
        "gpipe": refused, "zb": accepted, "zb_selective": selective,
    }
    dist.barrier()
    return out
