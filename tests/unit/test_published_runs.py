"""The published-runs benchmark's data and arithmetic (``benchmarks.published_runs``): each run is
cited, self-consistent and built at the size that ran; nothing here predicts anything."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import benchmarks.published_runs as published_runs
from benchmarks._stats import spearman
from benchmarks.published_runs import _spec, data_parallel, framework_pins, load_runs, published_point


@pytest.fixture(scope="module")
def runs():
    return load_runs()


def test_every_run_is_cited_and_some_are_kept_aside(runs):
    for run in runs:
        source = run["source"]
        assert source["repository"] and source["path"] and len(source["commit"]) == 40 and source["table"], run["id"]
    held = {r["id"] for r in runs if r["held_out"]}
    assert 0 < len(held) < len(runs) and len({r["id"] for r in runs}) == len(runs)


def test_the_built_models_have_the_published_parameter_counts(runs):
    """The stand-in (Hugging Face GPT-2 blocks at MPT's shape) against each table's NumParams: within
    0.2 % (GPT-2's biases, which MPT lacks), at every size and sequence length (learned positions);
    NVIDIA's Llama-3 8B and 70B and Llama-3.1 405B, built from the Llama template, at their
    8,030,261,248, 70,553,706,496 and 405,853,388,800 (Meta's configs: untied heads, vocabulary 128,256)."""
    seen = set()
    for run in runs:
        key = (run["model"]["name"], run["seq_len"])
        if key in seen:
            continue
        seen.add(key)
        model = _spec(run).resolve().model.build("meta")
        count = sum(p.numel() for p in model.parameters())
        assert count == pytest.approx(run["model"]["num_params"], rel=0.002), run["id"]


def test_a_run_whose_batch_does_not_add_up_is_refused(runs, tmp_path):
    bad = dict(runs[0], knobs=dict(runs[0]["knobs"], grad_accum=runs[0]["knobs"]["grad_accum"] + 1))
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"version": 1, "runs": [bad]}))
    with pytest.raises(ValueError, match="global batch"):
        load_runs(path)


def test_full_shard_is_zero_3_and_checkpointing_every_block(runs):
    ckpt = next(r for r in runs if r["knobs"]["activation_checkpointing"])
    point = published_point(ckpt)
    assert point["zero"] == 3 and point["ckpt_ratio"] == 1.0 and point["micro_batch"] == ckpt["knobs"]["micro_batch"]


def test_spearman_is_pearson_over_ranks():
    rng = np.random.default_rng(0)
    xs, ys = rng.random(30), rng.random(30)
    ranks = lambda v: np.argsort(np.argsort(v))  # noqa: E731 - no ties in random floats
    assert spearman(list(xs), list(ys)) == pytest.approx(np.corrcoef(ranks(xs), ranks(ys))[0, 1])
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)  # ties share their average rank
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


# Megatron-Bridge's WorkloadBaseConfig (scripts/performance/utils/utils.py): what a settings entry
# does not name (virtual_pipeline_model_parallel_size None: no interleaving)
MEGATRON_DEFAULTS = {"TP": 1, "PP": 1, "CP": 1, "VP": 1, "MBS": 1}


def test_nvidias_runs_are_planned_as_their_cited_settings_name(runs):
    """Each NVIDIA row, planned by the Llama template, is the layout its cited settings entry names
    (TP, PP, CP, VP, MBS; WorkloadBaseConfig's defaults where unnamed): dp the GPUs over TP x PP x
    CP, sequence parallelism wherever TP > 1 (WorkloadBaseConfig.sequence_parallel), no
    recomputation, the distributed optimizer as ZeRO-1 and Megatron FSDP (its perf scripts'
    data_parallel_sharding_strategy optim_grads_params) as ZeRO-3."""
    nvidia = [r for r in runs if "runtime" in r]
    assert nvidia and all(r["held_out"] for r in nvidia)
    assert {r["model"]["name"] for r in nvidia} >= {"llama3-8b", "llama3-70b"}
    for run in nvidia:
        settings = run["source"]["settings"]
        named = {**MEGATRON_DEFAULTS, **{k: int(v) for k, v in re.findall(r"\b(TP|PP|CP|VP|MBS) (\d+)", settings)}}
        plan = _spec(run).resolve().plan(published_point(run))
        dp = run["gpus"] // (named["TP"] * named["PP"] * named["CP"])
        assert data_parallel(run) == run["layout"]["dp"] == dp, run["id"]
        assert (plan["tp"], plan["pp"], plan["cp"], plan["vpp"], plan["dp"], plan["micro_batch"]) == (
            named["TP"], named["PP"], named["CP"], named["VP"], dp, named["MBS"]), run["id"]
        assert plan["sp"] == ("on" if named["TP"] > 1 else "off") and plan["ckpt_ratio"] == 0.0, run["id"]
        assert plan["zero"] == (3 if "use_megatron_fsdp" in settings else 1), run["id"]
    assert any("use_megatron_fsdp" in r["source"]["settings"] for r in nvidia)


def test_runs_on_a_gpu_no_fitted_run_used_are_summarised_apart(runs):
    """The B200 preset's rates are the H100's share of its datasheet peak, which no fitted run
    checked: its NVIDIA rows get a summary of their own, the H100 ones stay with the others of their
    runtime, and every row is summarised once (and once more among every held-out run on a validated
    GPU)."""
    assert not any(r["hardware_fitted"] for r in runs if r["hardware"] == "b200")
    assert all(r["hardware_fitted"] for r in runs if r["hardware"] == "h100-80gb")
    rows = [{"id": r["id"], "held_out": r["held_out"], "other_runtime": "runtime" in r,
             "hardware_fitted": r["hardware_fitted"]} for r in runs]
    got = {name: {r["id"] for r in group} for name, group in published_runs.groups(rows).items()}
    b200 = {r["id"] for r in runs if r["hardware"] == "b200"}
    assert b200 and got["other_runtime_unvalidated"] == b200
    assert got["other_runtime"] == {r["id"] for r in runs if "runtime" in r and r["hardware"] == "h100-80gb"}
    assert got["fitted"] == {r["id"] for r in runs if not r["held_out"]}
    assert got["all_held_out"] == got["held_out"] | got["other_runtime"]
    assert sum(len(ids) for name, ids in got.items() if name != "all_held_out") == len(runs)


def test_each_published_point_lies_in_its_frameworks_space(runs):
    """The framework spaces the ranking searches hold what the experts ran: every pinned knob has
    the published value, every free one a published value among the framework's choices, and the
    pinned sets are the product of those choices (llm-foundry: 3 ZeRO levels x checkpointing on/off)."""
    for run in runs:
        point, pins = published_point(run), framework_pins(run["framework"])
        assert any(all(point.get(k, v) == v for k, v in pinned.items()) for pinned in pins), run["id"]
        _spec(run).resolve().pinned(next(p for p in pins if all(point.get(k, v) == v for k, v in p.items())))
    foundry = next(r for r in runs if r["source"]["repository"] == "mosaicml/llm-foundry")["framework"]
    pins = framework_pins(foundry)
    assert len(pins) == 6 and {(p["zero"], p["ckpt_ratio"]) for p in pins} == {(z, c) for z in (0, 2, 3) for c in (0.0, 1.0)}
    assert all(p["tp"] == 1 and p["pp"] == 1 for p in pins)


def test_a_run_of_an_undescribed_framework_is_refused(runs, tmp_path):
    path = tmp_path / "runs.json"
    bad = {k: v for k, v in runs[0].items() if k != "framework"}
    path.write_text(json.dumps({"version": 1, "frameworks": {}, "runs": [bad]}))
    with pytest.raises(ValueError, match="no framework described"):
        load_runs(path)


def test_a_miss_note_must_say_something_and_the_report_marks_its_row(runs, tmp_path):
    """A run known to miss the band carries a sentence saying what its prediction lacks (an empty or
    non-string note is refused); the report's table marks the row and lists the note."""
    data = json.loads(published_runs.DATA.read_text())
    path = tmp_path / "runs.json"
    for bad in ("", " ", True):
        path.write_text(json.dumps({**data, "runs": [dict(data["runs"][0], miss=bad)]}))
        with pytest.raises(ValueError, match="miss"):
            load_runs(path)
    row = {"id": "x", "held_out": True, "hardware_fitted": True, "memory": 80 * 2**30, "peak": 2**30, "budget": 2**30,
           "fits": True, "kept": True, "published_tokens": 1.0, "predicted_tokens": 0.5, "ratio": 0.5,
           "published_mfu": 0.4, "predicted_mfu": 0.2, "miss": "the per-block cost is in doubt"}
    lines = published_runs.report_section({"source": "s", "rows": [row, dict(row, id="y", miss=None)]})
    assert any(line.startswith("| x |") and "0.50 (miss [1])" in line for line in lines)
    assert any(line.startswith("| y |") and "miss" not in line for line in lines)
    assert "- [1] x: the per-block cost is in doubt" in lines


def test_the_rank_counts_only_points_predicted_to_fit(monkeypatch):
    """A point that might fit only within the prediction's uncertainty (peak over the budget) does
    not outrank the published configuration, and the first choice is predicted to fit."""
    import slapo_tune.cost_model.ranking as ranking

    rows = [{"point": {"tp": 2}, "fits": True, "peak": 90, "throughput": 30.0},  # over budget 80
            {"point": {"tp": 4}, "fits": True, "peak": 70, "throughput": 12.0},
            {"point": {"tp": 8}, "fits": True, "peak": 60, "throughput": 9.0}]

    class Found:
        points = 3

    found = Found()
    found.rows = rows

    class Problem:
        def pinned(self, pins):
            return self

    monkeypatch.setattr(ranking, "rank_points", lambda *a, **k: found)
    got = published_runs._plan_rank(Problem(), None, 80, 10.0, [{}])
    assert got["rank"] == 2 and got["plan_best"] == {"tp": 4} and got["best_over_published"] == pytest.approx(1.2)
    # slower than every point listed, still within the first 10: its place, not "not listed"
    assert published_runs._plan_rank(Problem(), None, 80, 5.0, [{}])["rank"] == 3


def test_the_one_yardstick_spearman_ranks_published_speeds_at_our_flop_count():
    """Published MFUs that count FLOPs another way can reverse the order of runs the published speeds
    give: at our FLOP count (predicted MFU over the ratio) the ranking follows the speeds."""
    rows = [{"ratio": ratio, "predicted_mfu": mfu, "published_mfu": published, "fits": True, "kept": True}
            for ratio, mfu, published in ((1.0, 0.5, 0.7), (0.5, 0.6, 0.6), (1.0, 0.7, 0.5))]
    got = published_runs.summarise(rows)
    # published at our count: 0.5, 1.2, 0.7 against predicted 0.5, 0.6, 0.7
    assert got["spearman_mfu"] == pytest.approx(-1.0)
    assert got["spearman_mfu_one_count"] == pytest.approx(0.5)


def test_torchtitans_runs_are_planned_as_its_tables_say(runs):
    """torchtitan's "selective layer" checkpoints every second block (ckpt_ratio 0.5), "full" every
    block, "no" none; its runs use PyTorch's own cross-entropy and unfused layers (the framework's
    ``point``), whatever the Llama preset's other runs hold."""
    titan = [r for r in runs if r["source"]["repository"] == "pytorch/torchtitan"]
    share = {"no": 0.0, "selective layer": 0.5, "full": 1.0}
    assert {r["knobs"]["torchtitan_ac"] for r in titan} == set(share)
    for run in titan:
        point = published_point(run)
        assert point["ckpt_ratio"] == share[run["knobs"]["torchtitan_ac"]], run["id"]
        assert (point["loss_parallel"], point["fuse"], point["zero"], point["tp"]) == ("off", "off", 3, 1), run["id"]
    nvidia = next(r for r in runs if r["source"]["repository"] == "NVIDIA-NeMo/Megatron-Bridge")
    assert published_point(nvidia)["fuse"] == "on"  # a framework's point is its own runs' only


# one run of each template the runs use (GPT-2 blocks at MPT's shape; Llama): the layout file's
# entries are measured afresh for these by default, for every run with -m slow (the probe takes
# seconds per model)
_FRESH = ("mpt-760m h100-80gb x8 s2048", "llama3-8b h100-80gb x8 s8192 fp8 gbs128")


def test_every_runs_model_layout_is_shipped_for_this_layout_version_and_torch(runs):
    """The benchmark (and the tests that predict the runs) read each run's model layout from
    benchmarks/data/published_layouts.json; a run missing there, or a file of another layout version
    or torch, would be measured again (minutes over the runs): run --write-layouts."""
    from slapo_tune.cost_model import ModelLayout

    shipped = published_runs._shipped_layouts()
    assert shipped, "published_layouts.json is not of this layout version and torch: run --write-layouts"
    for run in runs:
        problem = _spec(run).resolve()
        assert published_runs._model_key(problem) in shipped, f"{run['id']}: run --write-layouts"
        assert isinstance(published_runs.layout_of_run(problem), ModelLayout)


@pytest.mark.parametrize("field, other", [("layout_version", 1), ("torch", "1.0.0")])
def test_a_layout_file_of_another_layout_version_or_torch_is_not_read(tmp_path, monkeypatch, field, other):
    """What a block keeps is measured by the probe of one layout version under one torch: a file
    written by another is not read (its runs are measured again), a well-formed one is."""
    data = json.loads(published_runs.LAYOUTS.read_text())
    assert data["layouts"]
    monkeypatch.setattr(published_runs, "LAYOUTS", tmp_path / "layouts.json")
    published_runs._shipped_layouts.cache_clear()
    try:
        published_runs.LAYOUTS.write_text(json.dumps(data))
        assert published_runs._shipped_layouts() == data["layouts"]
        published_runs._shipped_layouts.cache_clear()
        published_runs.LAYOUTS.write_text(json.dumps({**data, field: other}))
        assert published_runs._shipped_layouts() == {}
    finally:
        published_runs._shipped_layouts.cache_clear()


def _assert_layout_is_a_fresh_measurement(run: dict) -> None:
    import dataclasses

    from slapo_tune.cost_model._layout import _measure_layout

    problem = _spec(run).resolve()
    fresh = _measure_layout(problem.config, problem.template)
    assert dataclasses.asdict(published_runs.layout_of_run(problem)) == dataclasses.asdict(fresh), (
        f"{run['id']}: run python -m benchmarks.published_runs --write-layouts")


@pytest.mark.parametrize("run_id", _FRESH)
def test_a_shipped_layout_is_what_the_probe_measures_now(runs, run_id):
    _assert_layout_is_a_fresh_measurement(next(r for r in runs if r["id"] == run_id))


@pytest.mark.slow
def test_every_shipped_layout_is_what_the_probe_measures_now(runs):
    seen = set()
    for run in runs:
        key = published_runs._model_key(_spec(run).resolve())
        if key not in seen and run["id"] not in _FRESH:
            seen.add(key)
            _assert_layout_is_a_fresh_measurement(run)
