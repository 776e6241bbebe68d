"""slapo-tune: a schedule language and an autotuner for large-model training schedules.

The public API is re-exported here; modules starting with ``_`` are private.
"""

from __future__ import annotations

import os as _os

_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from ._build import build, materialize  # noqa: E402
from ._graph import FusedLinear, Match, bias_then, fuse_linears  # noqa: E402
from ._schedule import Schedule, create_schedule  # noqa: E402
from ._sharding import Layout  # noqa: E402
from ._verify import VerifyReport, reference_copy, verify  # noqa: E402
from .apply import LoadedSchedule, apply_schedule, load_schedule  # noqa: E402
from .errors import (  # noqa: E402
    MaterializeError,
    PatternError,
    PipelineError,
    ScheduleError,
    ScheduleKeyError,
    ShardingError,
    SlapoTuneError,
    SyncError,
    TraceError,
    UsageError,
    VerificationError,
)
from .models import ModelSpec, build_model, config_fingerprint, load_config, preset_names  # noqa: E402
from .plan import Plan, TrialStatus  # noqa: E402
from .problem import Problem, ProblemSpec  # noqa: E402
from .session import Session  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "FusedLinear",
    "Layout",
    "LoadedSchedule",
    "Match",
    "MaterializeError",
    "ModelSpec",
    "PatternError",
    "PipelineError",
    "Plan",
    "Problem",
    "ProblemSpec",
    "Schedule",
    "ScheduleError",
    "ScheduleKeyError",
    "ShardingError",
    "Session",
    "SlapoTuneError",
    "SyncError",
    "TraceError",
    "TrialStatus",
    "UsageError",
    "VerificationError",
    "VerifyReport",
    "apply_schedule",
    "bias_then",
    "build",
    "build_model",
    "config_fingerprint",
    "create_schedule",
    "fuse_linears",
    "load_config",
    "load_schedule",
    "materialize",
    "preset_names",
    "reference_copy",
    "verify",
]
