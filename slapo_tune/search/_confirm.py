"""Confirm before crowning: the best trials' points measured again, side by side, before one is
crowned.

A trial times a few steps; on a busy machine a lucky one wins. At the end of a study the
candidates (the fastest trial and every other within the measured noise of it, at most ``limit``)
are run again through the tuner's own runner, exactly as trials are, in alternating rounds
(A B C A B C ...), so that whatever load the machine carries meanwhile falls on all of them
alike. Each candidate's confirmed figure is the median of all its rounds' steps (more steps than
a trial), with their spread; the crowned point is the fastest confirmed one.

Where the crowned one's confirmed figure falls below other trials' own figures by more than the
noise (its trial was lucky, and alone within the noise of itself: seen on a busy 2-core machine,
a trial of 150 samples/s confirmed at 114 while another trial measured 134), the confirmation is
widened once: the crowned trial and those contenders (:func:`contenders`, at most ``limit`` in
all) are measured again side by side, and the crown goes to the fastest of that confirmation.

The baseline (the trial of the out-of-the-box schedule, or of the default made to fit, which the
tuner runs first: see ``_driver``) is measured in the same rounds, after the candidates, so that
the gain over it is a ratio of figures taken side by side (:func:`side_by_side_gain`: the median
of the rounds' ratios, and their range); it is never crowned unless it is a candidate.

The confirmation is recorded in the study (user attribute ``confirmation``): which trials it
confirmed (and which was the baseline), and each one's figures, round by round too. It stands while the same trials are the candidates: the
outputs crown from it, and a resumed study whose candidates are unchanged is not confirmed again;
a study whose new trials changed the candidates is confirmed anew at its end (its candidates side
by side: measurements made at other times are not compared).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..plan import TrialStatus
from ..space import point_key
from ._known import trial_status

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

    from runners.trial import TrialResult

RECORD = "confirmation"  # the study's user attribute holding the last confirmation
BASELINE = "out_of_the_box"  # the study's user attribute holding the baseline point (see _driver)
CONFIRM_NOISE = 0.03  # the least relative noise a trial's figure is assumed to carry
CONFIRM_ROUNDS = 3  # rounds of a confirmation: each candidate runs a trial's steps per round


def best_trial(study: Study) -> FrozenTrial | None:
    """The fastest trial that ran ``ok``, or None."""
    best = None
    for t in study.get_trials(deepcopy=False):
        if trial_status(t) is TrialStatus.OK and t.values and (best is None or t.values[0] > best.values[0]):
            best = t
    return best


def _spread(trial: FrozenTrial) -> float:
    return (trial.user_attrs.get("result") or {}).get("spread") or 0.0


def candidates(study: Study, limit: int) -> list[FrozenTrial]:
    """The trials to confirm: the fastest ``ok`` trial, and the others whose throughput is within
    the noise of it (the larger of CONFIRM_NOISE and either trial's step-time spread), fastest
    first, at most ``limit``."""
    ok = [t for t in study.get_trials(deepcopy=False) if trial_status(t) is TrialStatus.OK and t.values]
    if limit < 1 or not ok:
        return []
    ok.sort(key=lambda t: (-t.values[0], t.number))
    best = ok[0]
    near = [t for t in ok if t.values[0] >= best.values[0] * (1 - max(CONFIRM_NOISE, _spread(best), _spread(t)))]
    return near[:limit]


def why_confirmed(chosen: list[FrozenTrial]) -> dict[int, str]:
    """Why each of ``chosen`` (:func:`candidates`, fastest first) is measured again, in a few words."""
    if not chosen:
        return {}
    best = chosen[0]
    why = {best.number: "the fastest trial"}
    for t in chosen[1:]:
        noise = max(CONFIRM_NOISE, _spread(best), _spread(t))
        why[t.number] = f"within {noise:.0%} of the fastest, a trial's noise"
    return why


def baseline_trial(study: Study) -> FrozenTrial | None:
    """The trial of the study's baseline point (``BASELINE``): the first that ran ok, else the
    first that ran to an outcome of the point's own (oom, crash, ...); None when it has not run."""
    record = study.user_attrs.get(BASELINE)
    if not record:
        return None
    key = point_key(record["point"])
    ran = [t for t in study.get_trials(deepcopy=False)
           if t.user_attrs.get("point") is not None and point_key(t.user_attrs["point"]) == key
           and trial_status(t) is not None and (trial_status(t).launched or trial_status(t) is TrialStatus.INVALID)]
    return next((t for t in ran if trial_status(t) is TrialStatus.OK), ran[0] if ran else None)


def side_by_side_gain(record: dict[str, Any], number: int) -> dict[str, Any] | None:
    """Trial ``number`` over the baseline in the same confirmation ``record``, round by round
    (each round measures both within minutes: a paired comparison, the machine's load alike):
    ``gain`` the median of the rounds' ratios (of each round's own figures), ``low`` and ``high``
    their range, ``rounds`` those where both measured; where no round measured both, the ratio of
    the pooled figures. (The pooled figures' ratio can fall outside the rounds' range: their
    medians may come from different rounds.) None when the record has no baseline or either
    measured nothing."""
    import statistics

    baseline = record.get("baseline")
    if baseline is None:
        return None
    ours, theirs = record["figures"].get(str(number)), record["figures"].get(str(baseline))
    if not ours or not theirs or not ours["samples_per_s"] or not theirs["samples_per_s"]:
        return None
    ratios = [a / b for a, b in zip(ours.get("rounds") or [], theirs.get("rounds") or []) if a and b]
    gain = statistics.median(ratios) if ratios else ours["samples_per_s"] / theirs["samples_per_s"]
    return {"gain": gain, "low": min(ratios, default=gain), "high": max(ratios, default=gain), "rounds": len(ratios)}


def contenders(study: Study, record: dict[str, Any]) -> list[FrozenTrial]:
    """The unconfirmed ``ok`` trials whose own figure beats the crowned one's confirmed figure by
    more than CONFIRM_NOISE, fastest first: the crowned trial's figure was a lucky one, and these
    may be faster (the side-by-side measurement has to tell)."""
    if record.get("crowned") is None:
        return []
    crowned = record["figures"][str(record["crowned"])]["samples_per_s"]
    out = [t for t in study.get_trials(deepcopy=False) if trial_status(t) is TrialStatus.OK
           and t.values and t.number not in record["candidates"] and t.values[0] > crowned * (1 + CONFIRM_NOISE)]
    return sorted(out, key=lambda t: (-t.values[0], t.number))


def recorded(study: Study) -> dict[str, Any] | None:
    """The study's last confirmation, while it stands: the candidates it started from are still
    the study's (``first``: a widened confirmation's, see :func:`contenders`)."""
    record = study.user_attrs.get(RECORD)
    if not record:
        return None
    if [t.number for t in candidates(study, record["limit"])] != record.get("first", record["candidates"]):
        return None
    return record


def crowned(study: Study) -> tuple[FrozenTrial | None, dict[str, Any] | None]:
    """(the crowned trial, its confirmed figures): the fastest confirmed candidate of the standing
    confirmation, else the fastest trial, unconfirmed (figures None)."""
    record = recorded(study)
    if record is not None and record.get("crowned") is not None:
        number = record["crowned"]
        trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
        return trial, record["figures"][str(number)]
    return best_trial(study), None


def measured_side_by_side(chosen: list[FrozenTrial], baseline: FrozenTrial | None) -> list[FrozenTrial]:
    """The trials a confirmation runs in each round: ``chosen``, then the baseline unless it is one of them."""
    return chosen + ([baseline] if baseline is not None and baseline.number not in {t.number for t in chosen} else [])


def confirmation(chosen: list[FrozenTrial], runs: dict[int, list[TrialResult]], global_batch: int, limit: int,
                 rounds: int, baseline: FrozenTrial | None = None) -> dict[str, Any]:
    """The record of a confirmation: each measured trial's figures from its rounds' steps pooled
    (``samples_per_s`` of their median, ``spread``, the steps, the errors of rounds that failed,
    ``rounds``: each round's own figure, None where it failed), the crowned trial (the fastest
    candidate; None when no candidate measured anything) and the ``baseline`` measured beside them."""
    # torch-free: every --help imports this module (the tune command imports the tuner); runners imports torch
    from runners.trial import step_figures

    figures: dict[str, dict[str, Any]] = {}
    for t in measured_side_by_side(chosen, baseline):
        steps = [s for r in runs[t.number] if r.status == TrialStatus.OK for s in r.step_times]
        failed = [f"{r.status}: {r.error}" for r in runs[t.number] if r.status != TrialStatus.OK]
        entry: dict[str, Any] = {"samples_per_s": None, "spread": None, "step_times": steps, "failed": failed,
                                 "trial_samples_per_s": t.values[0],
                                 "rounds": [global_batch / step_figures(r.step_times)[0]
                                            if r.status == TrialStatus.OK and r.step_times else None
                                            for r in runs[t.number]]}
        if steps:
            median, _, _, spread = step_figures(steps)
            entry.update(samples_per_s=global_batch / median, spread=spread)
        figures[str(t.number)] = entry
    measured = [t.number for t in chosen if figures[str(t.number)]["samples_per_s"] is not None]
    best = max(measured, key=lambda n: figures[str(n)]["samples_per_s"], default=None)  # ties: the faster trial
    return {"candidates": [t.number for t in chosen], "limit": limit, "rounds": rounds, "figures": figures,
            "crowned": best, "baseline": None if baseline is None else baseline.number}
