"""What a study knows about points, read from its trials alone (the driver keeps no copy that a
resume would have to rebuild).

Every trial the driver asks carries its point (user attribute ``point``) and, once told, how it
ended (``status``). A trial failed by a resumed driver because a killed one left it running has a
point and no status: it reads as :attr:`TrialStatus.INTERRUPTED` (it is failed through Optuna's
public ``Study.tell``); one left running with its status recorded (the driver was killed, or its
journal's state record salvaged away, between the two) has that status overwritten as
interrupted before it is failed.
An infrastructure failure (``lost``, ``placement_timeout``) leaves its point unknown until the
retry queued for it ends; a retry's infrastructure failure settles it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..plan import TrialStatus
from ..space import point_key

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial


def trial_status(trial: FrozenTrial) -> TrialStatus | None:
    """How ``trial`` ended; None while it runs or waits, or when it has no point (it never had
    one, or the journal record holding it was salvaged away: what it measured cannot be told
    apart from another point's, so it counts for nothing)."""
    if "point" not in trial.user_attrs:
        return None
    status = trial.user_attrs.get("status")
    if status is not None:
        return TrialStatus(status)
    if trial.state.is_finished():
        return TrialStatus.INTERRUPTED
    return None


def settled_status(trial: FrozenTrial) -> TrialStatus | None:
    """How ``trial`` settled its point; None when it did not: it runs or waits, it was a repeat
    (answered from an earlier trial), or its point is queued again (an interrupted trial, or an
    infrastructure failure that is not itself a retry: its retry settles the point)."""
    status = trial_status(trial)
    if status in (None, TrialStatus.DUPLICATE, TrialStatus.INTERRUPTED):
        return None
    if status.infrastructure and "retry_of" not in trial.user_attrs:
        return None
    return status


@dataclass(frozen=True)
class Known:
    """A snapshot: the points told so far and the points running now, by point key."""

    status: Mapping[str, TrialStatus]  # how each told point ended (repeats and interrupted trials left out)
    values: Mapping[str, list[float]]  # the values told for it (points whose trial completed)
    running: Mapping[str, int]  # the number of the trial running it
    read: int  # finished trials read so far (grows with every tell: a cache key for what follows from it)
    # the peak each point that ran measured (bytes, its largest rank's)
    peaks: Mapping[str, float] = field(default_factory=dict)

    def __contains__(self, key: object) -> bool:
        """Told or running: not to be proposed again."""
        return key in self.status or key in self.running


class KnownReader:
    """Reads :class:`Known` from a study. A finished trial never changes, so each is read once,
    and the scan starts after the first trials that are all finished: reading stays cheap at
    thousands of trials (it runs at every ask)."""

    def __init__(self) -> None:
        self._status: dict[str, TrialStatus] = {}
        self._values: dict[str, list[float]] = {}
        self._peaks: dict[str, float] = {}
        self._read: set[int] = set()  # numbers of the finished trials read
        self._settled = 0  # every trial listed before this index is finished and read

    def __call__(self, study: Study) -> Known:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)  # in number order; new trials only ever append
        running: dict[str, int] = {}
        settled = True
        for index in range(self._settled, len(trials)):
            t = trials[index]
            if t.state.is_finished():
                if t.number not in self._read:
                    self._read.add(t.number)
                    self._learn(t)
                if settled:
                    self._settled = index + 1
                continue
            settled = False
            point = t.user_attrs.get("point")
            if t.state == TrialState.RUNNING and point is not None:  # a trial still being asked has none yet
                running[point_key(point)] = t.number
        return Known(dict(self._status), dict(self._values), running, len(self._read), dict(self._peaks))

    def _learn(self, t: FrozenTrial) -> None:
        from optuna.trial import TrialState

        status, point = settled_status(t), t.user_attrs.get("point")
        if point is None or status is None:
            return  # a repeat teaches nothing new; a point queued again is unknown until its retry ends
        key = point_key(point)
        self._status[key] = status
        if t.state == TrialState.COMPLETE:
            self._values[key] = list(t.values)
            peaks = (t.user_attrs.get("result") or {}).get("peak_memory")
            if status is TrialStatus.OK and peaks:
                self._peaks[key] = float(max(peaks))
