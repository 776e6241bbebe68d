"""A runner that answers trials from a table of recorded results: for testing and benchmarking
search strategies on a measured grid without running anything."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from slapo_tune.plan import TrialStatus
from slapo_tune.space import point_key

from ._base import Runner
from .trial import TrialResult, TrialSpec, resolve


class ReplayRunner(Runner):
    """Returns the recorded :class:`TrialResult` of each point; records every point it is asked
    for in ``launched`` (so a test can check what a search would have run). A point measured
    again (a spec's ``confirm_round`` > 0: the tuner's confirmation) gets the same recorded
    answer, deterministically, and is recorded in ``remeasured`` instead: it is no trial of the
    search."""

    name = "replay"

    def __init__(self, results: Iterable[TrialResult]):
        self.table = {point_key(r.knobs): r for r in results}
        self.launched: list[dict[str, Any]] = []
        self.remeasured: list[tuple[dict[str, Any], int]] = []  # (point, confirmation round)

    def _execute(self, spec: TrialSpec, point: dict[str, Any]) -> list[dict[str, Any]]:
        raise NotImplementedError  # run() is overridden: nothing is executed

    def run(self, spec: TrialSpec) -> TrialResult:
        _, point = resolve(spec)
        if spec.confirm_round:
            self.remeasured.append((point, spec.confirm_round))
        else:
            self.launched.append(point)
        recorded = self.table.get(point_key(point))
        if recorded is None:
            return TrialResult(status=TrialStatus.CRASH, knobs=point, error="no recorded result for this point", runner=self.name)
        return recorded
