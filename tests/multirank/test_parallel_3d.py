"""Pipeline, data and tensor parallelism (and their compositions) verify against the unscheduled
model on CPU/gloo: forward loss and every gradient."""

import pytest

import slapo_tune as st
from slapo_tune.launch import launch

from _helpers import uncompared
from _pp_workers import run_cases

MODELS = ["gpt2-tiny", "llama-tiny"]
# (pp, tp, zero, schedule, ckpt ratio, micro-batches)
WORLD2 = [(2, 1, 0, sched, ckpt, 2) for sched in ("1f1b", "gpipe") for ckpt in (0.0, 1.0)]
WORLD4 = [
    (2, 2, 0, "1f1b", 0.5, 2),   # pp=2 x tp=2
    (2, 2, 0, "gpipe", 0.0, 4),
    (1, 2, 0, "1f1b", 0.0, 2),   # dp=2 x tp=2
    (1, 2, 3, "gpipe", 1.0, 2),  # dp=2 x tp=2, ZeRO-3
    (2, 1, 0, "1f1b", 1.0, 2),   # dp=2 x pp=2
    (2, 1, 3, "1f1b", 0.0, 2),   # dp=2 x pp=2, ZeRO-3
    (2, 1, 3, "gpipe", 0.5, 4),
]
CASES = {2: [(m, *c) for m in MODELS for c in WORLD2], 4: [(m, *c) for m in MODELS for c in WORLD4]}


@pytest.fixture(scope="module")
def outcomes():
    return {world: launch(run_cases, world, args=(cases,), timeout=900) for world, cases in CASES.items()}


def _ids(world):
    return [f"{m}-pp{pp}-tp{tp}-dp{world // (pp * tp)}-zero{z}-{s}-ckpt{c}-mb{n}" for m, pp, tp, z, s, c, n in CASES[world]]


@pytest.mark.parametrize("world", [2, 4])
def test_every_case_verifies(outcomes, world):
    failures = []
    for case, name in zip(CASES[world], _ids(world)):
        for rank, per_rank in enumerate(outcomes[world]):
            res = per_rank[case]
            if not res["ok"]:
                failures.append(f"{name} rank {rank}:\n{res['report']}")
            else:
                assert res["grad_error"] < 1e-4
        if all(per_rank[case]["ok"] for per_rank in outcomes[world]):
            # every parameter's gradient was compared on some rank (the stages hold them all)
            missing = uncompared(st.build_model(case[0]), [r[case]["compared"] for r in outcomes[world]])
            assert not missing, (name, missing)
    assert not failures, "\n".join(failures)


def test_gpt2_tied_embedding_is_summed_across_stages(outcomes):
    case = ("gpt2-tiny", 2, 1, 0, "1f1b", 0.0, 2)
    first, last = outcomes[2][0][case], outcomes[2][1][case]
    assert (first["stage"], first["tied"]) == (0, ["transformer.wte.weight"])
    assert (last["stage"], last["tied"]) == (1, ["lm_head.weight"])
    assert first["ok"] and last["ok"]  # both copies got the reference's (summed) gradient
    llama = outcomes[2][0][("llama-tiny", 2, 1, 0, "1f1b", 0.0, 2)]
    assert llama["tied"] == []  # untied head: nothing to sum
