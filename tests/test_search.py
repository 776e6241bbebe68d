"""Search strategies replayed on a recorded grid of measured trials (no training runs here):
TPE and the cost-model ranking reach 3 % of the grid's optimum within 20 % of its feasible
points; no point is launched twice; pruned points are never launched; the frontier walk never
launches a point that a known out-of-memory result already rules out."""

from __future__ import annotations

import pytest

from benchmarks.search_strategies import load_grid, replay_tuner, search, trials_to_within


@pytest.fixture(scope="module")
def grid():
    results, budget = load_grid()
    feasible = [r for r in results if r.status == "ok"]
    return results, budget, max(r.samples_per_s for r in feasible), max(1, int(0.2 * len(feasible)))


@pytest.mark.parametrize("strategy,seed", [("model", 0), ("tpe", 0)])  # the spread over seeds: benchmarks.search_strategies
def test_reaches_3_percent_of_the_optimum_within_20_percent_of_the_grid(grid, strategy, seed):
    results, budget, optimum, limit = grid
    launched, _ = search(strategy, seed, "analytic", results, budget, trials=limit)
    found = trials_to_within(launched, optimum)
    assert found is not None and found <= limit, (found, limit)


@pytest.mark.parametrize("strategy", ["tpe", "random", "grid", "frontier", "model"])
def test_no_point_twice_and_pruned_points_never_launched(grid, strategy):
    results, budget, _, _ = grid
    tuner, runner = replay_tuner(strategy, 0, "analytic", results, budget, trials=30)
    summary = tuner.run()
    keys = [tuple(sorted(p.items())) for p in runner.launched]
    assert len(keys) == len(set(keys)) == summary["launched"] == 30
    pruned = [t.user_attrs["point"] for t in tuner.study.trials if t.user_attrs.get("status") == "pruned"]
    assert not {tuple(sorted(p.items())) for p in pruned} & set(keys)
    for p in pruned:
        assert not tuner.cost.verdict(p, budget).fits


def test_frontier_skips_points_an_oom_rules_out(grid):
    results, budget, _, _ = grid
    tuner, runner = replay_tuner("frontier", 0, "none", results, budget, trials=40)
    tuner.run()
    by_key = {tuple(sorted(r.knobs.items())): r.status for r in results}
    ooms = []
    for p in runner.launched:
        group = {k: v for k, v in p.items() if k not in ("micro_batch", "ckpt_ratio")}
        for q in ooms:
            same = {k: v for k, v in q.items() if k not in ("micro_batch", "ckpt_ratio")} == group
            assert not (same and q["micro_batch"] <= p["micro_batch"] and q["ckpt_ratio"] >= p["ckpt_ratio"]), (p, q)
        if by_key[tuple(sorted(p.items()))] == "oom":
            ooms.append(p)
    assert ooms  # the walk did meet the frontier


def test_recorded_exhaustive_search_is_the_headline_workloads_fitting_points():
    import csv

    from benchmarks.headline import BUDGET, EXHAUSTIVE, GLOBAL_BATCH, GPT2_REF, SEQ, exhaustive_best
    from search_spaces import template_for
    from slapo_tune.realize import ModelSpec
    from slapo_tune.template import ModelInfo, Workload

    config = ModelSpec(GPT2_REF[0], dict(GPT2_REF[1])).config()
    space = template_for(config).space(ModelInfo.from_config(config), Workload(1, GLOBAL_BATCH, SEQ))
    with open(EXHAUSTIVE["gpt2-ref w1"]) as f:
        rows = list(csv.DictReader(f))
    legal = {tuple(str(p[k]) for k in space.names) for p in space.enumerate()}
    assert rows and all(tuple(r[k] for k in space.names) in legal for r in rows)
    assert all(int(r["peak"]) <= BUDGET for r in rows)
    best = exhaustive_best("gpt2-ref w1", space)
    fastest = sorted(rows, key=lambda r: float(r["step_s"]))[:len(best)]
    assert len(best) == 3 and [tuple(str(p[k]) for k in space.names) for p in best] == \
        [tuple(r[k] for k in space.names) for r in fastest]
    assert exhaustive_best("llama-ref w4", space) == []
