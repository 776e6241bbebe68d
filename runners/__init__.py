"""Trial runners: short real trainings of one schedule point on N ranks, locally or on Ray.

Runners never touch the study: they take a :class:`TrialSpec` and return a :class:`TrialResult`
whatever happens (``ok``, ``oom``, ``timeout``, ``crash`` or ``invalid``, or where the cluster
failed rather than the schedule ``lost`` or ``placement_timeout``). A spec with ``confirm_round``
set measures a finished trial's point again (the tuner's confirmation), exactly as a trial.
"""

from ._base import Runner
from .local import CorePool, LocalRunner, run_trial
from .trial import TrialResult, TrialSpec

__all__ = ["CorePool", "LocalRunner", "Runner", "TrialResult", "TrialSpec", "run_trial"]
