"""The runner interface: run one trial spec, always come back with a :class:`TrialResult`."""

from __future__ import annotations

import abc
import time
from typing import Any

from slapo_tune.errors import SlapoTuneError
from slapo_tune.launch import RankFailure
from slapo_tune.plan import TrialStatus

from .trial import TrialResult, TrialSpec, failure, resolve, summarize


class Runner(abc.ABC):
    """Runs trials in isolation. Subclasses start the ranks (:meth:`_execute`); this base class
    checks the point, times the trial and turns every failure into a result, so that one bad
    trial never stops the search."""

    name = "runner"

    def run(self, spec: TrialSpec) -> TrialResult:
        t0 = time.perf_counter()
        try:
            spec, point = resolve(spec)
        except SlapoTuneError as exc:
            return failure(spec, dict(spec.knobs), TrialStatus.INVALID, str(exc), time.perf_counter() - t0,
                           self.name)
        try:
            per_rank = self._execute(spec, point)
        except RankFailure as exc:
            return failure(spec, point, exc.kind, str(exc), time.perf_counter() - t0, self.name,
                           rank=exc.rank, exc_type=exc.exc_type, details=exc.details)
        return summarize(spec, point, per_rank, time.perf_counter() - t0, self.name)

    @abc.abstractmethod
    def _execute(self, spec: TrialSpec, point: dict[str, Any]) -> list[dict[str, Any]]:
        """Run :func:`~runners.trial.trial_rank` on every rank; return their reports by rank, or
        raise :class:`~slapo_tune.launch.RankFailure` (kind ``crash``, ``timeout``, or an
        infrastructure failure: ``lost``, ``placement_timeout``)."""

    def cancel(self) -> None:  # noqa: B027 - a runner whose trials cannot outlive it
        """Kill every trial in flight now (Ctrl-C); their ``run`` calls return failures."""

    def close(self) -> None:  # noqa: B027 - most runners hold nothing between trials
        """Release what the runner holds (workers, reservations)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
