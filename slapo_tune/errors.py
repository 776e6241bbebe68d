"""Exception types raised by slapo-tune.

Every error says what was wrong and, where it can, what to do instead. Misuse of the schedule
language raises a :class:`ScheduleError` subclass before anything is changed, so a failed primitive
leaves the model as it was.
"""

from __future__ import annotations


class SlapoTuneError(Exception):
    """Base class of all errors raised on purpose by slapo-tune."""


class ScheduleError(SlapoTuneError, ValueError):
    """A schedule primitive was used in a way that cannot be honoured."""


class ShardingError(ScheduleError):
    """``shard`` was asked for something impossible (bad axis, indivisible size, sharded twice...)."""


class SyncError(ScheduleError):
    """``sync`` contradicts what is known about the tensor it would communicate."""


class PipelineError(ScheduleError):
    """Pipeline stage cuts are inconsistent (cut on the root, empty stage, wrong stage count...)."""


class TraceError(ScheduleError):
    """A module could not be traced into a graph."""


class PatternError(ScheduleError):
    """A pattern matched nothing, or a match cannot be replaced as asked."""


class MaterializeError(SlapoTuneError, RuntimeError):
    """A parameter or buffer on the meta device could not be given real values."""


class VerificationError(SlapoTuneError, AssertionError):
    """The scheduled model does not compute what the unscheduled model computes."""


class ScheduleKeyError(SlapoTuneError, KeyError):
    """A schedule path names no module. The message lists the closest valid paths."""

    def __str__(self) -> str:  # KeyError would repr() the message and add quotes
        return str(self.args[0]) if self.args else ""


class UsageError(SlapoTuneError, ValueError):
    """Bad user input at the command line or in a configuration (exit code 2)."""


class ModelMismatchError(UsageError):
    """A schedule meets another model than the one it was tuned for (their config fingerprints
    differ): its module paths, shapes and knobs describe that model, not this one."""


class InfrastructureError(SlapoTuneError, RuntimeError):
    """What trials run on failed, not the user's input: a Ray head that exited while starting or
    did not answer in time (exit code 1, not the usage code: a re-run may succeed)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, systemd, Slurm) turned into an interrupt, so that it takes the path
    Ctrl-C takes: trials and ranks stopped, one line, the exit code ``128 + signum``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
