"""Interleaved pipelines (``vpp`` virtual stages per rank, interleaved 1F1B or zero bubble): the
space's legality, each rank's stages, and steps that verify against the unscheduled model (with
fusion, full and selective checkpointing, tensor and sequence parallelism, every ZeRO level and
bf16)."""

import pytest
from torch import fx

from slapo_tune import create_schedule
from slapo_tune.errors import PipelineError
from slapo_tune.launch import launch
from slapo_tune.parallelize import apply_pipeline_cuts, interleaved_microbatches_ok
from slapo_tune.problem import ProblemSpec
from slapo_tune.schedule._build import build
from slapo_tune.schedule._pipeline import structural_copy
from slapo_tune.schedule._schedule import TRACED_FROM, state_of
from slapo_tune.space import format_point

from _helpers import blocks, uncompared

WORLD, GLOBAL_BATCH, SEQ = 4, 8, 16


def _spec(model, precision="fp32"):
    return ProblemSpec(model, WORLD, global_batch=GLOBAL_BATCH, seq_len=SEQ, precision=precision)


CASES = [
    ("gpt2-tiny", "fp32", dict(pp=2, vpp=2, micro_batch=1, fuse="on", ckpt_ratio=1.0)),
    # sequence parallelism: stages send and receive their slice of the sequence
    ("llama-tiny", "fp32", dict(tp=2, pp=2, sp="on", vpp=2, micro_batch=2, ckpt_ratio=0.5)),
    ("gpt2-tiny", "fp32", dict(tp=2, pp=2, sp="on", vpp=2, micro_batch=2)),
    ("gpt2-tiny", "fp32", dict(pp=2, vpp=2, micro_batch=2, zero=3)),
    ("llama-tiny", "bf16", dict(pp=2, vpp=2, micro_batch=1, zero=1)),
    ("llama-tiny", "fp32", dict(pp=2, vpp=2, micro_batch=1, zero=2, attn="eager")),
    # zero bubble: weight gradients deferred into the bubble, with tensor parallelism and ZeRO-2
    ("llama-tiny", "fp32", dict(tp=2, pp=2, sp="on", vpp=2, micro_batch=2, pipeline_schedule="zb", ckpt_ratio=1.0)),
    ("gpt2-tiny", "fp32", dict(pp=2, vpp=2, micro_batch=1, zero=2, pipeline_schedule="zb", fuse="on")),
]


@pytest.fixture(scope="module")
def interleaved_runs():
    from _interleave_workers import verify_and_describe

    cases = []
    for model, precision, knobs in CASES:
        spec = _spec(model, precision)
        point = spec.resolve().plan({"pipeline_schedule": "1f1b", **knobs}).knobs()
        cases.append(((model, precision, format_point(point)), spec, point))
    layout = (_spec("gpt2-tiny"), {"pp": 2, "vpp": 2, "micro_batch": 1, "pipeline_schedule": "1f1b"})
    return cases, launch(verify_and_describe, WORLD, args=(cases, layout), timeout=900)


def test_interleaved_points_verify_at_world_4(interleaved_runs):
    cases, results = interleaved_runs
    for key, spec, point in cases:
        assert point["vpp"] == 2
        for r in results:
            assert r[key]["ok"], f"{key} rank {r[key]['rank']}:\n{r[key]['report']}"
            if spec.precision == "fp32":
                assert r[key]["max_grad_error"] < 1e-4 and r[key]["loss_error"] < 1e-4, key
        # every gradient of the model was compared on some rank
        assert not uncompared(spec.model_spec.build("meta"), [r[key]["compared"] for r in results]), key


def test_rank_r_holds_stages_r_and_r_plus_pp(interleaved_runs):
    """gpt2-tiny's 4 blocks cut into 4 stages over pp=2 (tp=1, dp=2): ranks 0 and 2 are pipeline
    rank 0 (blocks 0 and 2), ranks 1 and 3 pipeline rank 1 (blocks 1 and 3)."""
    _, results = interleaved_runs
    for rank, r in enumerate(results):
        pp_rank = rank // 2  # the topology orders ranks tp, then dp, then pp
        layout = r["layout"]
        assert layout["stages"] == [pp_rank, pp_rank + 2] and layout["num_stages"] == [4, 4]
        assert layout["blocks"] == [[str(pp_rank)], [str(pp_rank + 2)]]
        assert (layout["is_first"], layout["is_last"]) == (pp_rank == 0, pp_rank == 1)
        assert "interleaved 1F1B or zero bubble" in layout["gpipe"]
        assert layout["zb"] == "" and "selective recomputation allows once" in layout["zb_selective"]


def test_vpp_is_legal_only_where_interleaved_1f1b_runs():
    space = ProblemSpec("gpt2-tiny", 4, global_batch=8, seq_len=16).resolve().space
    points = list(space.enumerate())
    interleaved = [p for p in points if p["vpp"] > 1]
    assert interleaved and {p["vpp"] for p in interleaved} == {2}  # 4 layers over pp=2
    for p in interleaved:
        n = 8 // (p["dp"] * p["micro_batch"])
        assert p["pp"] == 2 and p["pipeline_schedule"] in ("1f1b", "zb") and interleaved_microbatches_ok(n, 2)
    # every pp=2 1F1B point has its interleaved twin, and a zero-bubble one unless at ZeRO-3
    plain = [p for p in points if p["pp"] == 2 and p["pipeline_schedule"] == "1f1b" and p["vpp"] == 1]
    assert len(plain) == sum(p["pipeline_schedule"] == "1f1b" for p in interleaved)
    zero_bubble = [p for p in points if p["pipeline_schedule"] == "zb"]
    assert zero_bubble and all(p["vpp"] == 2 and p["zero"] < 3 and p["ckpt_policy"] == "full" for p in zero_bubble)
    assert len(zero_bubble) == sum(p["zero"] < 3 and p["ckpt_policy"] == "full" for p in plain)
    assert not any(p["vpp"] > 1 for p in points if p["pp"] == 1 or p["pipeline_schedule"] == "gpipe")


@pytest.mark.parametrize("n, pp, ok", [(4, 2, True), (1, 2, False), (6, 4, True), (5, 2, False), (10, 4, True),
                                       (9, 4, False), (3, 4, False)])
def test_interleaved_microbatch_counts(n, pp, ok):
    """torch's interleaved 1F1B: at least pp micro-batches, in max(1, n // pp) rounds of equal size."""
    assert interleaved_microbatches_ok(n, pp) is ok


def test_a_stage_count_pp_cannot_share_is_refused():
    from slapo_tune.topology import Topology

    sch = create_schedule(ProblemSpec("gpt2-tiny", 2).resolve().model.build("meta"))
    apply_pipeline_cuts(blocks(sch, "gpt2-tiny"), 3)
    topology = Topology.__new__(Topology)
    topology.__dict__.update(pp=2, tp=1, dp=1, pp_rank=0)
    with pytest.raises(PipelineError, match=r"3 stage\(s\) .* but pp=2 ranks cannot share them"):
        build(sch, topology=topology)


def test_a_structural_copy_shares_tensors_and_keeps_the_schedule():
    """Stages are cut from copies that share the parameters (no memory) and keep what the schedule
    stored on every module, also on traced GraphModules (GPT-2's fused MLP)."""
    problem = ProblemSpec("gpt2-tiny", 1).resolve()
    sch = create_schedule(problem.model.build("meta"))
    problem.template.apply(sch, problem.plan({"fuse": "on", "ckpt_ratio": 1.0}))
    model = sch.mod
    clone = structural_copy(model)
    ours, theirs = dict(model.named_parameters()), dict(clone.named_parameters())
    assert ours.keys() == theirs.keys() and all(ours[n] is theirs[n] for n in ours)
    twins = dict(clone.named_modules())
    traced = [(p, m) for p, m in model.named_modules() if isinstance(m, fx.GraphModule)]
    assert traced
    from_modules = [(p, m.__dict__[TRACED_FROM]) for p, m in traced if TRACED_FROM in m.__dict__]
    assert from_modules  # what the initialiser needs: the module each graph was traced from (GPT2MLP)
    for path, original in from_modules:
        assert type(twins[path].__dict__.get(TRACED_FROM)) is type(original), path
    for path, m in model.named_modules():
        twin = twins[path]
        assert twin is not m
        if state_of(m) is not None:
            assert state_of(twin) is not None and state_of(twin) is not state_of(m), path
            assert state_of(twin).checkpointed == state_of(m).checkpointed, path
            if "forward" in m.__dict__:
                assert twin.__dict__["forward"].module is twin, path


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_every_technique_together_at_world_8(model):
    """tp=2 with sequence parallelism, an interleaved pipeline and ZeRO-3 over the remaining dp=2:
    eight ranks, so outside the default suite (2-4 ranks); run with ``-m slow``."""
    from _template_workers import verify_points

    spec = ProblemSpec(model, 8, global_batch=GLOBAL_BATCH, seq_len=SEQ)
    point = spec.resolve().plan(dict(tp=2, sp="on", pp=2, vpp=2, zero=3, micro_batch=1, ckpt_ratio=0.5,
                                     ckpt_policy="selective", pipeline_schedule="1f1b")).knobs()
    key = (model, format_point(point))
    results = launch(verify_points, 8, args=([(key, spec, point)],), timeout=1200)
    for r in results:
        assert r[key]["ok"] and r[key]["max_grad_error"] < 1e-4, r[key]["report"]
    assert not uncompared(spec.model_spec.build("meta"), [r[key]["compared"] for r in results])
