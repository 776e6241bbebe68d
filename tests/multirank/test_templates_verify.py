"""Every template turns legal points into schedules that verify against the unscheduled model.

A seeded sample (one point per (tp, pp) layout, per template, at world sizes 1, 2 and 4) runs by
default; ``-m slow`` verifies every legal point.
"""

import random

import pytest

from slapo_tune.launch import launch
from slapo_tune.problem import ProblemSpec
from slapo_tune.space import format_point

from _helpers import glm_config, phi3_config, saved_config, uncompared
from _template_workers import verify_points

TINY = ["gpt2-tiny", "llama-tiny", "bert-tiny", "opt-tiny"]
GLOBAL_BATCH, SEQ = 8, 16


def _spec(model, world, precision="fp32", **overrides) -> ProblemSpec:
    return ProblemSpec(model, world, model_overrides=overrides, global_batch=GLOBAL_BATCH, seq_len=SEQ,
                       precision=precision)


def _points(preset, world, sample):
    spec = _spec(preset, world)
    points = list(spec.resolve().space.enumerate())
    if sample:
        rng = random.Random(f"{preset}-{world}")
        by_layout = {}
        for p in points:
            by_layout.setdefault((p["tp"], p["pp"]), []).append(p)
        points = [rng.choice(group) for _, group in sorted(by_layout.items())]
    return [((preset, format_point(p)), spec, p) for p in points]


def _run(world, cases):
    results = launch(verify_points, world, args=(cases,), timeout=3000)
    failures = []
    for key, spec, *_ in cases:
        for r in results:
            res = r[key]
            if not res["ok"]:
                failures.append(f"{key[0]} {key[1]} rank {res['rank']}:\n{res['report']}")
            elif spec.precision == "fp32":
                assert res["max_grad_error"] < 1e-4 and res["loss_error"] < 1e-4
        if all(r[key]["ok"] for r in results):  # every gradient was compared on some rank
            assert not uncompared(spec.model_spec.build("meta"), [r[key]["compared"] for r in results]), key
    assert not failures, "\n".join(failures[:5])
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sampled_points_of_every_template_verify(world, tmp_path):
    cases = [c for preset in TINY for c in _points(preset, world, sample=True)]
    if world == 2:  # and the generic template on fused projections: Phi-3's (tp=1 only), GLM's gate|up
        phi3 = _points(phi3_config(tmp_path / "phi3"), world, sample=True)
        glm = [c for c in _points(glm_config(tmp_path / "glm"), world, sample=True) if c[2]["tp"] == 2]
        assert {c[2]["tp"] for c in phi3} == {1} and glm
        cases += phi3[:1] + glm  # one of Phi-3's points (pp=1, dp=2) keeps the test short
    layouts = {(c[2]["tp"], c[2]["pp"]) for c in cases}
    assert len(layouts) == {1: 1, 2: 3, 4: 6}[world]
    _run(world, cases)


@pytest.mark.slow
@pytest.mark.parametrize("preset", TINY)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_point_verifies(preset, world):
    _run(world, _points(preset, world, sample=False))


def test_a_block_returning_a_view_runs_under_zero_bubble():
    """OPT's decoder layer returns a view (its output reshaped back with .view()); torch's zero-bubble
    backward detaches stage outputs in place, which a view refuses: the stage hands on a copy."""
    spec = _spec("opt-tiny", 2)
    point = spec.resolve().plan({"pp": 2, "micro_batch": 2, "pipeline_schedule": "zb", "vpp": 2}).knobs()
    _run(2, [(("opt-tiny", format_point(point)), spec, point)])


def test_generic_template_on_an_untemplated_decoder(tmp_path):
    path = _neox_config(tmp_path)
    spec = _spec(path, 4)
    problem = spec.resolve()
    assert problem.template.name == "generic"
    cases = []
    for knobs in ({"tp": 2, "pp": 2}, {"tp": 2, "pp": 2, "ckpt_ratio": 1.0, "pipeline_schedule": "1f1b",
                                        "micro_batch": 2}, {"tp": 4, "attn": "eager"}):
        point = problem.plan(knobs).knobs()
        cases.append(((path, format_point(point)), spec, point))
    results = _run(4, cases)
    assert {r[cases[0][0]]["stage"] for r in results} == {0, 1}


def _neox_config(tmp_path) -> str:
    """An untemplated decoder (GPT-NeoX): the generic template schedules it."""
    return saved_config(tmp_path, "GPTNeoXConfig", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                        intermediate_size=256, vocab_size=512, max_position_embeddings=128, bos_token_id=0,
                        eos_token_id=2, attention_dropout=0.0, hidden_dropout=0.0)


def test_zero_levels_and_bf16_parameters_verify_at_world_4(tmp_path):
    """ZeRO 1, 2 and 3 over dp=4, dp=2 beside tp=2 and dp=2 beside pp=2, in fp32 and in bf16 parameters
    (FSDP's fp32 shards, or fp32 master weights when replicated), on the gpt2, llama and generic
    templates; and autocast under FSDP with several micro-batches: the loss and the gradient the
    optimizer steps every parameter with match the fp32 unscheduled model."""
    neox = _neox_config(tmp_path)
    zero_1, tp_zero_2, pp_zero_3 = ({"tp": 1, "pp": 1, "zero": 1, "micro_batch": 1},
                                    {"tp": 2, "pp": 1, "zero": 2, "micro_batch": 2},
                                    {"tp": 1, "pp": 2, "zero": 3, "micro_batch": 1, "ckpt_ratio": 0.5})
    replicated, tp_pp = {"tp": 1, "pp": 1, "zero": 0, "micro_batch": 1}, {"tp": 2, "pp": 2, "micro_batch": 1}
    plans = {"fp32": [zero_1, tp_zero_2, pp_zero_3], "bf16": [tp_zero_2, pp_zero_3, replicated, tp_pp]}
    cases = []
    for model in ("gpt2-tiny", "llama-tiny", neox):
        for precision, layouts in plans.items():
            spec = _spec(model, 4, precision)
            for knobs in layouts:
                point = spec.resolve().plan(knobs).knobs()
                cases.append(((f"{model} {precision}", format_point(point)), spec, point))
    amp = _spec("llama-tiny", 4, "amp-bf16")
    point = amp.resolve().plan({"tp": 1, "pp": 1, "zero": 3, "micro_batch": 1}).knobs()
    cases.append((("llama-tiny amp-bf16", format_point(point)), amp, point))
    results = _run(4, cases)
    errors = {p: [r[key]["max_grad_error"] for r in results for key, spec, _ in cases if spec.precision == p]
              for p in ("fp32", "bf16", "amp-bf16")}
    # 16-bit rounding shows (the check does not compare fp32 with itself), far below a schedule fault
    assert max(errors["fp32"]) < 1e-4 < min(errors["bf16"] + errors["amp-bf16"])
    assert max(errors["bf16"] + errors["amp-bf16"]) < 0.1


def test_data_parallel_averages_every_full_gradient_bucket():
    """Replicated data parallelism averages gradients through 32 MiB buckets: a GPT-2 widened to
    hidden 768 has ~116 MB of them, so three full buckets and a partial one cross the wire."""
    from slapo_tune.parallel._data_parallel import _BUCKET_BYTES

    spec = _spec("gpt2-tiny", 2, n_embd=768)
    assert sum(p.numel() for p in spec.model_spec.build("meta").parameters()) * 4 > 3 * _BUCKET_BYTES
    point = spec.resolve().plan({"tp": 1, "pp": 1, "zero": 0}).knobs()
    assert point["dp"] == 2
    _run(2, [(("gpt2-tiny n_embd=768", format_point(point)), spec, point)])
