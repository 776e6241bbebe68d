"""``plan`` evaluates less than every point fully (layouts pruned whole, stage-by-stage verdicts,
points evaluated together, full rows for the shown ones only): its output must be what evaluating
every point fully gives. The speed check is tests/multirank/test_cost_model.py::test_plan_llama70b_on_64_gpus."""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np
import pytest

from slapo_tune.cli import main
from slapo_tune.cli._common import device_of, hardware_of, problem_spec
from slapo_tune.cli.plan import CLUSTER_HARDWARE, add_arguments
from slapo_tune.cost_model import CostModel
from slapo_tune.cost_model.analytic import rank_blocks
from slapo_tune.cost_model.cards import preset_card
from slapo_tune.plan import readable
from slapo_tune.precision import default_precision
from slapo_tune.space import format_point
from slapo_tune.units import format_size, parse_size

MODEL = "llama-7b"  # 28k points; at 24 GiB some layouts' model states alone cannot fit
# the workload's sizes given (their defaults are the CLI's business)
WORLD = ["--world-size", "4", "--seq-len", "128", "--global-batch", "32"]


# GPT-2 (a tied head, fusion, trailing knobs of two values each), amp-bf16 (autocast's weight
# copies): 35k points; at 6 GiB some layouts' model states alone cannot fit, and most groups' floors
# (CostModel.group_floor) prune them unevaluated
GPT2 = ("gpt2-xl", ("--world-size", "8", "--seq-len", "512", "--global-batch", "16", "--precision", "amp-bf16"))


# GPT-2's 12 blocks over 8 ranks: pp=8 cuts them unevenly (1, 1, 2, 2, 2, 2, 1, 1; of 18k points)
GPT2_UNEVEN = ("gpt2", ("--world-size", "8", "--seq-len", "512", "--global-batch", "16", "--precision", "amp-bf16"))


@functools.cache  # every case kept: the tests take the cases in turn, and each costs 6-16 s
def _evaluated(model_name: str = MODEL, workload: tuple[str, ...] = tuple(WORLD)):
    """The cost model as ``plan`` builds it, and every point's memory prediction (budget-free)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", model_name, *workload, "--memory-budget", "80GiB"])
    setup = device_of("cuda", here=False)
    hw, _ = hardware_of(args, setup, fallback=CLUSTER_HARDWARE)
    config, layout = preset_card(model_name)
    problem = problem_spec(args, precision=args.precision or default_precision(setup.kind),
                           memory_budget=80 * 2**30).resolve(config)
    model = CostModel(problem, hw, layout=layout)
    return model, [(point, model.memory(point)) for point in problem.plans()]


@functools.cache
def _timing(index: int, *case):
    """Point ``index``'s step time (:meth:`CostModel.time`: the budget does not change it)."""
    model, evaluated = _evaluated(*case)
    return model.time(evaluated[index][0])


@functools.cache  # (callers copy what they change)
def _reference(budget: int, top: int, *case) -> dict:
    """The old algorithm: every point's memory, verdict and (where it fits) time, then a sort."""
    model, evaluated = _evaluated(*case)
    rows, pruned = [], []
    for index, (point, mem) in enumerate(evaluated):
        verdict = model.verdict(point, budget, prediction=mem)
        timing = _timing(index, *case) if verdict.fits else None
        row = {"point": point.knobs(), "peak": mem.peak, "upper": mem.upper, "stage": mem.worst_stage,
               "breakdown": mem.breakdown, "step_s": timing.step if timing else None,
               "throughput": timing.throughput(model.workload) if timing else None, "fits": verdict.fits,
               "reason": verdict.reason,
               "stage_blocks": [len(rank_blocks(model.layout.layers, point["pp"], r, point["vpp"] if point["pp"] > 1 else 1))
                                for r in range(point["pp"])]}
        (rows if verdict.fits else pruned).append(row)
    rows.sort(key=lambda r: (r["peak"] > budget, -r["throughput"], r["peak"]))
    layouts, shown = set(), []  # each layout's best row once
    for r in rows:
        key = tuple(r["point"][k] for k in ("tp", "pp", "cp"))
        if key not in layouts:
            layouts.add(key)
            shown.append(r)
    return {"points": len(evaluated), "feasible": len(rows), "pruned": len(pruned), "top": shown[:top],
            "pruned_examples": pruned[:top], "smallest": sorted(pruned, key=lambda r: r["peak"])}


def _layouts_pruned_whole(budget: int, *case) -> int:
    model, evaluated = _evaluated(*case)
    keep = 1 - model.calibration.uncertainty
    return sum(int(f * keep) > budget for f in _layout_floors(*case).values())


@functools.cache
def _layout_floors(*case) -> dict[tuple, int]:
    """Each layout's floor (:meth:`CostModel.layout_floor`), read at its first point."""
    model, evaluated = _evaluated(*case)
    floors: dict[tuple, int] = {}
    for point, _ in evaluated:
        layout = (point["tp"], point["pp"], point["dp"], point["zero"])
        if layout not in floors:
            floors[layout] = model.layout_floor(point)
    return floors


def _groups(case=()) -> list[list[dict]]:
    """Every point of ``case`` as plain knobs, in the groups plan evaluates together."""
    from slapo_tune.cost_model import block_groups as groups

    points = [point.knobs() for point, _ in _evaluated(*case)[1]]
    return [[points[i] for i in members] for members in groups(points, range(len(points))).values()]


def test_layout_floor_is_below_every_points_peak():
    _, evaluated = _evaluated()
    floors = _layout_floors()  # each layout's floor read at its first point, held against every one's peak
    for point, mem in evaluated:
        floor = floors[(point["tp"], point["pp"], point["dp"], point["zero"])]
        assert 0 < floor <= mem.peak, (point.short, floor, mem.peak)


@pytest.mark.parametrize("case", [(), GPT2, GPT2_UNEVEN], ids=["llama", "gpt2-amp", "gpt2-uneven"])
def test_group_floor_is_below_every_points_peak(case):
    """Every group's floor (:meth:`CostModel.group_floors`, all groups at once as ``plan`` reads them;
    ``group_floor`` is the same of one group) is below each of its points' predicted peaks."""
    model, evaluated = _evaluated(*case)
    peaks = {json.dumps(point.knobs()): mem.peak for point, mem in evaluated}
    groups = _groups(case)
    floors = model.group_floors([group[0] for group in groups], groups)
    assert floors[0] == model.group_floor(groups[0][0], groups[0])
    for group, floor in zip(groups, floors, strict=True):
        assert all(0 < floor <= peaks[json.dumps(p)] for p in group), group[0]


@pytest.mark.parametrize("case", [(), GPT2, GPT2_UNEVEN], ids=["llama", "gpt2-amp", "gpt2-uneven"])
def test_quick_verdicts_are_the_predicted_peaks_verdicts(case, monkeypatch):
    """Every group's verdicts by the terms' multiples of what a block keeps (CostModel.quick_verdicts)
    are those of the predicted peaks, at budgets that leave the 1e-9 margin open too: at a point's
    predicted peak, and where its optimistic end crosses the budget."""
    model, evaluated = _evaluated(*case)
    keep = 1 - model.calibration.uncertainty
    peaks = {json.dumps(point.knobs()): mem.peak for point, mem in evaluated}
    opened, exact_verdicts = [], model._exact_verdicts
    monkeypatch.setattr(model, "_exact_verdicts", lambda *args: opened.append(args) or exact_verdicts(*args))
    for n, group in enumerate(_groups(case)):
        exact = [peaks[json.dumps(p)] for p in group]
        budgets = [30 * 2**30] if n % 7 else [exact[0], int(exact[0] * keep), int(exact[0] * keep) - 1]
        for budget in budgets:
            oks, bounds = model.quick_verdicts(group[0], group, budget)
            for ok, bound, peak in zip(oks, bounds, exact):
                assert ok == (not int(peak * keep) > budget), (group[0], budget)
                assert (bound > budget) == (peak > budget) if ok else bound <= peak
    assert opened  # the margin left some open: they were evaluated as memory() adds the terms


@pytest.mark.parametrize("case", [(), GPT2, GPT2_UNEVEN], ids=["llama", "gpt2-amp", "gpt2-uneven"])
def test_every_group_evaluated_at_once_gets_its_predicted_peaks_verdicts(case):
    """``plan`` evaluates all groups' stages as one batch of rows (the knobs array columns; rows
    that branch differently run apart): each point's verdict is still its predicted peak's
    (:meth:`CostModel.memory`, one point at a time), and its bound below or on the right side of it."""
    model, evaluated = _evaluated(*case)
    keep = 1 - model.calibration.uncertainty
    peaks = {json.dumps(point.knobs()): mem.peak for point, mem in evaluated}
    groups = _groups(case)
    all_peaks = sorted(peaks.values())
    for budget in (all_peaks[len(all_peaks) // 3], all_peaks[2 * len(all_peaks) // 3]):
        verdicts = model.group_verdicts([(group[0], group) for group in groups], budget)
        fits = 0
        for group, (oks, bounds) in zip(groups, verdicts):
            for point, ok, bound in zip(group, oks, bounds):
                peak = peaks[json.dumps(point)]
                assert ok == (not int(peak * keep) > budget), (point, budget)
                assert (bound > budget) == (peak > budget) if ok else bound <= peak
                fits += ok
        assert 0 < fits < len(peaks)  # both verdicts occur


def test_points_differing_in_what_the_stages_read_are_evaluated_apart(monkeypatch):
    """A knob the stages read besides what a block keeps (here: fusion, adding to a stage's
    weights) splits a group: its points are evaluated apart, as one by one."""
    import slapo_tune.cost_model as cost_model
    from slapo_tune.cost_model.analytic import stage_builder

    def reading_fusion(layout, point, *args, **kwargs):
        terms = stage_builder(layout, point, *args, **kwargs)
        fuse = point["fuse"]  # an array where the stages of many points are built at once
        extra = np.where(fuse == "on", 4 * 2**30, 0) if isinstance(fuse, np.ndarray) else 4 * 2**30 * (fuse == "on")

        def stage_terms(stage):
            st = terms(stage)
            st.base["weights"] = st.base.get("weights", 0) + extra
            return st

        return stage_terms

    model, _ = _evaluated()
    weights = model._weights()
    group = next(g for g in _groups() if {p["fuse"] for p in g} == {"off", "on"} and g[0]["fuse"] == "off")
    budget = 64 * 2**30
    for evaluate in (model.quick_verdicts, model._exact_verdicts):
        monkeypatch.setattr(cost_model, "stage_builder", stage_builder)
        before = [evaluate(p, [p], budget, weights) for p in group]
        monkeypatch.setattr(cost_model, "stage_builder", reading_fusion)
        oks, bounds = evaluate(group[0], group, budget, weights)
        by_one = [evaluate(p, [p], budget, weights) for p in group]
        assert by_one != before  # the stages read it
        assert [o for (o,), _ in by_one] == oks and [b for _, (b,) in by_one] == bounds


def test_space_prefixes_and_completions_are_what_enumerate_lists():
    model, evaluated = _evaluated()
    space = model.problem.space
    points = list(space.enumerate())
    for depth in (2, 6, 10):
        listed = [p for prefix in space.prefixes(depth) for p in space.enumerate(prefix)]
        assert listed == points
        for prefix in list(space.prefixes(depth))[::7]:
            assert space.completions(prefix) == sum(1 for _ in space.enumerate(prefix))
    space.constraints.append(lambda p: "no eager at tp 2" if p["tp"] == 2 and p["attn"] == "eager" else None)
    try:
        prefix = next(p for p in space.prefixes(6) if p["tp"] == 2)
        assert space.completions(prefix) == sum(1 for _ in space.enumerate(prefix)) > 0
    finally:
        space.constraints.pop()


@pytest.mark.parametrize("case, budget, top", [((), "24GiB", 3), ((), "32GiB", 5), (GPT2, "6GiB", 4),
                                                (GPT2_UNEVEN, "1GiB", 5)],
                         ids=["llama-24GiB", "llama-32GiB", "gpt2-amp-6GiB", "gpt2-uneven-1GiB"])
def test_plan_json_equals_evaluating_every_point(capsys, case, budget, top):
    limit = parse_size(budget)
    model_name, workload = case or (MODEL, tuple(WORLD))
    assert _layouts_pruned_whole(limit, *case) > 0  # the layout pruning is exercised
    code = main(["plan", "--model", model_name, *workload, "--memory-budget", budget, "--top", str(top),
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    expected = json.loads(json.dumps(_reference(limit, top, *case), default=str))
    assert data["pruned"] > 0 and data["feasible"] > 0
    for row in data["top"]:
        row.pop("mfu")  # the step time's, compared
    for key in ("points", "feasible", "pruned", "top", "pruned_examples"):
        assert data[key] == expected[key], key


def test_plan_text_lists_the_smallest_pruned_peaks(capsys):
    budget = parse_size("24GiB")
    assert main(["plan", "--model", MODEL, *WORLD, "--memory-budget", "24GiB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    expected = _reference(budget, 3)
    tail = out.split(f"pruned {expected['pruned']} point(s), for example:\n")[1].splitlines()
    # each point (short names, the knobs that do nothing there left out) and its reason, wrapped to fit
    assert (" ".join(line.strip() for line in tail)
            == " ".join(f"{readable(r['point'])}: {r['reason']}" for r in expected["smallest"][:3]))
    assert f"{expected['points']} point(s), {expected['feasible']} fit, {expected['pruned']} pruned" in out


def test_plan_with_nothing_fitting_names_the_smallest_peak(capsys):
    budget = parse_size("16GiB")
    assert _layouts_pruned_whole(budget) == len({(p["tp"], p["pp"], p["dp"], p["zero"]) for p, _ in _evaluated()[1]})
    assert main(["plan", "--model", MODEL, *WORLD, "--memory-budget", "16GiB", "--json"]) != 0
    smallest = _reference(budget, 3)["smallest"][0]
    err = capsys.readouterr().err
    assert (f"smallest predicted peak is {format_size(smallest['peak'])} at {format_point(smallest['point'])}"
            in err)


def test_plan_does_not_load_torch():
    """``plan`` of a preset measures and builds nothing: neither torch nor transformers (2-3 s of
    start-up, most of a one-point plan's time) is imported, on a machine with no GPU driver; what
    measures loads them, and then it works."""
    import subprocess
    import sys

    script = (
        "import sys, contextlib, io\n"
        "from slapo_tune import device\n"
        "from slapo_tune.cli import main\n"
        "device._GPU_DRIVER_PATHS = ('/nonexistent/nvidiactl',)  # as on a machine without a GPU driver\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['plan', '--model', 'llama-7b', '--world-size', '8', '--memory-budget', '80GiB', '--knobs', 'tp=8'])\n"
        "heavy = ('torch', 'transformers', 'torch._dynamo', 'torch.distributed._tools.mem_tracker')\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "import torch\n"
        "from slapo_tune.memory import StepMemTracker\n"
        "with StepMemTracker() as tracker:\n"
        "    x = torch.ones(1024)\n"
        "print(tracker.get_tracker_snapshot('peak')[torch.device('cpu')]['Total'] >= 4096)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["[]", "True"], out.stdout + out.stderr


@pytest.mark.parametrize("case", [(), GPT2, GPT2_UNEVEN], ids=["llama", "gpt2-amp", "gpt2-uneven"])
def test_throughputs_together_are_each_points_own_bit_for_bit(case):
    """``plan`` ranks the points that fit by :meth:`CostModel.throughputs`, the time model over
    arrays of points: each element is what :meth:`CostModel.time` gives that point alone (the same
    code on Python numbers), on a GPU preset and on CPU ranks (a measured GEMM curve, time-sliced
    cores, memory bandwidth)."""
    import dataclasses

    import numpy as np

    model, evaluated = _evaluated(*case)
    points = [point for point, _ in evaluated[::5]]
    cpu = dataclasses.replace(model.device, name="cpu", cores=3, gemm_half_tokens=200.0, memory_bandwidth=2e10)
    for device in (model.device, cpu):
        timed = CostModel(model.problem, device, calibration=model.calibration, layout=model.layout)
        alone = np.array([timed.time(p).throughput(timed.workload) for p in points])
        assert np.array_equal(timed.throughputs(points), alone), device.name
        assert len(set(alone.tolist())) > len(points) // 20  # the knobs change them


@pytest.mark.parametrize("case", [(), GPT2], ids=["llama", "gpt2-amp"])  # (GPT2_UNEVEN: no layout pruned whole here)
def test_a_whole_space_predicted_at_once_is_each_points_own(case):
    """The model-ranked strategies predict the whole space at once (:meth:`CostModel.predictions`):
    each point's verdict is :meth:`CostModel.verdict`'s, its peak :meth:`CostModel.memory`'s where it
    fits (within the terms' rounding) and a lower bound above the budget where not, its throughput
    :meth:`CostModel.time`'s where it fits and 0 where not."""
    model, evaluated = _evaluated(*case)
    points = [point.knobs() for point, _ in evaluated]
    all_peaks = sorted(mem.peak for _, mem in evaluated)
    # the layout whose smallest peak is nearest its floor: at the budget where that peak just fits
    # (at its optimistic end), the floor is above the budget, yet the layout is not pruned whole
    floors = _layout_floors(*case)
    layouts: dict[tuple, tuple[int, int]] = {}
    for point, mem in evaluated:
        key = (point["tp"], point["pp"], point["dp"], point["zero"])
        floor, least = layouts.get(key, (floors[key], mem.peak))
        layouts[key] = (floor, min(least, mem.peak))
    floor, least = max(layouts.values(), key=lambda fl: fl[0] / fl[1])
    edge = int(least * (1 - model.calibration.uncertainty))
    assert floor > edge
    budgets = (all_peaks[len(all_peaks) // 4], all_peaks[len(all_peaks) // 2], edge)
    assert any(_layouts_pruned_whole(budget, *case) for budget in budgets)  # layouts pruned whole, unevaluated
    for budget in budgets:
        predicted = model.predictions(points, budget)
        for i, (point, mem) in enumerate(evaluated):
            fits = model.verdict(point, budget, prediction=mem).fits
            assert predicted.fits[i] == fits, point
            if fits:
                assert abs(int(predicted.peaks[i]) - mem.peak) <= 1e-8 * mem.peak, point
                assert predicted.throughputs[i] == _timing(i, *case).throughput(model.workload), point
            else:
                assert budget < predicted.peaks[i] <= mem.peak and predicted.throughputs[i] == 0, point
        assert 0 < predicted.fits.sum() < len(points)


@pytest.mark.parametrize("seed", range(3))
def test_row_codes_are_equal_exactly_where_the_rows_are(seed):
    """Rows of small integers (coded as themselves), large ones, floats and strings (coded by
    their order), and enough wide columns that the codes are renumbered on the way: two rows get
    one code where, and only where, their Python tuples are equal."""
    from slapo_tune.cost_model._columns import row_codes

    rng = np.random.default_rng(seed)
    n = 2000
    columns = [rng.integers(0, 4, n), rng.integers(0, 3, n) * 2**40, rng.choice([0.0, 0.25, 0.5], n),
               rng.choice(["1f1b", "zb", "gpipe"], n), *(rng.integers(0, 2**19, n) for _ in range(5))]
    columns[4] = columns[0] * 7 % 3  # a column that follows another: no code of its own to add
    codes = row_codes(columns).tolist()
    rows = list(zip(*(c.tolist() for c in columns), strict=True))
    first: dict[tuple, int] = {}
    for row, code in zip(rows, codes, strict=True):
        assert first.setdefault(row, code) == code  # equal rows, one code
    assert len(set(first.values())) == len(first)  # unequal rows, unequal codes
    narrow = row_codes(columns[:2] + [columns[0] * 0 + 5])
    assert len(set(narrow.tolist())) == len(set(zip(columns[0].tolist(), columns[1].tolist())))
