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

The confirmation is recorded in the study (user attribute ``confirmation``): which trials it
confirmed, and each one's figures. It stands while the same trials are the candidates: the
outputs crown from it, and a resumed study whose candidates are unchanged is not confirmed again;
a study whose new trials changed the candidates is confirmed anew at its end (its candidates side
by side: measurements made at other times are not compared).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..plan import TrialStatus
from ._known import trial_status

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

    from runners.trial import TrialResult

RECORD = "confirmation"  # the study's user attribute holding the last confirmation
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


def confirmation(chosen: list[FrozenTrial], runs: dict[int, list[TrialResult]], global_batch: int, limit: int,
                 rounds: int) -> dict[str, Any]:
    """The record of a confirmation: each candidate's figures from its rounds' steps pooled
    (``samples_per_s`` of their median, ``spread``, the steps, the errors of rounds that failed)
    and the crowned trial (None when no candidate measured anything)."""
    from runners.trial import step_figures

    figures: dict[str, dict[str, Any]] = {}
    for t in chosen:
        steps = [s for r in runs[t.number] if r.status == TrialStatus.OK for s in r.step_times]
        failed = [f"{r.status}: {r.error}" for r in runs[t.number] if r.status != TrialStatus.OK]
        entry: dict[str, Any] = {"samples_per_s": None, "spread": None, "step_times": steps, "failed": failed,
                                 "trial_samples_per_s": t.values[0]}
        if steps:
            median, _, _, spread = step_figures(steps)
            entry.update(samples_per_s=global_batch / median, spread=spread)
        figures[str(t.number)] = entry
    measured = [t.number for t in chosen if figures[str(t.number)]["samples_per_s"] is not None]
    best = max(measured, key=lambda n: figures[str(n)]["samples_per_s"], default=None)  # ties: the faster trial
    return {"candidates": [t.number for t in chosen], "limit": limit, "rounds": rounds, "figures": figures,
            "crowned": best}
