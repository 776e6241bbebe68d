"""The published-runs benchmark's data and arithmetic (``benchmarks.published_runs``): each run is
cited, self-consistent and built at the size that ran; nothing here predicts anything."""

from __future__ import annotations

import json

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
    NVIDIA's Llama-3 70B, built from the Llama template, at its 70,553,706,496."""
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


def test_megatrons_distributed_optimizer_is_zero_1_on_the_published_layout(runs):
    """NVIDIA's Llama-3 70B rows: TP 4, PP 8, VP 5 on 64 GPUs leaves dp = 2; the distributed optimizer
    (ZeRO-1), sequence parallelism and an interleaved pipeline, a point the Llama template's space holds."""
    nvidia = [r for r in runs if "runtime" in r]
    assert nvidia and all(r["held_out"] for r in nvidia)
    for run in nvidia:
        point = published_point(run)
        assert data_parallel(run) == 2 and point["zero"] == 1 and point["vpp"] == 5 and point["sp"] == "on"
        plan = _spec(run).resolve().plan(point)
        assert (plan["tp"], plan["pp"], plan["dp"], plan["vpp"]) == (4, 8, 2, 5)


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
