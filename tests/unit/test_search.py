"""Search strategies replayed on a recorded grid of measured trials (no training runs here), and
pruning judged against the recorded grids' measured peaks (torch's MemTracker on real steps).

The cost model describes the CPU the grids were recorded on (``benchmarks/data/cpu.json``, put in
the session's cache by ``conftest``); no calibration from a user's cache applies."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import time

import numpy as np
import pytest

from benchmarks._stats import censored
from benchmarks.search_strategies import (
    GRIDS,
    KNOB_TYPES,
    SMALL,
    load_grid,
    replay_tuner,
    search,
    trials_to_within,
)
from runners.replay import ReplayRunner
from slapo_tune.plan import TrialStatus
from slapo_tune.search import DEFAULT_STRATEGY, STRATEGIES, TuneConfig
from slapo_tune.search._known import Known
from slapo_tune.search._samplers import Guided, RandomSearch
from slapo_tune.space import point_key

SEEDS = range(4)


@pytest.fixture(scope="module")
def grid():
    results, budget = load_grid()
    feasible = [r for r in results if r.status == "ok"]
    return results, budget, max(r.samples_per_s for r in feasible), max(1, int(0.2 * len(feasible)))


def test_the_cost_model_ranking_reaches_3_percent_within_20_percent_of_the_grid(grid):
    results, budget, optimum, limit = grid
    launched, _ = search("model", 0, "analytic", results, budget, trials=limit)
    found = trials_to_within(launched, optimum)
    assert found is not None and found <= limit, (found, limit)


def test_tpe_trials_to_3_percent_over_seeds(grid):
    """TPE depends on its seed, so its claim is a distribution over seeds (a search that misses
    counts as a miss, never dropped): over 4 seeds, every search reaches 3 % of the optimum within
    three times the limit (20 % of the feasible points), and the censored median within twice the
    limit. Seen over 20 seeds (benchmarks.search_strategies): median 34, p25 27, p75 52 trials:
    TPE alone does not meet the limit reliably (the default, guided, needs 3)."""
    results, budget, optimum, limit = grid
    counts = [trials_to_within(search("tpe", seed, "analytic", results, budget, trials=3 * limit)[0], optimum)
              for seed in SEEDS]
    spread = censored(counts)
    assert spread["reached"] == 1.0, counts
    assert spread["median"] is not None and spread["median"] <= 2 * limit, counts


def _optimum(results) -> float:
    return max(r.samples_per_s for r in results if r.status == "ok")


@pytest.mark.parametrize("grid_name", GRIDS)
def test_the_default_strategy_needs_fewer_trials_than_the_cost_models_ranking(grid_name):
    """The default (guided: the cost model's ranking corrected by each measurement) comes within
    3 % of each recorded grid's optimum in fewer trials than the ranking alone (measured: 3 vs 9 on
    the small grid, 3 vs 16 on the reference grid), and launches the same points for any seed."""
    assert DEFAULT_STRATEGY == "guided" and TuneConfig.__dataclass_fields__["strategy"].default == "guided"
    results, budget = load_grid(grid_name)
    cap = 3 * int(0.2 * sum(r.status == "ok" for r in results))
    guided = [search("guided", seed, "analytic", results, budget, cap, grid=grid_name)[0] for seed in (0, 1)]
    ranked = trials_to_within(search("model", 0, "analytic", results, budget, cap, grid=grid_name)[0],
                              _optimum(results))
    found = trials_to_within(guided[0], _optimum(results))
    assert guided[0] == guided[1]
    assert found is not None and ranked is not None and found < ranked <= cap, (found, ranked)


def test_guided_corrects_a_wrong_time_model_where_the_ranking_alone_is_misled():
    """Each seed multiplies the time model's predictions by a fixed factor between 1/2 and 2 per
    knob value: over the same seeds guided's censored median of trials to within 3 % is below the
    ranking's (measured over 20 seeds on the small grid: 6 vs 20)."""
    results, budget = load_grid(SMALL)
    optimum, cap = _optimum(results), 3 * int(0.2 * sum(r.status == "ok" for r in results))
    medians = {}
    for strategy in ("guided", "model"):
        counts = [trials_to_within(search(strategy, seed, "analytic", results, budget, cap, perturb=True)[0], optimum)
                  for seed in range(6)]
        medians[strategy] = censored(counts)["median"]
    assert medians["guided"] is not None and (medians["model"] is None or medians["guided"] < medians["model"]), medians


def test_guided_tries_a_point_predicted_over_the_budget_by_its_chance_to_fit(grid):
    """A point the analytic model lets through (its optimistic end fits) but predicts over the
    budget is tried after points predicted to fit that are nearly as fast; just under the budget,
    it is first as its prediction says."""
    from slapo_tune.search._known import Known

    results, budget, _, _ = grid
    tuner, _ = replay_tuner("guided", 0, "analytic", results, budget, trials=1)
    sampler: Guided = tuner.sampler
    table = sampler._tables()
    nothing = Known({}, {}, {}, 0)
    first = sampler.next_point(nothing)
    i = table["index"][point_key(first)]
    assert table["peak"][i] <= budget
    table["peak"][i] = 1.15 * budget  # 15 % over: three spreads of the memory model's error
    instead = sampler.next_point(nothing)
    assert instead != first and table["peak"][table["index"][point_key(instead)]] <= budget
    table["peak"][i] = 0.999 * budget
    assert sampler.next_point(nothing) == first


def test_guided_learns_the_memory_models_error_from_the_peaks_measured(grid):
    """A point predicted over the budget counts by its chance to fit, the memory model's error
    learned from the measured peaks: before any, 5 % either way (a point 5 % over has a fair
    chance); peaks measured as predicted make it a poor bet, peaks measured 10 % under their
    predictions (a pessimistic model) a good one. With many peaks, the learned error is theirs
    (their mean and spread, by the statistics module)."""
    import math
    import random
    import statistics

    results, budget, _, _ = grid
    sampler: Guided = replay_tuner("guided", 0, "analytic", results, budget, trials=1)[0].sampler
    table = sampler._tables()
    fitting = [i for i in range(len(table["points"])) if table["peak"][i] <= budget and table["peak"][i] > 0]

    def known(errors: list[float]) -> Known:
        peaks = {point_key(table["points"][i]): float(table["peak"][i]) * math.exp(e) for i, e in zip(fitting, errors)}
        return Known({k: TrialStatus.OK for k in peaks}, {k: [1.0] for k in peaks}, {}, len(peaks), peaks)

    def chance(k: Known, over: float = 1.05) -> float:
        return math.exp(sampler._log_chance_to_fit(np.array([over * budget, budget]), sampler.memory_error(k))[0])

    nothing = Known({}, {}, {}, 0)
    assert sampler.memory_error(nothing) == (0.0, Guided.MEMORY_SPREAD)
    prior = statistics.NormalDist(0.0, Guided.MEMORY_SPREAD)
    assert chance(nothing) == pytest.approx(prior.cdf(math.log(1 / 1.05)) / 0.5, rel=1e-9)
    assert chance(nothing) > 0.3
    assert chance(known([0.0] * 8)) < 1e-3  # the model measured right: 5 % over will not fit
    assert chance(known([math.log(0.9)] * 8)) > 0.9  # measured 10 % pessimistic: 5 % over fits
    assert math.exp(sampler._log_chance_to_fit(np.array([budget]), sampler.memory_error(known([0.0] * 8)))[0]) == 1.0
    draws = [random.Random(i).gauss(0.02, 0.01) for i in range(len(fitting))]
    mean, spread = sampler.memory_error(known(draws))
    assert len(draws) >= 100
    assert mean == pytest.approx(statistics.fmean(draws), abs=2e-3)
    assert spread == pytest.approx(statistics.pstdev(draws), rel=0.1)


def test_guided_chooses_a_point_over_the_budget_by_the_peaks_measured(grid):
    """The learned error is what next_point weighs by: the best predicted point (twice as fast as
    any other here), predicted 2 % over the budget, comes first while nothing says how right the
    memory model is, and not once peaks measured as predicted say it is right within about 1 %
    (only the peaks are known here: the throughputs' corrections are left out)."""
    import math

    results, budget, _, _ = grid
    sampler: Guided = replay_tuner("guided", 0, "analytic", results, budget, trials=1)[0].sampler
    table = sampler._tables()
    nothing = Known({}, {}, {}, 0)
    first = sampler.next_point(nothing)
    i = table["index"][point_key(first)]
    others = [j for j in range(len(table["points"])) if j != i and 0 < table["peak"][j] <= budget][:8]
    peaks = Known({}, {}, {}, 0, {point_key(table["points"][j]): float(table["peak"][j]) for j in others})
    table["log_prior"][i] += math.log(2)
    table["peak"][i] = 1.02 * budget
    assert sampler.next_point(nothing) == first
    assert sampler.next_point(peaks) != first


def test_the_study_reads_the_peaks_its_points_measured(grid):
    """The peaks guided learns from are those the trials measured (their largest rank's), read
    from the study, for the points that ran: none for a point out of memory."""
    results, budget, _, _ = grid
    # two ranks each, the second's the larger
    results = [dataclasses.replace(r, peak_memory=[r.peak_memory[0] // 2, r.peak_memory[0]]) for r in results]
    tuner, runner = replay_tuner("grid", 0, "analytic", results, budget, trials=40)
    tuner.run()
    recorded = {point_key(r.knobs): r.peak_memory[1] for r in results}
    statuses = {point_key(r.knobs): r.status for r in results}
    known = tuner._known(tuner.study)
    ran = [point_key(p) for p in runner.launched]
    assert known.peaks == {k: recorded[k] for k in ran if statuses[k] == "ok"}
    assert any(statuses[k] != "ok" for k in ran) and len(known.peaks) >= 6


def test_guided_learns_a_knob_values_correction_and_stops_when_nothing_can_win(grid):
    """Measurements that say one knob value runs at half the predicted speed move every point with
    that value down the ranking; once no open point can beat the best by the noise even at its
    optimistic end, the search is over."""
    from slapo_tune.search._known import Known

    results, budget, _, _ = grid
    tuner, _ = replay_tuner("guided", 0, "analytic", results, budget, trials=1)
    sampler: Guided = tuner.sampler
    table = sampler._tables()
    candidates = np.arange(len(table["points"]))
    predicted = np.exp(table["log_prior"])
    # measured: the prior exactly, except that zero=3 runs at half its predicted throughput
    measured = {}
    for i in np.argsort(-predicted)[:12]:
        point = table["points"][i]
        if np.isfinite(table["log_prior"][i]):
            measured[point_key(table["points"][i])] = predicted[i] * (0.5 if point["zero"] == 3 else 1.0)
    assert {table["points"][table["index"][k]]["zero"] for k in measured} >= {0, 3}
    known = Known({k: TrialStatus.OK for k in measured}, {k: [v] for k, v in measured.items()}, {}, len(measured))
    corrected, _, _ = sampler.scores(known, candidates)
    with np.errstate(invalid="ignore"):  # points the cost model says cannot fit: -inf both
        shift = corrected - table["log_prior"]
    zero3 = np.array([p["zero"] == 3 for p in table["points"]]) & np.isfinite(shift)
    assert shift[zero3].max() < shift[~zero3 & np.isfinite(shift)].min()
    assert sampler.next_point(known) is not None and not sampler.stopped_early
    # every other point the cost model says may fit measured 10x below the best: none left can win
    best = max(measured.values())
    values = {**{k: [v] for k, v in measured.items()},
              **{k: [best / 10] for i, k in enumerate(map(point_key, table["points"])) if k not in measured
                 and np.isfinite(table["log_prior"][i])}}
    known_most = Known({k: TrialStatus.OK for k in list(values)[:-1]}, dict(list(values.items())[:-1]), {},
                       len(values) - 1)
    assert sampler.next_point(known_most) is None and sampler.stopped_early


def _measured_at(table, indices, factor, running=()) -> Known:
    """A study that measured the points of ``indices`` at their predicted throughput times
    ``factor(point)``, and runs those of ``running``."""
    values = {point_key(table["points"][i]): [float(np.exp(table["log_prior"][i])) * factor(table["points"][i])] for i in indices}
    return Known({k: TrialStatus.OK for k in values}, values,
                 {point_key(table["points"][j]): n for n, j in enumerate(running)}, len(values))


def test_guided_learns_how_wrong_the_time_model_is(grid):
    """The knob corrections' spread is learned from the measurements: measurements that agree with
    the cost model (up to an overall scale) keep it at the least, so the model's ranking is
    followed; measurements off by a factor between 1/2 and 2 per knob value raise it to about
    that factor's spread (0.4 in log), and the largest spread they allow is at least as large."""
    from benchmarks.search_strategies import perturbation
    from slapo_tune.search._samplers import SPREADS

    results, budget, _, _ = grid
    tuner, _ = replay_tuner("guided", 0, "analytic", results, budget, trials=1)
    sampler: Guided = tuner.sampler
    table = sampler._tables()
    top = [int(i) for i in np.argsort(-table["log_prior"])[:30]]
    right = sampler._measured(_measured_at(table, top, lambda p: 0.2))
    assert sampler.spreads(*right[:2])[0] == SPREADS[0]
    wrong = perturbation(0)
    fitted, largest = sampler.spreads(*sampler._measured(_measured_at(table, top, wrong))[:2])
    assert 0.2 < fitted <= largest, (fitted, largest)


def test_guided_does_not_stop_while_a_knob_value_is_unmeasured(grid):
    """Measurements that agree with the cost model say its corrections are small, but only for the
    knob values they have: with every point measured as predicted except those of one knob value,
    all predicted well below the best, the search goes on to that value (nothing bounds its
    correction); once one of them is measured as predicted too, none left can win and it stops.
    (The points predicted over the budget are running, out of the way.)"""
    results, budget, _, _ = grid
    tuner, _ = replay_tuner("guided", 0, "analytic", results, budget, trials=1)
    sampler: Guided = tuner.sampler
    table = sampler._tables()
    prior, points = table["log_prior"], table["points"]
    fits = np.isfinite(prior) & (table["peak"] <= budget)
    values = {(k, v) for p in points for k, v in p.items()}
    slow = next((k, v) for k, v in sorted(values, key=str) if len({p[k] for p in points}) > 1
                and all(prior[i] < prior[fits].max() - 0.5 for i in np.nonzero(fits)[0] if points[i][k] == v))
    unmeasured = [int(i) for i in np.nonzero(fits)[0] if points[i][slow[0]] == slow[1]]
    rest = [int(i) for i in np.nonzero(fits)[0] if points[i][slow[0]] != slow[1]]
    running = [i for i in range(len(points)) if i not in rest and i not in unmeasured]  # the others: out of the way
    chosen = sampler.next_point(_measured_at(table, rest, lambda p: 1.0, running))
    assert chosen is not None and chosen[slow[0]] == slow[1] and not sampler.stopped_early, slow
    one = table["index"][point_key(chosen)]
    assert sampler.next_point(_measured_at(table, rest + [one], lambda p: 1.0, running)) is None
    assert sampler.stopped_early
    assert len(unmeasured) > 1


def test_guided_tells_tied_points_apart_with_the_one_least_like_the_measured():
    """Points the cost model predicts alike (knobs it does not see: on the reference grid, the
    attention kernel and fusion on a CPU) are tied; once the best predicted one is measured as
    predicted, the tied point it tries first is the one that differs from it in the most knobs:
    its measurement says the most about the rest (the other points are running here)."""
    from benchmarks.search_strategies import REFERENCE

    results, budget = load_grid(REFERENCE)
    tuner, _ = replay_tuner("guided", 0, "analytic", results, budget, trials=1, grid=REFERENCE)
    sampler: Guided = tuner.sampler
    table = sampler._tables()
    first = sampler.next_point(Known({}, {}, {}, 0))
    i = table["index"][point_key(first)]
    prior = table["log_prior"]
    tied = [j for j in range(len(prior)) if j != i and prior[j] == prior[i]]

    def differ(j: int) -> int:
        return sum(table["points"][j][k] != first[k] for k in first)

    assert len({differ(j) for j in tied}) > 1, "tied points that differ from the first in more or fewer knobs"
    others = [j for j in range(len(prior)) if j != i and j not in tied]
    chosen = table["index"][point_key(sampler.next_point(_measured_at(table, [i], lambda p: 1.0, others)))]
    assert chosen in tied and differ(chosen) == max(differ(j) for j in tied), (table["points"][chosen], first)


def _setting(point) -> tuple:
    """A point's knobs but its checkpointing (its micro-batch included)."""
    return tuple((k, v) for k, v in point.items() if k not in ("ckpt_ratio", "ckpt_policy"))


def _outdone(table, budget, known: Known, possible: set[int]) -> set[int]:
    """The points with one that recomputes less (:func:`recomputes_less`) and fits: measured to,
    or neither known nor ruled out (not in ``possible``) and predicted to; pair by pair."""
    from slapo_tune.plan import knob_value
    from slapo_tune.search._samplers import recomputes_less

    points = table["points"]
    fits = {i for i, p in enumerate(points)
            if known.status.get(point_key(p)) is TrialStatus.OK
            or (point_key(p) not in known.status and i in possible
                and np.isfinite(table["log_prior"][i]) and table["peak"][i] <= budget)}
    return {i for i, p in enumerate(points)
            if any(_setting(points[j]) == _setting(p) and recomputes_less(
                points[j]["ckpt_ratio"], knob_value(points[j], "ckpt_policy"), p["ckpt_ratio"],
                knob_value(p, "ckpt_policy")) for j in fits)}


def test_guided_leaves_out_the_points_beyond_a_measured_frontier_or_outdone(grid):
    """A point that ran out of memory settles its group's points with as large a micro-batch or
    larger and as little checkpointing or less (:func:`beyond_the_frontier`, which ``frontier``
    walks by); a point is outdone by one that recomputes less and fits (measured, or open and
    predicted to: a running one too). Guided's open points are all the others (its arrays over
    the whole space, checked here pair by pair). The out-of-memory point no longer outdoes the
    point that checkpoints more than it: that one is open again."""
    from slapo_tune.search._samplers import beyond_the_frontier, frontier_group

    results, budget, _, _ = grid
    sampler: Guided = replay_tuner("guided", 0, "analytic", results, budget, trials=1)[0].sampler
    table = sampler._tables()
    points = table["points"]
    oom = next(i for i, p in enumerate(points) if p["micro_batch"] == 4 and p["ckpt_ratio"] == 0.5)
    running = next(i for i, p in enumerate(points) if p["micro_batch"] == 1)
    ok = next(i for i, p in enumerate(points) if p["micro_batch"] == 2 and p["ckpt_ratio"] == 0.75
              and table["peak"][i] > budget)  # measured to fit, though predicted not to
    known = Known({point_key(points[oom]): TrialStatus.OOM, point_key(points[ok]): TrialStatus.OK},
                  {point_key(points[ok]): [1.0]}, {point_key(points[running]): 1}, 2)
    seen = [(4, 0.5, TrialStatus.OOM)]
    beyond = {i for i, p in enumerate(points) if frontier_group(p) == frontier_group(points[oom])
              and beyond_the_frontier(p["micro_batch"], p["ckpt_ratio"], seen)}
    assert {(points[i]["micro_batch"], points[i]["ckpt_ratio"]) for i in beyond} >= {(4, 0.25), (8, 0.5)}
    outdone = _outdone(table, budget, known, set(range(len(points))) - beyond)
    assert set(sampler._open(known).tolist()) == set(range(len(points))) - beyond - outdone - {oom, running, ok}
    # the out-of-memory point outdoes the next checkpointing of its micro-batch until it is measured;
    # the point measured to fit (predicted not to) outdoes the next of its own once it is
    after_oom = next(i for i in range(len(points)) if frontier_group(points[i]) == frontier_group(points[oom])
                     and points[i]["micro_batch"] == 4 and points[i]["ckpt_ratio"] == 0.75)
    after_ok = next(i for i in range(len(points)) if frontier_group(points[i]) == frontier_group(points[ok])
                    and points[i]["micro_batch"] == 2 and points[i]["ckpt_ratio"] == 1.0)
    without_ok = Known({point_key(points[oom]): TrialStatus.OOM}, {}, {point_key(points[running]): 1}, 1)
    assert table["peak"][oom] <= budget and after_oom not in sampler._open(Known({}, {}, {}, 0))
    assert after_oom in sampler._open(known) and after_ok not in sampler._open(known)
    assert after_ok in sampler._open(without_ok)


def test_guided_numbers_knob_values_as_a_walk_of_the_space_meets_them(grid):
    """The features are built knob by knob (a large model's space has 10^5-10^6 points), yet
    numbered as a walk of the points, row by row and a row's knobs in name order, meets the values
    (the numbering fixes the order of the fit's sums: a search's trials depend on it)."""
    from slapo_tune.search._samplers._guided import _features

    results, budget, _, _ = grid
    points = replay_tuner("guided", 0, "analytic", results, budget, trials=1)[0].sampler._tables()["points"]
    points = points[len(points) // 2:] + points[:len(points) // 2]  # values first met in another order
    columns: dict[tuple[str, str], int] = {}
    walked = [[columns.setdefault((k, str(v)), len(columns)) for k, v in sorted(p.items())] + [-1] for p in points]
    features, width = _features(points)
    assert width == len(columns) + 1 and len(columns) > len(points[0])
    assert np.array_equal(features[:, :-1], np.array(walked)[:, :-1]) and (features[:, -1] == len(columns)).all()


class _Lasting(ReplayRunner):
    """Replayed trials that take a moment, as real ones do: the others stay in flight meanwhile."""

    def run(self, spec):
        result = super().run(spec)
        time.sleep(0.05)
        return result


class _RepeatsFirst(RandomSearch):
    """The random strategy, except that its first three trials all get the point the first drew."""

    def __init__(self):
        super().__init__(seed=0)
        self.drawn: dict[str, object] = {}  # (qualified) knob name -> the value drawn for the first trial
        self.given: list[int] = []  # the trials given that point

    def sample_independent(self, study, trial, param_name, param_distribution):
        if len(self.given) < 3 and trial.number not in self.given:
            self.given.append(trial.number)
        if trial.number in self.given:
            if param_name not in self.drawn:
                self.drawn[param_name] = super().sample_independent(study, trial, param_name, param_distribution)
            return self.drawn[param_name]
        return super().sample_independent(study, trial, param_name, param_distribution)


def test_a_sampler_repeating_a_running_point_does_not_launch_it_twice(grid):
    """Optuna's samplers do not see running trials (TPE offers the same promising point to every
    free slot): here the sampler proposes one point three times while it runs. The driver checks
    the points in flight itself, answers the repeats as duplicates and launches other points."""
    results, budget, _, _ = grid
    runner = _Lasting(results)
    tuner, _ = replay_tuner("random", 0, "none", results, budget, trials=6, concurrency=2, runner=runner,
                            sampler=_RepeatsFirst())
    summary = tuner.run()
    first = point_key(runner.launched[0])
    repeats = [t for t in tuner.study.trials if t.user_attrs.get("status") == "duplicate"
               and point_key(t.user_attrs["point"]) == first]
    assert len(repeats) == 2 and all(t.state.name == "FAIL" for t in repeats)  # nothing told yet to repeat
    keys = [point_key(p) for p in runner.launched]
    assert len(keys) == len(set(keys)) == 6
    assert summary["duplicates"] >= 2


@pytest.mark.parametrize("strategy,concurrency", [("tpe", 1), ("random", 1), ("grid", 1), ("frontier", 1),
                                                  ("model", 1), ("guided", 1), ("guided", 2), ("tpe", 2), ("tpe", 4),
                                                  ("random", 4)])
def test_no_point_twice_and_pruned_points_never_launched(grid, strategy, concurrency):
    """With trials in flight (concurrency > 1) the sampler does not know the running points yet:
    the driver must still never launch one twice."""
    results, budget, _, _ = grid
    tuner, runner = replay_tuner(strategy, 0, "analytic", results, budget, trials=30, concurrency=concurrency,
                                 runner=_Lasting(results))
    summary = tuner.run()
    keys = [point_key(p) for p in runner.launched]
    assert len(keys) == len(set(keys)) == summary["launched"] == 30
    pruned = {point_key(t.user_attrs["point"]) for t in tuner.study.trials if t.user_attrs.get("status") == "pruned"}
    assert not pruned & set(keys)
    assert pruned or strategy in ("model", "guided")  # the model's ranking never proposes what it would prune
    measured = {point_key(r.knobs): r.peak_memory[0] for r in results}
    assert all(measured[k] > budget for k in pruned)  # what was pruned does not fit, by measurement
    for t in tuner.study.trials:  # what a constraint-aware sampler (TPE) learns of each point
        status = t.user_attrs["status"]
        if status in ("pruned", "oom"):
            assert t.constraints["0"] > 0, (t.number, status)
        elif status == "ok":
            assert t.constraints["0"] == 0.0, t.number
        elif status == "duplicate" and t.values:  # answered as the earlier trial was: infeasible ones told 0
            assert t.constraints["0"] == (1.0 if t.values == [0.0] else 0.0), t.number
        else:
            assert not t.constraints, (t.number, status)  # failed: nothing learnt


def test_a_recorded_constraint_is_the_one_optuna_and_optuna_dashboard_read():
    """``record_constraint`` writes Optuna's private ``"constraints"`` list (optuna-dashboard reads
    no other): this fails if Optuna renames or reformats it (its public ``FrozenTrial.constraints``,
    which TPE, NSGA-II and GP read, then misses it) or if the dashboard reads another key."""
    import optuna
    from optuna_dashboard._serializer import serialize_frozen_trial

    from slapo_tune.search._constraints import record_constraint

    study = optuna.create_study()
    for value in (0.5, 0.0):
        trial = study.ask()
        record_constraint(trial, value)
        study.tell(trial, 1.0)
    infeasible, feasible = study.trials
    assert infeasible.constraints == {"0": 0.5} and feasible.constraints == {"0": 0.0}
    assert list(serialize_frozen_trial(0, infeasible, {})["constraints"]) == [0.5]  # (a tuple in memory)
    assert list(serialize_frozen_trial(0, feasible, {})["constraints"]) == [0.0]


@pytest.mark.parametrize("strategy", ["grid", "model", "frontier", "guided"])
def test_an_ordered_strategy_skips_the_points_in_flight(grid, strategy):
    """An ordered strategy works out its next point from the told trials and the running ones: with
    three trials in flight it never proposes a running point (no repeat to answer), and grid
    launches exactly the space's first points."""
    results, budget, _, _ = grid
    tuner, runner = replay_tuner(strategy, 0, "none", results, budget, trials=12, concurrency=3,
                                 runner=_Lasting(results))
    summary = tuner.run()
    assert summary["duplicates"] == 0 and summary["launched"] == len(runner.launched) == 12
    if strategy == "grid":
        first = [point_key(p) for p in itertools.islice(tuner.space.enumerate(), 12)]
        assert sorted(point_key(p) for p in runner.launched) == sorted(first)


class _Scripted(ReplayRunner):
    """A replay runner whose n-th launched trial measures the n-th scripted throughput."""

    def __init__(self, results, script):
        super().__init__(results)
        self.script = list(script)
        self.ok = next(r for r in results if r.status == "ok")

    def run(self, spec):
        super().run(spec)
        return dataclasses.replace(self.ok, knobs=self.launched[-1], samples_per_s=self.script[len(self.launched) - 1])


def test_patience_stops_after_that_many_trials_without_a_strictly_better_one(grid):
    """--patience 3: trials 1 and 2 improve, trial 3 only ties the best (not an improvement), 4 and 5
    are worse: three trials without improvement, so the search stops after trial 5."""
    results, budget, _, _ = grid
    runner = _Scripted(results, [1.0, 5.0, 5.0, 4.0, 3.0, 2.0, 9.0, 9.0])
    # crowned as the trials measured (the script scripts trials, not their confirmation)
    tuner, _ = replay_tuner("random", 0, "none", results, budget, trials=8, runner=runner, patience=3, confirm=0)
    summary = tuner.run()
    assert summary["stop"] == "no improvement" and len(runner.launched) == summary["launched"] == 5
    assert summary["best"] == 5.0 and summary["best_point"] == runner.launched[1]  # the first to reach it


def test_a_resumed_study_knows_its_best_trial(grid, tmp_path):
    """Reopening a study rebuilds its progress from the stored trials: the best is the best measured
    throughput (out-of-memory trials have none), so patience and the report go on from there."""
    results, budget, _, _ = grid
    storage = f"journal:{tmp_path / 'study.journal'}"
    first, runner = replay_tuner("random", 0, "none", results, budget, trials=12, storage=storage, study="s")
    done = first.run()
    measured = [r.samples_per_s for r in (runner.table[point_key(p)] for p in runner.launched) if r.status == "ok"]
    assert len(measured) < 12 and done["best"] == max(measured)  # some trials ran out of memory
    again, _ = replay_tuner("random", 0, "none", results, budget, trials=12, storage=storage, study="s")
    again.open()
    assert (again.progress.best, again.progress.best_point) == (done["best"], done["best_point"])
    assert again.progress.launched == 12


def test_ctrl_c_cancels_the_trials_in_flight(grid):
    """Ctrl-C while trials run (a KeyboardInterrupt in the driver's thread) cancels them through the
    runner, which ends their ranks, and leaves no trial thread behind before the interrupt goes on."""
    import threading

    results, budget, _, _ = grid

    class Blocking(_Scripted):
        def __init__(self):
            super().__init__(results, [1.0] * 8)
            self.cancelled = threading.Event()

        def run(self, spec):
            ReplayRunner.run(self, spec)
            self.cancelled.wait(timeout=30)  # a real trial runs until its ranks are ended
            return dataclasses.replace(self.ok, status="crash", samples_per_s=None, knobs=self.launched[-1])

        def cancel(self):
            self.cancelled.set()

    launches = []

    def interrupt(event):  # the driver's report callback runs in its own thread: Ctrl-C lands there
        launches.append(event["event"] == "launched")
        if sum(launches) == 2:  # both trials of concurrency 2 in flight
            raise KeyboardInterrupt

    runner = Blocking()
    tuner, _ = replay_tuner("random", 0, "none", results, budget, trials=8, concurrency=2, runner=runner,
                            report=interrupt)
    with pytest.raises(KeyboardInterrupt):
        tuner.run()
    assert runner.cancelled.is_set()
    assert not [t for t in threading.enumerate() if t.name.startswith("trial")]


def test_frontier_skips_points_an_oom_rules_out(grid):
    """The whole walk (a trial budget as large as the grid): no launched point is one an earlier
    out-of-memory result ruled out, and once nothing is left to propose the search stops there,
    short of its budget, without asking the sampler again (no repeat answered)."""
    results, budget, _, _ = grid
    tuner, runner = replay_tuner("frontier", 0, "none", results, budget, trials=len(results))
    summary = tuner.run()
    assert summary["stop"] == "space exhausted" and summary["duplicates"] == 0
    assert summary["launched"] == len(runner.launched) < len(results)
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


# ------------------------------------------------------------------ pruning vs measured peaks
def _recorded(path) -> list[tuple[dict, int]]:
    with open(path) as f:
        return [({k: KNOB_TYPES.get(k, str)(v) for k, v in r.items() if k not in ("peak", "step_s", "step_times")},
                 int(r["peak"])) for r in csv.DictReader(f)]


def _grids():
    """(label, cost model, recorded points with their measured peaks, budget) of both grids."""
    from benchmarks.headline import BUDGET, GPT2_REF, problem_spec
    from benchmarks.record_grid import DEFAULT_OUT, GRID, REFERENCE_OUT
    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.problem import ProblemSpec

    _, small_budget = load_grid()
    out = []
    for label, spec, path, budget in (
            ("gpt2-tiny w2", ProblemSpec(GRID["model"], GRID["world_size"], global_batch=GRID["global_batch"],
                                         seq_len=GRID["seq_len"]), DEFAULT_OUT, small_budget),
            ("gpt2-ref w1", problem_spec(GPT2_REF, 1), REFERENCE_OUT, BUDGET)):
        model = CostModel(spec.resolve(), hardware("cpu"))
        out.append((label, model, _recorded(path), budget))
    return out


@pytest.fixture(scope="module")
def recorded_grids():
    return _grids()


def test_analytic_pruning_never_discards_a_point_measured_to_fit(recorded_grids):
    """Every recorded point, with its own measured peak as the budget (the tightest budget it fits):
    the analytic model's margin keeps it."""
    for label, model, points, _ in recorded_grids:
        assert model.calibration.source == "default" and len(points) >= 100
        pruned = [(p, peak, model.memory(p).lower) for p, peak in points if not model.verdict(p, peak).fits]
        assert not pruned, (label, len(pruned), pruned[:2])


def test_exact_pruning_never_discards_a_point_measured_to_fit(recorded_grids):
    """Exact mode costs seconds a point: the points whose measured peak is nearest the budget from
    below (the ones pruning can wrongly discard) and the nearest above, per grid."""
    for label, model, points, budget in recorded_grids:
        below = sorted((p for p in points if p[1] <= budget), key=lambda x: budget - x[1])[:3]
        above = sorted((p for p in points if p[1] > budget), key=lambda x: x[1] - budget)[:1]
        for point, peak in below:
            verdict = model.verdict(point, budget, exact=True)
            assert verdict.fits and verdict.predicted <= peak, (label, point, peak, verdict)
        for point, peak in above:  # exact mode is the optimistic end: never above the measurement
            assert model.verdict(point, budget, exact=True).predicted <= peak, (label, point, peak)


def test_recorded_exhaustive_search_is_the_headline_workloads_every_point():
    from benchmarks.headline import BUDGET, EXHAUSTIVE, GPT2_REF, exhaustive_best, problem_spec, recorded_key

    space = problem_spec(GPT2_REF, 1).resolve().space
    with open(EXHAUSTIVE["gpt2-ref w1"]) as f:
        rows = list(csv.DictReader(f))
    # every legal point of the space, selective recomputation included (sp and vpp need tp, pp > 1)
    legal = {tuple(str(p[k]) for k in space.names) for p in space.enumerate()}
    assert {recorded_key(r, space.names) for r in rows} == legal
    timed = [r for r in rows if r["step_s"]]
    assert timed and all((int(r["peak"]) <= BUDGET) == bool(r["step_s"]) for r in rows)  # timed iff it fits
    best = exhaustive_best("gpt2-ref w1", space)
    fastest = sorted(timed, key=lambda r: float(r["step_s"]))[:len(best)]
    assert len(best) == 3 and [tuple(str(p[k]) for k in space.names) for p in best] == \
        [recorded_key(r, space.names) for r in fastest]
    assert exhaustive_best("llama-ref w4", space) == []


def test_time_model_ranks_the_recorded_grid_without_calibration():
    """The uncalibrated time model's Spearman over every timed point of the recorded GPT-2 grid
    (steps measured by the trial runner, not predicted) is at least 0.85. The grid's own noise caps
    it near 0.9 (points that differ only in a knob that changes nothing measured up to 35 % apart)."""
    from benchmarks._stats import spearman
    from benchmarks.headline import EXHAUSTIVE, GLOBAL_BATCH, GPT2_REF, SEQ
    from benchmarks.record_grid import GRID
    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.problem import ProblemSpec

    problem = ProblemSpec(GPT2_REF[0], 1, model_overrides=dict(GPT2_REF[1]), global_batch=GLOBAL_BATCH,
                          seq_len=SEQ).resolve()
    model = CostModel(problem, hardware("cpu"))
    assert model.calibration.source == "default"
    with open(EXHAUSTIVE["gpt2-ref w1"]) as f:
        timed = [r for r in csv.DictReader(f) if r["step_s"]]
    # (a knob added since the grid was recorded: the value every recorded point had)
    predicted = [model.time(problem.plan({k: r.get(k, GRID["fixed"].get(k)) for k in problem.space.names})).step
                 for r in timed]
    assert len(timed) >= 100
    assert spearman(predicted, [float(r["step_s"]) for r in timed]) >= 0.85


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pinned_knobs_hold_in_every_strategy(grid, strategy, tmp_path):
    """``tune --knobs tp=2``: every launched point has tp=2 and the search still explores the
    other knobs; the pin is part of the study's settings, so a pinned run refuses an unpinned study."""
    from slapo_tune import UsageError

    results, budget, *_ = grid
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    tuner, runner = replay_tuner(strategy, 0, "analytic", results, budget, trials=6, knobs={"tp": "2"},
                                 storage=storage)
    tuner.run()
    assert len(runner.launched) == 6 and {p["tp"] for p in runner.launched} == {2}
    assert len({point_key(p) for p in runner.launched}) == 6
    assert tuner.study.user_attrs["context"]["knobs"] == {"tp": "2"}
    with pytest.raises(UsageError, match="knobs"):
        replay_tuner(strategy, 0, "analytic", results, budget, trials=1, storage=storage)[0].open()
