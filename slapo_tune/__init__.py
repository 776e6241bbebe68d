"""slapo-tune: a schedule language and an autotuner for large-model training schedules.

The public API is re-exported here; modules starting with ``_`` are private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    MaterializeError,
    ModelMismatchError,
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
from .plan import Plan, TrialStatus

# The rest of the public API is imported on first use (PEP 562): those modules import torch (2-3 s),
# which commands that only plan (``plan``, ``space``, ``show``, every ``--help``) never need.
_LAZY = {
    "build": "schedule._build", "materialize": "schedule._build",
    "FusedLinear": "schedule._graph", "Match": "schedule._graph", "bias_then": "schedule._graph",
    "fuse_linears": "schedule._graph",
    "Schedule": "schedule._schedule", "create_schedule": "schedule._schedule", "list_primitives": "schedule._schedule",
    "register_primitive": "schedule._schedule", "unregister_primitive": "schedule._schedule",
    "Layout": "schedule._sharding",
    "VerifyReport": "_verify", "reference_copy": "_verify", "verify": "_verify",
    "LoadedSchedule": "apply", "apply_schedule": "apply", "load_schedule": "apply",
    "ModelSpec": "models", "build_model": "models", "config_fingerprint": "models", "load_config": "models",
    "preset_names": "models",
    "Problem": "problem", "ProblemSpec": "problem",
    "Session": "session",
}

if TYPE_CHECKING:
    from ._verify import VerifyReport, reference_copy, verify
    from .apply import LoadedSchedule, apply_schedule, load_schedule
    from .models import ModelSpec, build_model, config_fingerprint, load_config, preset_names
    from .problem import Problem, ProblemSpec
    from .schedule._build import build, materialize
    from .schedule._graph import FusedLinear, Match, bias_then, fuse_linears
    from .schedule._schedule import (
        Schedule,
        create_schedule,
        list_primitives,
        register_primitive,
        unregister_primitive,
    )
    from .schedule._sharding import Layout
    from .session import Session


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # once: later lookups are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__version__ = "0.1.0"

__all__ = [
    "FusedLinear",
    "Layout",
    "LoadedSchedule",
    "Match",
    "MaterializeError",
    "ModelMismatchError",
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
    "list_primitives",
    "load_schedule",
    "materialize",
    "preset_names",
    "reference_copy",
    "register_primitive",
    "unregister_primitive",
    "verify",
]
