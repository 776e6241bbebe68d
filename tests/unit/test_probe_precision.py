"""The activation probe measures a block in the precision that runs, and never falls back silently;
the analytic memory model then agrees with exact mode in every precision on real-size blocks.

Exact mode runs the real training step on fake tensors in this process (a real step's peak, byte
for byte on CPU: tests/multirank/test_cost_model.py); the analytic model here is uncalibrated (a private
cache directory, no calibration in it)."""

import dataclasses
import statistics

import pytest

from slapo_tune.cost_model import CostModel, hardware
from slapo_tune.cost_model.analytic import PROBE_PRECISIONS, activation_probe, probe_tp
from slapo_tune.cost_model.cards import preset_card
from slapo_tune.problem import ProblemSpec


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLAPO_TUNE_CACHE", str(tmp_path))  # no calibration, no cached layout


def test_the_probed_tensor_parallel_degree_is_the_smallest_that_divides_a_block():
    degrees = {}
    for name in ("gpt2", "gpt2-xl", "gpt3-175b", "llama-70b"):
        problem = ProblemSpec(name, 1).resolve()
        degrees[name] = probe_tp(problem.config, problem.template)
    assert degrees == {"gpt2": 2, "gpt2-xl": 5, "gpt3-175b": 2, "llama-70b": 2}  # gpt2-xl: 25 heads


def test_gpt2_is_measured_in_every_precision_and_amp_is_not_fp32_halved():
    """GPT-2's vocabulary (50257) is one tensor parallelism cannot split: the probe's copy has its
    own, so the tp=2 block is measured, in every precision, with nothing recorded as a fallback.
    Under bf16 autocast a GPT-2 block saves about 64-70 h bytes per token (fp32 copies kept for
    backward beside the bf16 matmul outputs) and 8 per eager attention score: not fp32's halved."""
    problem = ProblemSpec("gpt2", 1).resolve()
    hidden = problem.config.hidden_size
    tokens, scores, fallbacks = activation_probe(problem.config, problem.template, fusion=False)
    assert fallbacks == []
    assert set(tokens) == set(scores) == set(PROBE_PRECISIONS)
    for precision in PROBE_PRECISIONS:
        assert {"eager/off/rep", "eager/off/par", "sdpa/off/rep", "sdpa/off/par", "seq/off", "sel/rep",
                "sel/par"} <= set(tokens[precision])
        assert tokens[precision]["sdpa/off/par"] > 0  # tensor parallelism divides something measured
    amp, fp32 = tokens["amp-bf16"], tokens["fp32"]
    per_token = {attn: (amp[f"{attn}/off/rep"] + amp[f"{attn}/off/par"]) / hidden for attn in ("eager", "sdpa")}
    assert 60 <= per_token["eager"] <= 72 and 64 <= per_token["sdpa"] <= 76, per_token
    halved = (fp32["sdpa/off/rep"] + fp32["sdpa/off/par"]) / 2 / hidden
    assert per_token["sdpa"] > 1.05 * halved, (per_token, halved)
    assert scores["amp-bf16"]["eager"] == 8 and scores["fp32"]["eager"] == 12
    # the shipped cards of the other presets tp=2 could not split before agree
    for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-large", "gpt3-175b", "gpt-1t"):
        layout = preset_card(name)[1]
        assert layout.probe_fallbacks == [] and set(layout.token_bytes) == set(PROBE_PRECISIONS), name


def test_each_probe_measurement_fails_alone_and_is_recorded(monkeypatch):
    """A tensor-parallel probe that fails leaves the tp=1 counts measured, and says so."""
    from slapo_tune.cost_model import _probe  # where activation_probe reads probe_block

    problem = ProblemSpec("gpt2-tiny", 1).resolve()
    probe_block = _probe.probe_block

    def failing(config, template, point, runs, **kwargs):
        if point["tp"] > 1:
            raise RuntimeError("no fake group today")
        return probe_block(config, template, point, runs, **kwargs)

    monkeypatch.setattr(_probe, "probe_block", failing)
    tokens, scores, fallbacks = activation_probe(problem.config, problem.template, precisions=("fp32",))
    assert tokens["fp32"]["sdpa/off/rep"] > 0 and tokens["fp32"]["sdpa/off/par"] == 0  # measured, kept whole
    assert "fp32" in scores and "sel/rep" in tokens["fp32"]
    assert any(line.startswith("fp32 tp=2") and "RuntimeError: no fake group today" in line for line in fallbacks)
    assert not any("tp=1" in line for line in fallbacks), fallbacks


# (model, config overrides: 2 blocks at real width, sequence length)
MODELS = {
    "gpt3-175b": ({"n_layer": 2}, 2048),
    "llama-70b": ({"num_hidden_layers": 2}, 4096),
    "gpt2-xl": ({"n_layer": 2}, 1024),  # no tensor parallelism: tp must divide its 50257 vocabulary
}
# (model, precision, knobs, micro-batches per step); with 2 blocks, ckpt_ratio 0.25 is one, 0.75 both
POINTS = [
    ("gpt3-175b", "fp32", dict(tp=2, sp="on"), 2),
    ("gpt3-175b", "fp32", dict(tp=2, dp=2, zero=1, ckpt_ratio=0.75), 2),
    ("gpt3-175b", "amp-bf16", dict(), 2),
    ("gpt3-175b", "amp-bf16", dict(tp=2, ckpt_ratio=0.25, ckpt_policy="selective"), 1),
    ("gpt3-175b", "bf16", dict(tp=2, micro_batch=2, attn="eager"), 1),
    ("gpt3-175b", "bf16", dict(tp=2, dp=2, zero=1), 2),
    ("llama-70b", "fp32", dict(), 2),
    ("llama-70b", "fp32", dict(tp=2, ckpt_ratio=0.75, ckpt_policy="selective"), 2),
    ("llama-70b", "amp-bf16", dict(tp=2, sp="on"), 2),
    ("llama-70b", "amp-bf16", dict(tp=2, dp=2, zero=1, ckpt_ratio=0.75), 2),
    ("llama-70b", "bf16", dict(tp=2, micro_batch=2, attn="eager"), 1),
    ("llama-70b", "bf16", dict(dp=2, zero=1), 2),
    ("gpt2-xl", "fp32", dict(micro_batch=2, ckpt_ratio=0.75, ckpt_policy="selective"), 2),
    ("gpt2-xl", "fp32", dict(dp=2, zero=2), 2),
    ("gpt2-xl", "amp-bf16", dict(micro_batch=2, attn="eager"), 2),
    ("gpt2-xl", "amp-bf16", dict(dp=2, zero=2), 2),
    ("gpt2-xl", "bf16", dict(), 1),
    ("gpt2-xl", "bf16", dict(dp=2, zero=1, ckpt_ratio=0.75), 2),
]


def _error(name: str, precision: str, knobs: dict, micro_batches: int) -> float:
    overrides, seq = MODELS[name]
    knobs = {"tp": 1, "dp": 1, "pp": 1, "micro_batch": 1, **knobs}
    problem = ProblemSpec(name, knobs["tp"] * knobs["dp"], model_overrides=overrides, seq_len=seq,
                          global_batch=micro_batches * knobs["dp"] * knobs["micro_batch"], precision=precision).resolve()
    # the preset's measured layout at 2 blocks (blocks are alike: the probe builds copies of 2-3
    # blocks whatever the depth; the cards test checks cards against a fresh measurement)
    layout = dataclasses.replace(preset_card(name)[1], layers=problem.info.layers)
    model = CostModel(problem, hardware("a100-80gb"), layout=layout)
    assert model.backend == "nccl" and model.calibration.source == "default"
    point = problem.plan(knobs).knobs()
    exact = model.exact(point)
    analytic = model.memory(point).per_stage
    return analytic[0] / exact[0].total - 1


@pytest.mark.parametrize("precision", PROBE_PRECISIONS)
def test_analytic_memory_matches_exact_mode_on_real_size_blocks(precision):
    """GPT-3-175B-, Llama-70B- and GPT-2-XL-shaped models (2 blocks at their real widths and
    sequence lengths), two points each in every precision (tp, sp, micro-batches, full and
    selective checkpointing of one or both blocks, eager attention, ZeRO 1-2 with dp=2):
    uncalibrated analytic peaks within 3 % of exact mode's on median, 8 % at most."""
    errors = {(name, str(knobs)): _error(name, precision, knobs, m)
              for name, p, knobs, m in POINTS if p == precision}
    magnitudes = [abs(e) for e in errors.values()]
    assert statistics.median(magnitudes) < 0.03 and max(magnitudes) < 0.08, errors
