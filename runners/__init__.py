"""Trial runners: short real trainings of one schedule point on N ranks, locally or on Ray.

Runners never touch the study: they take a :class:`TrialSpec` and return a :class:`TrialResult`
whatever happens (``ok``, ``oom``, ``timeout``, ``crash`` or ``invalid``).
"""

from ._base import Runner
from .local import CorePool, LocalRunner, run_trial
from .trial import TrialResult, TrialSpec

__all__ = ["CorePool", "LocalRunner", "Runner", "TrialResult", "TrialSpec", "run_trial"]
