"""Confirm before crowning: the trials within the noise of the best are measured again through the
tuner's runner, side by side in alternating rounds, and the crowned point and its figures come
from that confirmation (the trials table and best_schedule.json say so); a resumed study whose
candidates are unchanged is not confirmed again, one whose new trials changed them is.
The baseline (the out-of-the-box point, the study's first trial) is measured in the same rounds,
after the candidates, and the gain over it is stated measured, with its range round by round.
Replayed studies (scripted throughputs), no training."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pandas as pd
import pytest

from benchmarks.search_strategies import load_grid, replay_tuner
from runners.replay import ReplayRunner
from slapo_tune.plan import TrialStatus
from slapo_tune.schedule_file import read_schedule
from slapo_tune.space import point_key

# the grid strategy launches the space's points in order: point i measures TRIAL[i] samples/s as a
# trial; measured again it measures TRUE[i]. Trial 1 was lucky: within 3 % of it are trials 2 and
# 4, and measured again trial 2 is the fastest.
TRIAL = [10.0, 20.0, 19.7, 12.0, 19.5]
TRUE = [10.0, 18.0, 19.0, 12.0, 18.5]
ROUND_FACTOR = {1: 1.1, 2: 1.0, 3: 0.95}  # the machine's load, round by round: the median round is TRUE
# the spread of a confirmation's pooled steps: its quartiles are the fastest and slowest rounds' steps
SPREAD = (1 / 0.95 - 1 / 1.1) / 1.0
BASELINE = "baseline"  # the out-of-the-box point's place in a confirmation's order


@pytest.fixture(scope="module")
def grid():
    return load_grid()


class _Lucky(ReplayRunner):
    """Answers scripted throughputs by point (see TRIAL and TRUE), with step times to match, and
    records the order of the confirmation's runs as (point index, round)."""

    def __init__(self, results, order: list[str], trial: dict[str, float], true: dict[str, float],
                 baseline: str | None = None):
        super().__init__(results)
        self.index = {key: i for i, key in enumerate(order)} | ({baseline: BASELINE} if baseline else {})
        self.trial, self.true = trial, true
        self.confirm_order: list[tuple[int, int]] = []

    def run(self, spec):
        recorded = super().run(spec)
        point = self.remeasured[-1][0] if spec.confirm_round else self.launched[-1]
        key = point_key(point)
        if spec.confirm_round:
            self.confirm_order.append((self.index[key], spec.confirm_round))
        # (the baseline measures the same every round: the ratio to it varies round by round)
        factor = 1.0 if self.index.get(key) == BASELINE else ROUND_FACTOR.get(spec.confirm_round)
        speed = self.true[key] * factor if spec.confirm_round else self.trial[key]
        steps = [spec.problem.global_batch / speed] * spec.measured_steps
        return dataclasses.replace(recorded, status=TrialStatus.OK, knobs=point, samples_per_s=speed, step_times=steps,
                                   spread=0.0, error="")


def _tuner(grid, trials: int, trial_speeds=TRIAL, true_speeds=TRUE, baseline_speeds=None, **config):
    """(tuner, runner, the space's first points' keys); ``baseline_speeds``: (as a trial, measured
    again) of the out-of-the-box point, which the tuner then runs as its baseline (its first trial)."""
    from slapo_tune.plan import OUT_OF_THE_BOX

    results, budget = grid
    tuner, _ = replay_tuner("grid", 0, "none", results, budget, trials=1)  # the space's order
    order = [point_key(p) for p in itertools.islice(tuner.space.enumerate(), len(trial_speeds))]
    trial, true, baseline = dict(zip(order, trial_speeds)), dict(zip(order, true_speeds)), None
    if baseline_speeds is not None:
        baseline = point_key(tuner.space.complete(OUT_OF_THE_BOX))
        assert baseline not in order
        trial[baseline], true[baseline] = baseline_speeds
        config["baseline"] = True
    runner = _Lucky(results, order, trial, true, baseline)
    tuner, _ = replay_tuner("grid", 0, "none", results, budget, trials=trials, runner=runner, **config)
    return tuner, runner, order


def test_the_crowned_point_and_its_figures_come_from_the_confirmation(grid, tmp_path, monkeypatch):
    from slapo_tune.search import _outputs

    tuner, runner, order = _tuner(grid, trials=5)
    summary = tuner.run()
    # the three candidates, alternating, three rounds of a trial's steps each: more steps than a trial
    assert runner.confirm_order == [(i, r) for r in (1, 2, 3) for i in (1, 2, 4)]
    assert len(runner.launched) == summary["launched"] == 5  # confirmation runs are no trials of the search
    assert point_key(summary["best_point"]) == order[2] and summary["best"] == pytest.approx(19.0)
    confirmed = summary["confirmed"]
    assert len(confirmed["step_times"]) == 3 * tuner.config.measured_steps
    assert confirmed["spread"] == pytest.approx(SPREAD)
    assert confirmed["trial_samples_per_s"] == pytest.approx(19.7)

    monkeypatch.setattr(_outputs, "write_report", lambda *args: None)  # the plots are not what this checks
    _outputs.Outputs(tmp_path, tuner.problem, "grid").finish(tuner.study)
    frame = pd.read_csv(tmp_path / "trials.csv")
    frame["key"] = [point_key({k: row[k] for k in tuner.space.names}) for _, row in frame.iterrows()]
    by_key = frame.set_index("key")
    assert by_key.loc[order[1], "confirmed_throughput"] == pytest.approx(18.0)
    assert by_key.loc[order[4], "confirmed_throughput"] == pytest.approx(18.5)
    assert by_key.loc[order[0], "confirmed_throughput"] != by_key.loc[order[0], "confirmed_throughput"]  # NaN
    assert by_key.loc[order[2], "confirmed_spread"] == pytest.approx(SPREAD)
    assert frame.crowned.sum() == 1 and bool(by_key.loc[order[2], "crowned"])
    schedule = read_schedule(tmp_path / "best_schedule.json")
    assert point_key(schedule["knobs"]) == order[2]
    measured = schedule["measured"]
    assert measured["confirmed"] and measured["samples_per_s"] == pytest.approx(19.0)
    assert measured["trial_samples_per_s"] == pytest.approx(19.7) and len(measured["step_times"]) == 9


@pytest.mark.parametrize("confirm,runs,crowned", [(0, 0, 1), (1, 3, 1), (2, 6, 2)])
def test_confirm_n_measures_at_most_n_candidates(grid, confirm, runs, crowned):
    """--confirm 0 crowns the best trial as measured; --confirm 1 still measures it again (its
    figure then comes from more steps); --confirm 2 the two fastest trials. The progress lines and
    the summary's last line say what was confirmed."""
    import io
    from pathlib import Path

    from slapo_tune.cli._live import TuneView
    from slapo_tune.cli.tune import best_lines
    from slapo_tune.plan import readable

    stream = io.StringIO()
    tuner, runner, order = _tuner(grid, trials=5, confirm=confirm, report=TuneView("plain", grid[1], stream=stream))
    summary = tuner.run()
    assert len(runner.confirm_order) == runs
    assert point_key(summary["best_point"]) == order[crowned]
    assert summary["best"] == pytest.approx((TRIAL if confirm == 0 else TRUE)[crowned])
    assert (summary["confirmed"] is None) == (confirm == 0)
    lines = stream.getvalue().splitlines()
    assert sum(re.match(r"\[confirm \d+/\d+\] #\d+ round \d/3: ", line) is not None for line in lines) == runs
    assert sum(line.startswith("[confirm] crowned #") for line in lines) == (confirm > 0)
    # why each is confirmed, once, as the phase begins
    assert sum(line.startswith("[confirm] measured again side by side") for line in lines) == (confirm > 0)
    assert sum("the fastest trial" in line for line in lines) == (confirm > 0)
    said = best_lines(summary, Path("best_schedule.json"), 80)
    assert all(len(line) <= 80 for line in said)
    line = " ".join(s.strip() for s in said)
    assert line.startswith(f"best: {summary['best']:.2f} samples/s")
    assert ("confirmed (median of 9 steps, spread 14.4%; its trial measured" in line) == (confirm > 0)
    assert line.endswith(readable(summary["best_point"]))  # the knobs, as the live view shows a trial's


def test_a_lucky_trial_confirmed_below_other_trials_is_confirmed_again_beside_them(grid, tmp_path):
    """Trial 1 was lucky (20 as a trial, 14 measured again) and alone within the noise of itself;
    trials 2 and 4 measured 17 and 16, above its confirmed 14 by more than the noise: they are
    measured again beside it, side by side, and the fastest of those (trial 2, 16.5) is crowned. A
    resumed study does not confirm again."""
    import io

    from slapo_tune.cli._live import TuneView

    storage = f"journal:{tmp_path / 'study.journal'}"
    speeds = dict(trial_speeds=[10.0, 20.0, 17.0, 12.0, 16.0], true_speeds=[10.0, 14.0, 16.5, 12.0, 15.5])
    stream = io.StringIO()
    tuner, runner, order = _tuner(grid, trials=5, storage=storage, study="s", **speeds,
                                  report=TuneView("plain", grid[1], stream=stream))
    summary = tuner.run()
    assert runner.confirm_order == [(1, r) for r in (1, 2, 3)] + [(i, r) for r in (1, 2, 3) for i in (1, 2, 4)]
    # the view says why it measures again, once per confirmation
    lines = stream.getvalue().splitlines()
    assert sum(line.startswith("[confirm] measured again side by side") for line in lines) == 1
    assert sum(line.startswith("[confirm] the crowned trial confirmed below other trials' figures") for line in lines) == 1
    assert "#1 (20.00 samples/s as a trial): crowned, but confirmed at 14.00 samples/s" in stream.getvalue()
    assert point_key(summary["best_point"]) == order[2] and summary["best"] == pytest.approx(16.5)
    assert summary["confirmed"]["trial_samples_per_s"] == pytest.approx(17.0)
    again, runner, _ = _tuner(grid, trials=5, storage=storage, study="s", **speeds)
    summary = again.run()
    assert runner.confirm_order == [] and point_key(summary["best_point"]) == order[2]


def test_a_resumed_study_is_confirmed_again_only_when_its_candidates_changed(grid, tmp_path):
    storage = f"journal:{tmp_path / 'study.journal'}"
    first, runner, order = _tuner(grid, trials=5, storage=storage, study="s")
    first.run()
    assert len(runner.confirm_order) == 9
    # resumed, finished: the standing confirmation covers the same candidates
    again, runner, _ = _tuner(grid, trials=5, storage=storage, study="s")
    summary = again.run()
    assert runner.confirm_order == [] and runner.launched == []
    assert point_key(summary["best_point"]) == order[2] and summary["best"] == pytest.approx(19.0)
    # a longer study: its 7th point measures faster than every trial so far, the candidates change;
    # unconfirmed (--confirm 0), the old confirmation no longer stands: the fastest trial is crowned
    speeds = dict(trial_speeds=[*TRIAL, 11.0, 30.0], true_speeds=[*TRUE, 11.0, 29.0])
    more, runner, order = _tuner(grid, trials=7, storage=storage, study="s", confirm=0, **speeds)
    summary = more.run()
    assert runner.confirm_order == [] and len(runner.launched) == 2
    assert point_key(summary["best_point"]) == order[6] and summary["best"] == 30.0 and summary["confirmed"] is None
    # resumed with confirmation: the new candidate alone is within the noise of itself
    confirmed, runner, order = _tuner(grid, trials=7, storage=storage, study="s", **speeds)
    summary = confirmed.run()
    assert runner.confirm_order == [(6, 1), (6, 2), (6, 3)] and runner.launched == []
    assert point_key(summary["best_point"]) == order[6] and summary["best"] == pytest.approx(29.0)


def test_guided_stops_early_then_confirms_and_a_resume_neither_searches_nor_confirms_again(grid):
    """The default strategy on the replayed grid's tp=2 points (answers as recorded, again when
    measured again): it stops early (11 of 50 points), confirms, and crowns the fastest recorded
    point it measured; resumed, the finished study launches nothing and confirms nothing."""
    import tempfile

    results, budget = grid
    with tempfile.TemporaryDirectory() as tmp:
        storage = f"journal:{tmp}/study.journal"
        tuner, runner = replay_tuner("guided", 0, "none", results, budget, trials=60, storage=storage, study="s",
                                     knobs={"tp": 2})
        summary = tuner.run()
        assert tuner.sampler.stopped_early and summary["stop"] == "space exhausted" and summary["launched"] < 50
        recorded = {point_key(r.knobs): r.samples_per_s for r in results if r.status == "ok"}
        measured = [recorded[point_key(p)] for p in runner.launched if point_key(p) in recorded]
        assert runner.remeasured and summary["best"] == pytest.approx(max(measured))  # the replay is deterministic
        again, rerun = replay_tuner("guided", 0, "none", results, budget, trials=60, storage=storage, study="s",
                                    knobs={"tp": 2})
        resumed = again.run()
        assert rerun.launched == [] and rerun.remeasured == []
        assert resumed["best_point"] == summary["best_point"] and resumed["best"] == summary["best"]


def _report(tuner, out, capsys) -> tuple[str, dict, str]:
    """(the summary as printed, best_schedule.json's ``measured``, ``slapo-tune show``'s output),
    each with its whitespace collapsed, of a finished replayed study, its outputs written to ``out``."""
    import io

    from slapo_tune.cli import main
    from slapo_tune.cli._live import print_summary
    from slapo_tune.search import _outputs

    summary = tuner.summary("trials")
    stream = io.StringIO()
    print_summary(summary, tuner.config.memory_budget, stream=stream)
    _outputs.Outputs(out, tuner.problem, "grid").finish(tuner.study, report=False)
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    table = re.sub(r"[│┌┐└┘├┤─┬┴┼]", " ", stream.getvalue())  # a wrapped cell's rows read as one text
    return " ".join(table.split()), read_schedule(out / "best_schedule.json")["measured"], \
        " ".join(capsys.readouterr().out.split())


def test_the_baseline_runs_first_and_is_confirmed_side_by_side_with_the_crowned_point(grid, tmp_path, capsys):
    """The out-of-the-box point is the study's first trial, and is measured in every confirmation
    round after the candidates (it measures 9.5 every round, the candidates 1.1, 1.0, 0.95 times
    their own): the gain is 19.0 / 9.5, per round 2.2 down to 1.9, in the summary, in
    best_schedule.json (its figure beside the crowned one's) and in show."""
    from slapo_tune.plan import OUT_OF_THE_BOX

    tuner, runner, order = _tuner(grid, trials=6, baseline_speeds=(9.0, 9.5))
    summary = tuner.run()
    assert runner.launched[0] == tuner.space.complete(OUT_OF_THE_BOX) and len(runner.launched) == 6
    assert runner.confirm_order == [(i, r) for r in (1, 2, 3) for i in (1, 2, 4, BASELINE)]
    assert point_key(summary["best_point"]) == order[2] and summary["best"] == pytest.approx(19.0)
    gain = summary["out_of_the_box"]
    assert gain["how"] == "side by side" and gain["trial"] == 0 and gain["samples_per_s"] == pytest.approx(9.5)
    assert (gain["gain"], gain["low"], gain["high"], gain["rounds"]) == pytest.approx((2.0, 1.9, 2.2, 3))
    printed, measured, shown = _report(tuner, tmp_path, capsys)
    assert ("over out of the box 2.00x measured side by side (per round 1.90-2.20x, 3 round(s)); out of the box: "
            "trial 0, 9.50 samples/s, step spread 0.0%") in printed
    assert measured["samples_per_s"] == pytest.approx(19.0) and measured["baseline_samples_per_s"] == pytest.approx(9.5)
    assert measured["gain"] == pytest.approx(2.0) and measured["baseline_trial"] == 0
    assert (measured["gain_low"], measured["gain_high"]) == pytest.approx((1.9, 2.2))
    assert measured["baseline_knobs"] == tuner.space.complete(OUT_OF_THE_BOX)
    assert "over out of the box: 2.00x measured side by side (per round 1.90-2.20x, 3 round(s))" in shown


def test_a_crowned_baseline_is_said_to_be_the_baseline(grid, tmp_path, capsys):
    """The out-of-the-box point is the fastest, alone within the noise of itself: it is the one
    candidate, measured once per round, and crowned: 1.00x."""
    tuner, runner, _ = _tuner(grid, trials=6, baseline_speeds=(25.0, 24.0))
    summary = tuner.run()
    assert runner.confirm_order == [(BASELINE, r) for r in (1, 2, 3)]
    assert summary["out_of_the_box"]["how"] == "same" and summary["out_of_the_box"]["gain"] == 1.0
    printed, measured, shown = _report(tuner, tmp_path, capsys)
    assert "1.00x: the crowned point is the baseline itself (trial 0" in printed
    assert measured["baseline_samples_per_s"] == measured["samples_per_s"] == pytest.approx(24.0)
    assert "over out of the box: 1.00x: the crowned point is the baseline itself" in shown


def test_without_confirmation_the_gain_is_the_two_trials_measured_apart(grid, tmp_path, capsys):
    tuner, runner, _ = _tuner(grid, trials=6, baseline_speeds=(8.0, 9.5), confirm=0)
    summary = tuner.run()
    assert runner.confirm_order == [] and summary["out_of_the_box"]["how"] == "trials"
    printed, measured, _ = _report(tuner, tmp_path, capsys)
    assert "2.50x measured by the two trials apart, not side by side; out of the box: trial 0, 8.00" in printed
    assert measured["baseline_samples_per_s"] == 8.0 and measured["gain_how"] == "trials"


def test_a_baseline_that_cannot_fit_is_made_to_fit(grid):
    """With a budget the out-of-the-box point cannot fit, the baseline is the fitting point that
    changes the fewest of its knobs (no fitting point changes fewer), the study's first trial, and
    its line and the summary say it was made to fit."""
    import io

    from slapo_tune.cli._live import TuneView
    from slapo_tune.plan import OUT_OF_THE_BOX
    from slapo_tune.search._report import gain_text

    results, _ = grid
    probe, _ = replay_tuner("grid", 0, "analytic", results, 2**30, trials=1)
    default = probe.space.complete(OUT_OF_THE_BOX)
    budget = probe.cost.memory(default).lower - 1  # the analytic verdict's optimistic end: it cannot fit
    stream = io.StringIO()
    tuner, runner = replay_tuner("grid", 0, "analytic", results, budget, trials=2, baseline=True, confirm=0,
                                 report=TuneView("plain", budget, stream=stream))
    tuner.run()
    record = tuner.study.user_attrs["out_of_the_box"]
    made = record["point"]
    assert record["out_of_the_box"] == default and made != default and record["fits"]
    assert tuner.cost.verdict(made, budget).fits and runner.launched[0] == made

    def changed(point):
        return sum(point[k] != v for k, v in default.items())

    points = list(tuner.space.enumerate())
    fitting = [p for p, fits in zip(points, tuner.cost.predictions(points, budget).fits) if fits]
    assert changed(made) == min(changed(p) for p in fitting)
    assert "#0   ok      (out of the box, made to fit)" in stream.getvalue()
    summary = tuner.summary("trials")
    assert "(out of the box made to fit: " in gain_text(summary["out_of_the_box"])


def test_a_resumed_study_runs_and_confirms_its_baseline_once(grid, tmp_path):
    """Resumed when finished, the study neither runs its baseline again nor leaves it queued, and
    its confirmation (the baseline's included) stands; resumed for more trials, the new ones are
    searched (the baseline is not queued again) and the changed candidates confirmed beside it."""
    from optuna.trial import TrialState

    storage = f"journal:{tmp_path / 'study.journal'}"
    first, runner, order = _tuner(grid, trials=6, baseline_speeds=(9.0, 9.5), storage=storage, study="s")
    first.run()
    assert len(runner.launched) == 6 and len(runner.confirm_order) == 12
    again, runner, _ = _tuner(grid, trials=6, baseline_speeds=(9.0, 9.5), storage=storage, study="s")
    summary = again.run()
    assert runner.launched == [] and runner.confirm_order == []
    assert not again.study.get_trials(states=(TrialState.WAITING,))
    assert summary["out_of_the_box"]["how"] == "side by side" and summary["out_of_the_box"]["gain"] == pytest.approx(2.0)
    speeds = dict(trial_speeds=[*TRIAL, 11.0, 30.0], true_speeds=[*TRUE, 11.0, 29.0])
    more, runner, order = _tuner(grid, trials=8, baseline_speeds=(9.0, 9.5), storage=storage, study="s", **speeds)
    summary = more.run()
    assert [point_key(p) for p in runner.launched] == order[5:7]
    assert runner.confirm_order == [(i, r) for r in (1, 2, 3) for i in (6, BASELINE)]
    assert summary["out_of_the_box"]["gain"] == pytest.approx(29.0 / 9.5)


def test_a_finished_study_begun_without_a_baseline_queues_none_when_resumed(grid, tmp_path):
    """A study begun without a baseline trial (by an earlier slapo-tune) resumed when its trials
    are spent: nothing runs, nothing is left queued for a later run, the gain stays predicted."""
    from optuna.trial import TrialState

    storage = f"journal:{tmp_path / 'study.journal'}"
    _tuner(grid, trials=5, storage=storage, study="s")[0].run()
    again, runner, _ = _tuner(grid, trials=5, baseline_speeds=(9.0, 9.5), storage=storage, study="s")
    summary = again.run()
    assert runner.launched == [] and runner.confirm_order == []
    assert not again.study.get_trials(states=(TrialState.WAITING,))
    assert summary["out_of_the_box"]["how"] == "predicted"


def test_the_gain_is_paired_round_by_round_and_within_its_range():
    """Measured in rounds (as seen on a busy machine): the crowned point's pooled median comes from
    one round, the baseline's from another, so their ratio (215.9 / 131.4 = 1.64) lies outside
    every round's own (1.78, 1.93, 1.80); the gain is the median of the rounds' ratios."""
    from slapo_tune.search._confirm import side_by_side_gain

    record = {"baseline": 0, "figures": {
        "3": {"samples_per_s": 215.9, "rounds": [214.6, 253.1, 215.9]},
        "0": {"samples_per_s": 131.4, "rounds": [120.4, 131.4, 119.8]}}}
    gain = side_by_side_gain(record, 3)
    assert gain["low"] <= gain["gain"] <= gain["high"] and gain["rounds"] == 3
    assert gain["gain"] == pytest.approx(215.9 / 119.8) and gain["low"] == pytest.approx(214.6 / 120.4)
    assert gain["high"] == pytest.approx(253.1 / 131.4)
    record["figures"]["0"]["rounds"] = [None, None, None]  # no round measured both: the pooled figures
    assert side_by_side_gain(record, 3)["gain"] == pytest.approx(215.9 / 131.4)
