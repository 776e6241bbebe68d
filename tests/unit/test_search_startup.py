"""What ``tune`` works out before its first trial, without listing a large model's space: the
default made to fit (the nearest fitting point, walked by the number of knobs changed), the points
that may fit with their predictions (found as ``plan`` walks a space), and ``guided``'s and
``model``'s rankings of them. Each is checked against the whole space listed and predicted, as it
was before: the same points, the same predictions bit for bit, the same choices, seed for seed."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import numpy as np
import pytest

from benchmarks.search_strategies import GRIDS, load_grid, replay_tuner
from runners.replay import ReplayRunner
from slapo_tune.plan import OUT_OF_THE_BOX, TrialStatus
from slapo_tune.problem import ProblemSpec
from slapo_tune.search import TuneConfig, Tuner, _driver
from slapo_tune.search._known import Known
from slapo_tune.space import point_key

# (preset, world, global batch): tiny models' spaces of 10^3-10^4 points, sequence 64
SPACES = [("gpt2-tiny", 4, 16), ("llama-tiny", 8, 16), ("opt-tiny", 16, 32), ("bert-tiny", 4, 16)]
HUGE = 2**50  # a budget every point fits: the points' predicted peaks
TRIES = _driver.MADE_TO_FIT_TRIES


def _tuner(preset: str, world: int, global_batch: int, budget: int, **config) -> Tuner:
    spec = ProblemSpec(preset, world, global_batch=global_batch, seq_len=64, memory_budget=budget)
    return Tuner(TuneConfig(problem=spec, out=Path("unused"), trials=1, storage="memory", **config),
                 ReplayRunner([]), write_outputs=False)


def _budgets(tuner: Tuner) -> list[int]:
    """Budgets the out-of-the-box point cannot fit: just under its optimistic peak, a fifth of the
    space's peaks (several knobs to change), all but the two smallest (far from it), and none."""
    default = tuner.space.complete(OUT_OF_THE_BOX)
    peaks = sorted(tuner.cost.predictions(list(tuner.space.enumerate()), HUGE).peaks.tolist())
    return [tuner.cost.memory(default).lower - 1, peaks[len(peaks) // 5], peaks[1], 1]


def _nearest_by_listing(tuner: Tuner, default: dict) -> list[dict]:
    """The definition: every point listed and predicted; those the analytic verdict lets through,
    by knobs changed, then fastest predicted, then the space's order."""
    points = list(tuner.space.enumerate())
    predicted = tuner.cost.predictions(points, tuner.config.memory_budget)
    return [points[i] for i in sorted((i for i in range(len(points)) if predicted.fits[i]), key=lambda i: (
        sum(points[i][k] != v for k, v in default.items()), -predicted.throughputs[i], i))]


@pytest.mark.parametrize("preset,world,global_batch", SPACES)
def test_the_default_made_to_fit_is_the_nearest_fitting_point_of_the_whole_space(preset, world, global_batch,
                                                                                  monkeypatch):
    """Made to fit without listing the space (only the points within as many changed knobs as it
    takes are predicted), the baseline is the point the definition picks from the whole space
    listed: the first of the first MADE_TO_FIT_TRIES nearest points that the tuner's own pruning
    lets through, with that pruning refusing some (the analytic verdict is optimistic: exact mode
    refuses a few), and with the tries running out."""
    probe = _tuner(preset, world, global_batch, HUGE)
    default = probe.space.complete(OUT_OF_THE_BOX)
    size = probe.space.count()
    changed = []
    for budget in _budgets(probe):
        tuner = _tuner(preset, world, global_batch, budget)
        asked: list[int] = []
        predictions = tuner._predictions

        def predict(points, predictions=predictions, asked=asked):
            asked.append(len(points))
            return predictions(points)

        nearest = _nearest_by_listing(tuner, default)
        first_two = {point_key(p) for p in nearest[:2]}
        refusals = {"two thirds": lambda p: zlib.crc32(point_key(p).encode()) % 3 != 0,  # a crude pruning
                    "the first two": lambda p, first_two=first_two: point_key(p) in first_two}
        for refused in refusals.values():
            def fits(point, tuner=tuner, budget=budget, refused=refused) -> bool:
                return tuner.cost.verdict(point, budget).fits and not refused(point)

            tuner._predictions, tuner._fits = predict, fits
            for tries in (TRIES, 2):
                monkeypatch.setattr(_driver, "MADE_TO_FIT_TRIES", tries)
                made = tuner._made_to_fit(default)
                assert made == next((p for p in nearest[:tries] if fits(p)), None), (budget, tries)
                changed.append(None if made is None else sum(made[k] != v for k, v in default.items()))
        assert asked and max(asked) < size  # never the whole space
    assert any(n is not None and n >= 2 for n in changed) and None in changed, changed


def test_the_tuners_pruning_asks_the_exact_verdict_only_where_the_analytic_one_lets_the_point_through():
    """Exact mode (a fake step per stage: minutes for a large model) checks a point only once the
    analytic verdict lets it through, as the pruning of every launch does: the out-of-the-box
    point that cannot fit by the analytic verdict is not stepped again to be refused."""
    probe = _tuner("gpt2-tiny", 4, 16, HUGE)
    default = probe.space.complete(OUT_OF_THE_BOX)
    budget = probe.cost.memory(default).lower - 1
    tuner = _tuner("gpt2-tiny", 4, 16, budget, prune="exact")
    exact_points: list[dict] = []
    verdict = tuner.cost.verdict

    def spy(point, budget, exact=False, **rest):
        if exact:
            exact_points.append(point)
        return verdict(point, budget, exact, **rest)

    tuner.cost.verdict = spy
    assert not tuner._fits(default) and tuner._prune_reason(default) is not None and exact_points == []
    fitting = next(p for p in tuner.space.enumerate() if verdict(p, budget).fits)
    assert tuner._fits(fitting) == (tuner._prune_reason(fitting) is None) and exact_points == [fitting, fitting]


@pytest.mark.parametrize("preset,world,global_batch", SPACES)
def test_the_points_that_may_fit_are_found_and_predicted_as_with_the_whole_space(preset, world, global_batch):
    """ranking.fitting_points walks the space as plan does (floors prune layouts and groups
    unlisted), yet gives the points the analytic verdict lets through in the space's order, and
    their peaks and throughputs bit for bit, as CostModel.predictions of the whole space listed;
    and every other point's predicted peak as those give it."""
    from slapo_tune.cost_model.ranking import fitting_points

    probe = _tuner(preset, world, global_batch, HUGE)
    points = list(probe.space.enumerate())
    partly = 0
    for budget in [*_budgets(probe), HUGE]:
        whole = probe.cost.predictions(points, budget)
        found = fitting_points(probe.cost, probe.space, budget)
        fit = np.flatnonzero(whole.fits)
        assert found.points == [points[i] for i in fit]
        assert np.array_equal(found.predictions.peaks, whole.peaks[fit])
        assert np.array_equal(found.predictions.throughputs, whole.throughputs[fit])
        assert [found.peak(points[i]) for i in np.flatnonzero(~whole.fits)] == whole.peaks[~whole.fits].tolist()
        partly += 0 < len(fit) < len(points)
    assert partly >= 2


def _pair(strategy: str, grid: str, budget_scale: float, perturb: bool = False, trials: int = 1):
    """Two tuners of one replayed grid: the first's strategy lists and predicts the whole space,
    the second's only the points that may fit (as for a large model's space)."""
    results, budget = load_grid(grid)
    pair = []
    for partial in (False, True):
        tuner, runner = replay_tuner(strategy, 0, "analytic", results, int(budget * budget_scale), trials=trials,
                                     grid=grid, perturb=perturb)
        if strategy == "guided":
            tuner.sampler.LISTED_POINTS = 0 if partial else 10**9
        elif not partial:
            tuner.sampler.fitting = None
        pair.append((tuner, runner))
    return pair


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("budget_scale", [1.0, 0.7, 0.5])
def test_guided_and_model_search_as_with_the_whole_space_listed(grid, budget_scale):
    """Seeded replays propose the same points, trial for trial, and stop alike (guided early, or
    the space exhausted), with the time model right or deliberately wrong; model's ranking is
    the same list of points."""
    for perturb in (False, True):
        runs = []
        for tuner, runner in _pair("guided", grid, budget_scale, perturb, trials=25):
            summary = tuner.run()
            runs.append(([point_key(p) for p in runner.launched], summary["stop"], summary["pruned"],
                         tuner.sampler.stopped_early))
        assert runs[0] == runs[1], (perturb, runs[0][1:], runs[1][1:])
    # model's ranking: a stable sort of the whole space by its predicted throughputs (0: cannot fit)
    (whole, _), (partial, _) = _pair("model", grid, budget_scale)
    points = list(whole.space.enumerate())
    throughputs = whole.cost.predictions(points, whole.config.memory_budget).throughputs
    expected = [points[i] for i in np.argsort(-throughputs, kind="stable")]
    assert list(whole.sampler.ordering()) == expected == list(partial.sampler.ordering())


def _snapshot(points: list[dict], peaks: np.ndarray, rng: random.Random) -> Known:
    """A study that knows some points, any of the space's: measured (throughput and peak),
    out of memory, pruned, or running."""
    status, values, measured_peaks, running = {}, {}, {}, {}
    for i in rng.sample(range(len(points)), rng.randint(1, 40)):
        key, draw = point_key(points[i]), rng.random()
        if draw < 0.5:
            status[key], values[key] = TrialStatus.OK, [rng.uniform(0.2, 5.0)]
            measured_peaks[key] = float(peaks[i]) * rng.uniform(0.8, 1.2)
        elif draw < 0.7:
            status[key] = TrialStatus.OOM
        elif draw < 0.85:
            status[key] = TrialStatus.PRUNED
        else:
            running[key] = i
    return Known(status, values, running, len(status), measured_peaks)


@pytest.mark.parametrize("grid", GRIDS)
def test_guided_chooses_as_with_the_whole_space_whatever_the_study_knows(grid):
    """Whatever points the study knows (measured, out of memory, pruned, running; points that may
    fit or not), guided's partial table chooses what the whole space's table chooses, or stops
    alike: by itself where an open point that may fit is left ahead of the others, else by the
    whole space listed. Both happen here."""
    rng = random.Random(0)
    decided = listed = 0
    for budget_scale in (1.0, 0.6):
        (whole, _), (partial, _) = _pair("guided", grid, budget_scale)
        table, rows = whole.sampler._tables(), partial.sampler._tables()
        # the partial table's points: those that may fit, numbered as the whole space's walk meets their values
        fit = np.flatnonzero(np.isfinite(table["log_prior"]))
        assert rows["points"] == [table["points"][i] for i in fit] and 0 < len(fit) < len(table["points"])
        assert np.array_equal(rows["features"], table["features"][fit]) and rows["width"] == table["width"]
        for _ in range(40):
            known = _snapshot(table["points"], table["peak"], rng)
            (partial, _), = _pair("guided", grid, budget_scale)[1:]
            whole.sampler.stopped_early = False
            assert partial.sampler.next_point(known) == whole.sampler.next_point(known)
            assert partial.sampler.stopped_early == whole.sampler.stopped_early
            is_whole = partial.sampler._tables()["whole"]
            decided, listed = decided + (not is_whole), listed + is_whole
    assert decided >= 20 and listed >= 5, (decided, listed)
