"""Knob API and the templates' spaces: legal points only, enumerated and counted, Optuna-ready."""

import json
import random
import warnings

import optuna
import pytest

from search_spaces import TEMPLATES, load_template, template_for
from slapo_tune import UsageError
from slapo_tune.models import load_config
from slapo_tune.plan import Workload, accumulation
from slapo_tune.space import (
    Knob,
    Space,
    coerce,
    format_point,
    met_first,
    natural_order,
    parse_knobs,
    point_json,
)
from slapo_tune.template import ModelInfo

TINY = {"gpt2": "gpt2-tiny", "llama": "llama-tiny", "bert": "bert-tiny", "opt": "opt-tiny"}


def _space(preset, world, global_batch=8, template=None):
    config = load_config(preset)
    tpl = load_template(template) if template else template_for(config)
    return tpl, ModelInfo.from_config(config), tpl.space(ModelInfo.from_config(config), Workload(world, global_batch, 16))


def _check_invariants(point, info, world, global_batch):
    tp, pp, dp, cp = point["tp"], point["pp"], point["dp"], point["cp"]
    assert tp * cp * pp * dp == world
    assert all(d % tp == 0 for d in (info.heads, info.kv_heads, info.vocab, info.intermediate))
    assert info.layers % pp == 0
    assert global_batch % (dp * point["micro_batch"]) == 0
    accum = accumulation(Workload(world, global_batch), point["dp"], point["micro_batch"])
    assert dp * point["micro_batch"] * accum == global_batch  # the global batch is held fixed
    if point["pipeline_schedule"] == "1f1b" and pp > 1:
        assert accum >= pp
    if pp == 1:
        assert point["pipeline_schedule"] == "1f1b"  # no duplicate gpipe points without a pipeline
    if dp == 1:
        assert point["zero"] == 0


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_legal_point_is_enumerated_and_legal(family, world):
    _, info, space = _space(TINY[family], world)
    points = list(space.enumerate())
    assert len(points) == space.count() > 0
    assert len({format_point(p) for p in points}) == len(points)  # no duplicates
    for p in points:
        _check_invariants(p, info, world, 8)
    layouts = {(p["tp"], p["pp"]) for p in points if p["cp"] == 1}
    expected = {(t, s) for t in (1, 2, 4) for s in (1, 2, 4) if t * s <= world and world % (t * s) == 0}
    assert layouts == expected  # tiny presets: every factorisation of 1, 2 and 4 is legal
    assert {p["fuse"] for p in points} == {"off", "on"} and {p["attn"] for p in points} == {"sdpa", "eager"}


def test_domains_depend_on_earlier_knobs():
    _, _, space = _space("gpt2-tiny", 4)
    assert space.legal_values("pp", {"tp": 4}) == [1]
    assert space.legal_values("pp", {"tp": 1}) == [1, 2, 4]
    dp2 = {"tp": 2, "pp": 1, "cp": 1, "sp": "off", "dp": 2}
    assert space.legal_values("zero", dp2) == [0, 1, 2, 3]
    assert space.legal_values("micro_batch", {**dp2, "zero": 0}) == [1, 2, 4]  # divisors of 8 / dp
    pipe = {"tp": 1, "pp": 4, "cp": 1, "sp": "off", "dp": 1, "zero": 0, "micro_batch": 4, "ckpt_ratio": 0.0, "ckpt_policy": "full"}
    assert space.legal_values("pipeline_schedule", pipe) == ["gpipe"]  # 2 micro-batches < 4 stages


def test_text_and_json_forms_are_stable():
    _, _, space = _space("llama-tiny", 2)
    point = space.complete({"tp": 2, "ckpt_ratio": 0.5})
    text = format_point(point)
    assert text == ("tp=2,pp=1,cp=1,sp=off,dp=1,zero=0,micro_batch=1,ckpt_ratio=0.5,ckpt_policy=full,"
                    "pipeline_schedule=1f1b,vpp=1,loss_parallel=off,attn=sdpa,fuse=off")
    assert json.loads(point_json(point)) == point and list(json.loads(point_json(point))) == space.names
    again = space.complete(coerce(space, parse_knobs(text)))
    assert again == point


def test_bad_knobs_are_usage_errors_naming_legal_values():
    _, _, space = _space("gpt2-tiny", 4)
    with pytest.raises(UsageError, match=r"unknown knob 'tpp' \(knobs: tp, pp, cp, sp, dp"):
        space.complete({"tpp": 1})
    with pytest.raises(UsageError, match="knob 'tp' is given twice"):
        parse_knobs("tp=2,pp=1,tp=4")
    with pytest.raises(UsageError, match=r"tp=3 is not legal for this model and world; legal values: 1, 2, 4"):
        space.complete({"tp": 3})
    with pytest.raises(UsageError, match=r"pp=4 is not legal .* with tp=2; legal values: 1, 2"):
        space.complete({"tp": 2, "pp": 4})
    with pytest.raises(UsageError, match=r"dp=3 is not legal .* legal values: 4"):
        space.complete({"dp": 3})
    with pytest.raises(UsageError, match="not a valid float"):
        coerce(space, {"ckpt_ratio": "half"})


def test_unpinned_knobs_take_values_that_keep_the_pinned_ones_legal():
    """``vpp=2`` alone: the schedule left unpinned is one that interleaves (1F1B), not the first
    schedule (GPipe), where vpp=2 is illegal; every other knob as the plain completion gives it. A
    value no completion makes legal is still refused naming its legal values. Ground truth: the
    space's own enumeration (the first legal point holding the pinned values)."""
    _, _, space = _space("gpt2-tiny", 4)
    pinned = {"pp": 2, "vpp": 2, "micro_batch": 2}
    point = space.complete(pinned)
    assert point["vpp"] == 2 and point["pipeline_schedule"] != "gpipe"
    first = next(p for p in space.enumerate() if all(p[k] == v for k, v in pinned.items()))
    assert point == first
    assert space.complete({"pp": 2}) == space.complete({"pp": 2, "pipeline_schedule": "gpipe"})  # fast path
    with pytest.raises(UsageError, match=r"vpp=3 is not legal .* legal values: 1"):
        space.complete({"pp": 2, "vpp": 3})


class _RecordingTrial:
    """Stands in for an Optuna trial asked through LegalDomains: picks a legal value by a seeded
    rule and records every name and the choices it was offered."""

    def __init__(self, space, seed, seen):
        self.space, self.rng, self.seen, self.params = space, random.Random(seed), seen, {}

    def suggest_categorical(self, name, choices):
        assert self.seen.setdefault(name, list(choices)) == list(choices), f"{name}: choices changed"
        self.params[name] = self.rng.choice(self.space.legal_given(name, self.params))
        return self.params[name]


def test_suggest_only_yields_legal_points_with_one_parameter_per_knob():
    _, _, space = _space("opt-tiny", 4)
    legal = {format_point(p) for p in space.enumerate()}
    seen: dict = {}
    suggested = {format_point(space.suggest(_RecordingTrial(space, seed, seen))) for seed in range(300)}
    assert suggested <= legal and len(suggested) > 150  # of 300 draws (collisions expected)
    assert list(seen) == [k.name for k in space.free]  # one parameter per knob, named as the knob
    domains = {n: set(vs) for n, vs in space.domains().items()}
    assert all(set(choices) == domains[name] for name, choices in seen.items())


def test_optuna_samplers_see_only_legal_points():
    from slapo_tune.search._samplers import LegalDomains

    _, _, space = _space("llama-tiny", 4)
    legal = {format_point(p) for p in space.enumerate()}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for sampler in (optuna.samplers.RandomSampler(seed=0), optuna.samplers.TPESampler(seed=0)):
        study = optuna.create_study(sampler=LegalDomains(sampler, space))
        study.optimize(lambda t: float(space.suggest(t)["micro_batch"]), n_trials=40)
        for trial in study.trials:
            point = space.point_from_params(trial.params)
            assert format_point(point) in legal
            assert space.params_of(point) == trial.params
        assert {n for t in study.trials for n in t.params} == {k.name for k in space.free}
        assert len({format_point(space.point_from_params(t.params)) for t in study.trials}) > 10


def test_a_knobs_domain_is_in_natural_order():
    """Numbers ascending whatever order the points list them in (the report's axes, the
    dashboard's choices); names as first met."""
    space = Space([Knob("a", [1, 2]), Knob("r", lambda p: [1.0, 0.25] if p["a"] == 1 else [0.5, 0.0], ("a",)),
                   Knob("s", ["on", "off"], kind=str)])
    assert space.domain("r") == [0.0, 0.25, 0.5, 1.0]
    assert space.domain("s") == ["on", "off"]


def test_custom_knobs_and_constraints():
    space = Space(
        [Knob("a", [1, 2, 3]), Knob("b", lambda p: range(p["a"]), ("a",)), Knob("c", derive=lambda p: p["a"] + p["b"])],
        constraints=[lambda p: "too big" if p["c"] > 3 else None],
    )
    assert [format_point(p) for p in space.enumerate()] == [
        "a=1,b=0,c=1", "a=2,b=0,c=2", "a=2,b=1,c=3", "a=3,b=0,c=3"]
    assert space.count() == 4
    assert space.legal_values("b", {"a": 3}) == [0]  # b=1, 2 have no legal completion


@pytest.mark.parametrize("preset,world", [("llama-7b", 64), ("llama-70b", 64), ("gpt2-xl", 64), ("bert-large", 64), ("opt-6.7b", 64)])
def test_real_size_spaces_are_counted(preset, world):
    tpl, info, space = _space(preset, world, global_batch=8 * world)
    n = space.count()
    assert n > 1000
    tps = set(space.legal_values("tp", {}))
    assert tps == {t for t in (1, 2, 4, 8, 16, 32, 64) if all(d % t == 0 for d in tpl.tp_divides(info))}


def test_template_selection_and_loading(tmp_path):
    assert template_for(load_config("gpt2-tiny")).name == "gpt2"
    assert template_for(load_config("mistral-7b")).name == "llama"
    assert template_for(load_config("qwen2-7b")).name == "llama"
    assert set(TEMPLATES) == {"gpt2", "llama", "bert", "opt", "generic"}
    assert load_template("search_spaces.opt:TEMPLATE") is TEMPLATES["opt"]
    assert load_template("search_spaces.bert").name == "bert"
    mine = tmp_path / "my_template.py"
    mine.write_text("from search_spaces.llama import LlamaTemplate\n\n"
                    "class Mine(LlamaTemplate):\n    name = 'mine'\n")
    assert load_template(str(mine)).name == "mine"
    with pytest.raises(UsageError, match="unknown space/template 'llamma'"):
        load_template("llamma")
    with pytest.raises(UsageError, match="does not exist"):
        load_template(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UsageError, match="cannot load template file .*RuntimeError: boom"):
        load_template(str(broken))


def test_a_template_overriding_the_old_plan_name_is_sharded_by_its_override_with_a_deprecation_warning():
    """``Template.plan`` was renamed ``tensor_parallel_plan`` ("plan" names the resolved point and the
    command); a user's template that overrides the old name keeps its plan for one release."""
    from search_spaces.llama import TP_PLAN, LlamaTemplate

    with pytest.warns(DeprecationWarning, match="renamed tensor_parallel_plan"):
        class Old(LlamaTemplate):
            def plan(self, model, fused=False):  # the old name, calling the base's through super()
                return {**super().plan(model, fused), "model.extra": "mine"}

    old = Old()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, where the class is defined, not per call
        unfused, fused = old.tensor_parallel_plan(None), old.tensor_parallel_plan(None, fused=True)
    # what build applies is the override, on top of the base's plan (the class attribute, unfused)
    assert unfused == {**TP_PLAN, "model.extra": "mine"}
    assert "model.layers.*.self_attn.qkv_proj" in fused and "model.layers.*.self_attn.q_proj" not in fused
    assert fused["model.extra"] == "mine"
    # callers of the old name on a current template get the plan, and the new name to call
    with pytest.warns(DeprecationWarning, match="tensor_parallel_plan"):
        assert LlamaTemplate().plan(None) == dict(TP_PLAN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class New(LlamaTemplate):  # the new name: no warning
            def tensor_parallel_plan(self, model, fused=False):
                return {}

    assert New().tensor_parallel_plan(None) == {}


def test_pinned_space_is_the_points_with_those_values():
    """``tune --knobs``: the pinned space lists exactly the full space's points with the pinned
    values (a pin legal only beside other choices, vpp=2 needs pp>1, included); a derived knob pins
    by a constraint; an unknown knob or a value legal nowhere is a usage error naming the legal values."""
    from slapo_tune.problem import ProblemSpec
    from slapo_tune.search._samplers import LegalDomains

    problem = ProblemSpec("gpt2-tiny", 4, global_batch=16, seq_len=64).resolve()
    full = list(problem.space.enumerate())
    for pins in ({"tp": 2}, {"vpp": 2}, {"dp": 2, "zero": 3}, {"tp": 2, "sp": "on", "ckpt_policy": "selective"}):
        pinned = problem.pinned(",".join(f"{k}={v}" for k, v in pins.items()))
        expected = [p for p in full if all(p[k] == v for k, v in pins.items())]
        assert expected and list(pinned.space.enumerate()) == expected, pins
        sampler = LegalDomains(optuna.samplers.RandomSampler(seed=0), pinned.space)
        point = pinned.space.suggest(optuna.create_study(sampler=sampler).ask())
        assert all(point[k] == v for k, v in pins.items())
    assert problem.pinned("").space is problem.space
    with pytest.raises(UsageError, match="tp=3 is not legal for this model and world; legal values: 1, 2, 4"):
        problem.pinned("tp=3")
    with pytest.raises(UsageError, match="unknown knob 'speed'"):
        problem.pinned({"speed": "max"})


def _vpp_offered(info, pp, schedule="1f1b", global_batch=None):
    """The vpp values the template offers at ``pp`` (world pp: dp 1, one sample per micro-batch)."""
    tpl = template_for(load_config("llama-tiny"))
    workload = Workload(pp, global_batch or 2 * pp, 16)
    prefix = dict(tp=1, pp=pp, cp=1, sp="off", zero=0, micro_batch=1, ckpt_ratio=0.0, ckpt_policy="full",
                  pipeline_schedule=schedule)
    return tpl.space(info, workload).legal_given("vpp", prefix)


def test_vpp_offers_equal_chunks_and_megatrons_split_with_the_ends_one_block_short():
    """Beside ``pp * vpp`` dividing the blocks, the space offers Megatron-LM's interleaved split
    that counts the embedding and the loss as a layer each (account_for_embedding/loss_in_pipeline_split):
    ``pp * vpp`` divides the blocks + 2 (at most the blocks). Ground truth: those two rules by brute
    force over every v, and the cut the builder makes of each offered v (stage_block_counts): equal
    chunks, or chunks of (blocks + 2) / (pp vpp) with one block fewer on the first and the last."""
    from dataclasses import replace

    from slapo_tune._partition import rank_block_counts, stage_block_counts

    base = ModelInfo.from_config(load_config("llama-tiny"))
    for layers in range(2, 31):
        info = replace(base, layers=layers)
        for pp in range(2, layers + 1):
            offered = _vpp_offered(info, pp)
            equal = {v for v in range(2, layers + 1) if layers % (pp * v) == 0}
            short = {v for v in range(2, layers + 1) if (layers + 2) % (pp * v) == 0 and pp * v <= layers}
            assert offered == [1, *sorted(equal | short)], (layers, pp, offered)
            for v in short:
                c = (layers + 2) // (pp * v)
                assert stage_block_counts(layers, pp * v) == [c - 1] + [c] * (pp * v - 2) + [c - 1], (layers, pp, v)
            for v in offered:  # the time model's slowest rank: ceil(blocks / pp) blocks
                assert max(rank_block_counts(layers, pp, v)) == -(-layers // pp), (layers, pp, v)
            # zero bubble keeps equal chunks only; GPipe never interleaves
            assert _vpp_offered(info, pp, "zb") == sorted(equal), (layers, pp)
            assert _vpp_offered(info, pp, "gpipe") == [1]
    # Llama-3.1 405B (126 blocks) at PP 8: NVIDIA's VP 8 cuts [1, 2 x 62, 1]; v = 16 would leave the ends empty
    llama405 = replace(base, layers=126)
    assert _vpp_offered(llama405, 8) == [1, 2, 4, 8]
    assert stage_block_counts(126, 64) == [1] + [2] * 62 + [1]
    # 6 blocks at pp=2: v=2 ([1, 2, 2, 1]) and v=3 (equal); v=4 would need 8 blocks
    assert _vpp_offered(replace(base, layers=6), 2) == [1, 2, 3]
    # the micro-batches still decide: 9 over pp=4 are not whole rounds (14 blocks: v=2 by the new rule)
    assert _vpp_offered(replace(base, layers=14), 4) == [1, 2]
    assert _vpp_offered(replace(base, layers=14), 4, global_batch=9) == [1]


def _odd_space() -> Space:
    """A space whose domains read knobs they do not declare, values equal but of two types (whose
    branches differ: ``f`` keeps the type), and a constraint that reads a late knob: what a branch
    reads differs from branch to branch."""
    return Space([Knob("a", [1, 2, 3, 4]), Knob("b", lambda p: [1, 1.0, 2] if p["a"] % 2 else [1, 2.0, 3]),
                  Knob("c", lambda p: range(int(p["a"] * p["b"]) % 3 + 1)), Knob("d", derive=lambda p: p["a"] > 2),
                  Knob("e", lambda p: ["x", "y"] if p["d"] else ["y"]), Knob("f", lambda p: [p["b"] * 2])],
                 constraints=[lambda p: "odd" if p["c"] == 1 and p["e"] == "x" else None])


@pytest.mark.parametrize("case", ["gpt2-tiny w4", "llama-tiny w8", "bert-tiny w2", "opt-tiny w16", "pinned", "odd"])
def test_first_met_is_what_a_walk_of_every_point_meets(case):
    """Space.first_met sums up branches by the values they read (not every point walked), yet gives
    what a walk of every point meets first, in order, and their count; the domains follow from it
    (the same values, in the same order, as a walk of every point finds)."""
    if case == "odd":
        space = _odd_space()
    elif case == "pinned":
        space = _space("llama-tiny", 8)[2].pinned({"tp": 2, "zero": 3})
    else:
        preset, world = case.split(" w")
        space = _space(f"{preset}", int(world), global_batch=16)[2]
    points = list(space.enumerate())
    met, count = space.first_met()
    assert (met, count) == (met_first(points), len(points))  # every point walked
    assert len(met) > 3 and any(len(pairs) > 1 for pairs in met[1:])
    domains = {n: [] for n in space.names}
    for p in points:
        for n, v in p.items():
            if v not in domains[n]:
                domains[n].append(v)
    assert space.domains() == {n: natural_order(v) for n, v in domains.items()}


@pytest.mark.parametrize("case", ["gpt2-tiny w4", "llama-tiny w8", "odd"])
def test_differing_lists_the_points_that_change_so_many_knobs(case):
    """Space.differing walks only the points within so many changed knobs of a point, yet lists
    exactly those that change that many of its knobs (a knob it lacks never counts), in the
    space's order."""
    if case == "odd":
        space, reference = _odd_space(), {"a": 3, "b": 2, "e": "y", "f": 4}
    else:
        preset, world = case.split(" w")
        space = _space(preset, int(world), global_batch=16)[2]
        reference = space.complete({"tp": 1, "pp": 1, "ckpt_ratio": 1.0, "micro_batch": 1})
    points = list(space.enumerate())
    found = 0
    for changes in range(len(reference) + 2):
        expected = [p for p in points if sum(p[k] != v for k, v in reference.items()) == changes]
        assert list(space.differing(reference, changes)) == expected, changes
        found += len(expected)
    assert found == len(points)
