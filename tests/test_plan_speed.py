"""``plan`` evaluates less than every point fully (layouts pruned whole, stage-by-stage verdicts,
points evaluated together, full rows for the shown ones only): its output must be what evaluating
every point fully gives. The speed check is tests/test_cost_model.py::test_plan_llama70b_on_64_gpus."""

from __future__ import annotations

import argparse
import functools
import json

import pytest

from slapo_tune.cli import main
from slapo_tune.cli._common import device_of, hardware_of, problem_spec
from slapo_tune.cli.plan import CLUSTER_HARDWARE, add_arguments
from slapo_tune.cost_model import CostModel
from slapo_tune.cost_model.cards import preset_card
from slapo_tune.precision import default_precision
from slapo_tune.space import format_point
from slapo_tune.units import format_size, parse_size

MODEL, WORLD = "llama-7b", "4"  # 11k points; at 24 GiB some layouts' model states alone cannot fit


@functools.lru_cache(maxsize=1)
def _evaluated():
    """The cost model as ``plan`` builds it, and every point's memory prediction (budget-free)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", MODEL, "--world-size", WORLD, "--memory-budget", "80GiB"])
    setup = device_of("cuda", here=False)
    hw, _ = hardware_of(args, setup, fallback=CLUSTER_HARDWARE)
    config, layout = preset_card(MODEL)
    problem = problem_spec(args, precision=default_precision(setup.kind), memory_budget=80 * 2**30).resolve(config)
    model = CostModel(problem, hw, layout=layout)
    return model, [(point, model.memory(point)) for point in problem.plans()]


def _reference(budget: int, top: int) -> dict:
    """The old algorithm: every point's memory, verdict and (where it fits) time, then a sort."""
    model, evaluated = _evaluated()
    rows, pruned = [], []
    for point, mem in evaluated:
        verdict = model.verdict(point, budget, prediction=mem)
        timing = model.time(point) if verdict.fits else None
        row = {"point": point.knobs(), "peak": mem.peak, "upper": mem.upper, "stage": mem.worst_stage,
               "breakdown": mem.breakdown, "step_s": timing.step if timing else None,
               "throughput": timing.throughput(model.workload) if timing else None, "fits": verdict.fits,
               "reason": verdict.reason}
        (rows if verdict.fits else pruned).append(row)
    rows.sort(key=lambda r: (r["peak"] > budget, -r["throughput"]))
    return {"points": len(evaluated), "feasible": len(rows), "pruned": len(pruned), "top": rows[:top],
            "pruned_examples": pruned[:top], "smallest": sorted(pruned, key=lambda r: r["peak"])}


def _layouts_pruned_whole(budget: int) -> int:
    model, evaluated = _evaluated()
    keep = 1 - model.calibration.uncertainty
    floors = {}
    for point, _ in evaluated:
        floors.setdefault((point["tp"], point["pp"], point["dp"], point["zero"]), model.layout_floor(point))
    return sum(int(f * keep) > budget for f in floors.values())


def test_layout_floor_is_below_every_points_peak():
    model, evaluated = _evaluated()
    floors = {}
    for point, mem in evaluated:
        layout = (point["tp"], point["pp"], point["dp"], point["zero"])
        floor = floors.setdefault(layout, model.layout_floor(point))
        assert 0 < floor <= mem.peak, (point.short, floor, mem.peak)


@pytest.mark.parametrize("budget, top", [("24GiB", 3), ("32GiB", 5)])
def test_plan_json_equals_evaluating_every_point(capsys, budget, top):
    limit = parse_size(budget)
    assert _layouts_pruned_whole(limit) > 0  # the layout pruning is exercised
    code = main(["plan", "--model", MODEL, "--world-size", WORLD, "--memory-budget", budget, "--top", str(top),
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    expected = json.loads(json.dumps(_reference(limit, top), default=str))
    assert data["pruned"] > 0 and data["feasible"] > 0
    for key in ("points", "feasible", "pruned", "top", "pruned_examples"):
        assert data[key] == expected[key], key


def test_plan_text_lists_the_smallest_pruned_peaks(capsys):
    budget = parse_size("24GiB")
    assert main(["plan", "--model", MODEL, "--world-size", WORLD, "--memory-budget", "24GiB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    expected = _reference(budget, 3)
    tail = out.split(f"pruned {expected['pruned']} point(s), for example:\n")[1].splitlines()
    assert tail == [f"  {format_point(r['point'])}: {r['reason']}" for r in expected["smallest"][:3]]
    assert f"{expected['points']} point(s), {expected['feasible']} fit, {expected['pruned']} pruned" in out


def test_plan_with_nothing_fitting_names_the_smallest_peak(capsys):
    budget = parse_size("16GiB")
    assert _layouts_pruned_whole(budget) == len({(p["tp"], p["pp"], p["dp"], p["zero"]) for p, _ in _evaluated()[1]})
    assert main(["plan", "--model", MODEL, "--world-size", WORLD, "--memory-budget", "16GiB", "--json"]) != 0
    smallest = _reference(budget, 3)["smallest"][0]
    err = capsys.readouterr().err
    assert (f"smallest predicted peak is {format_size(smallest['peak'])} at {format_point(smallest['point'])}"
            in err)
