"""The exported schedule: ``best_schedule.json``, a versioned, framework-neutral description of a
tuned schedule point. Plain JSON data, validated field by field on load, never executed.

A template loaded from a user's ``.py`` file (``--space my_space.py``) is recorded with that
file's absolute path and the SHA-256 of its content (``template.file``, ``template.sha256``). The
file is Python, so the schedule only points at it: training runs it only when the user names it
(``train --space``), and refuses it when its content is not the recorded one.

A file is read only if it is a regular file of at most :data:`slapo_tune._inputs.MAX_INPUT_BYTES`,
nested at most :data:`slapo_tune._inputs.MAX_JSON_DEPTH` deep.

Version 2 names the training precision (``precision``: ``fp32``, ``amp-bf16``, ``bf16``, ``fp8``; see
:mod:`slapo_tune.precision`) and allows ``zero`` 1 and 2. Version-1 files still load: their
``dtype`` (``fp32``, or ``bf16`` meaning autocast over fp32 parameters) becomes the precision that
ran then (``fp32`` or ``amp-bf16``).

``measured`` (optional) holds what the tuner measured of the point: ``samples_per_s`` (confirmed
where ``confirmed``), ``step_times``, ``spread``, ``peak_memory``, ``trial``; and beside them the
baseline's (the out-of-the-box schedule, or the default made to fit): ``baseline_samples_per_s``,
``baseline_trial``, ``baseline_knobs``, ``baseline_spread``, ``baseline_made_from`` (where made to
fit: the out-of-the-box point), ``gain`` (ours over it), ``gain_how`` (``side by side``:
both measured in the same confirmation rounds, ``gain_low``-``gain_high`` the ratio's range over
``gain_rounds`` rounds; ``trials``: the two trials apart; ``same``: the point is the baseline).
These keys only add to version 2 (older files lack them, older readers ignore them): no new
version. The figures a reader prints are checked to be numbers.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from ._atomic import atomic_write_text
from ._inputs import MAX_BATCH, MAX_SEQ_LEN, MAX_WORLD_SIZE, parse_json, read_small_text
from .errors import UsageError
from .plan import Plan
from .precision import LEGACY_DTYPES, PRECISIONS

FORMAT = "slapo-tune-schedule"
VERSION = 2
READABLE_VERSIONS = (1, 2)

# field -> (type(s), required)
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "format": ((str,), True),
    "version": ((int,), True),
    "template": ((dict,), True),
    "knobs": ((dict,), True),
    "world_size": ((int,), True),
    "layout": ((dict,), True),
    "global_batch": ((int,), True),
    "micro_batch": ((int,), True),
    "accumulation": ((int,), True),
    "seq_len": ((int,), True),
    "precision": ((str,), True),
    "model": ((dict,), True),
    "device": ((str,), True),
    "versions": ((dict,), False),
    "measured": ((dict,), False),
    "predicted": ((dict,), False),
    "study": ((str,), False),
    "created": ((str,), False),
}


DEVICES = ("cpu", "cuda")  # where a schedule was tuned (the ranks' kind of device)
_SHA256 = re.compile(r"[0-9a-f]{64}")

# generous bounds: a tampered size must fail here, not make the space enumeration run for ever
# measured figures read back as numbers (``show`` prints them): each, where present, a number or null
_MEASURED_NUMBERS = ("samples_per_s", "baseline_samples_per_s", "gain", "gain_low", "gain_high")
_LIMITS = {"world_size": MAX_WORLD_SIZE, "global_batch": MAX_BATCH, "micro_batch": MAX_BATCH, "accumulation": MAX_BATCH,
           "seq_len": MAX_SEQ_LEN}


def library_versions() -> dict[str, str]:
    return dict(_installed_versions())


@functools.cache  # looking packages up costs milliseconds, and a tuner writes a schedule per trial
def _installed_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("slapo-tune", "torch", "transformers", "optuna", "ray"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def make_schedule(*, template: Mapping[str, str], plan: Plan, world_size: int, global_batch: int,
                  seq_len: int, precision: str, model: Mapping[str, Any], device: str,
                  measured: Mapping[str, Any] | None = None, predicted: Mapping[str, Any] | None = None,
                  study: str = "", stage_blocks: list[int] | None = None) -> dict[str, Any]:
    """The schedule file of ``plan`` (its knobs, layout and batch sizes come from the plan only;
    ``stage_blocks``: the blocks each pipeline rank holds, recorded in the layout, which loading
    checks against the cuts this version makes)."""
    layout = {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "zero": plan.zero}
    if stage_blocks is not None:
        layout["stage_blocks"] = list(stage_blocks)
    return {
        "format": FORMAT, "version": VERSION, "template": dict(template), "knobs": plan.knobs(),
        "world_size": world_size,
        "layout": layout,
        "global_batch": global_batch, "micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
        "seq_len": seq_len, "precision": precision, "model": dict(model), "device": device,
        "versions": library_versions(), "measured": dict(measured or {}), "predicted": dict(predicted or {}),
        "study": study, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def validate(data: Any, where: str = "schedule") -> dict[str, Any]:
    """Check the structure of a schedule; raises UsageError naming the first problem."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: not a schedule file (expected a JSON object)")
    if data.get("format") != FORMAT:
        raise UsageError(f"{where}: not a slapo-tune schedule (format {data.get('format')!r}, expected {FORMAT!r})")
    if data.get("version") not in READABLE_VERSIONS or isinstance(data.get("version"), bool):
        raise UsageError(f"{where}: unsupported schedule version {data.get('version')!r} (this slapo-tune reads "
                         f"versions {', '.join(map(str, READABLE_VERSIONS))}); re-export it with a matching slapo-tune")
    if data["version"] == 1:
        data = _from_version_1(data, where)
    for name, (types, required) in _FIELDS.items():
        if name not in data:
            if required:
                raise UsageError(f"{where}: missing field '{name}'")
            continue
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise UsageError(f"{where}: field '{name}' should be {types[0].__name__}, got {type(value).__name__}")
    for name in ("name", "version"):
        if not isinstance(data["template"].get(name), str):
            raise UsageError(f"{where}: template.{name} must be a string")
    if "file" in data["template"] or "sha256" in data["template"]:  # a template from a user's .py file
        file, sha256 = data["template"].get("file"), data["template"].get("sha256")
        if not isinstance(file, str) or not file.endswith(".py") or not os.path.isabs(file):
            raise UsageError(f"{where}: template.file must be the absolute path of a .py file, got {file!r}")
        if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            raise UsageError(f"{where}: template.sha256 must be 64 hexadecimal digits (the file's SHA-256), "
                             f"got {sha256!r}")
    if not isinstance(data["model"].get("name"), str):
        raise UsageError(f"{where}: model.name must be a string")
    for key, value in data["knobs"].items():
        if not isinstance(value, (int, float, str)) or isinstance(value, bool):
            raise UsageError(f"{where}: knob {key} has a non-scalar value {value!r}")
    for name in _MEASURED_NUMBERS:
        value = data.get("measured", {}).get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UsageError(f"{where}: measured.{name} should be a number, got {type(value).__name__}")
    if data["precision"] not in PRECISIONS:
        raise UsageError(f"{where}: precision {data['precision']!r} is not one of {', '.join(PRECISIONS)}")
    if data["device"] not in DEVICES:
        raise UsageError(f"{where}: device {data['device']!r} is not one of {', '.join(DEVICES)}")
    for name, limit in _LIMITS.items():
        if data[name] < 1:
            raise UsageError(f"{where}: {name} must be positive, got {data[name]}")
        if data[name] > limit:
            raise UsageError(f"{where}: {name} must be at most {limit}, got {data[name]}")
    return data


def _from_version_1(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A version-1 schedule as version 2: its ``dtype`` is the precision it ran in."""
    dtype = data.get("dtype")
    if not isinstance(dtype, str):
        raise UsageError(f"{where}: missing field 'dtype' (a version-1 schedule)")
    if dtype not in LEGACY_DTYPES:
        raise UsageError(f"{where}: version-1 dtype {dtype!r} has no precision here (it ran without a loss "
                         f"scaler); re-tune with --precision {' or '.join(LEGACY_DTYPES.values())}")
    converted = {k: v for k, v in data.items() if k != "dtype"}
    converted.update(version=VERSION, precision=LEGACY_DTYPES[dtype])
    return converted


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write JSON so that readers see the old file or the new one, never a part."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def write_schedule(path: str | os.PathLike, schedule: Mapping[str, Any]) -> None:
    write_json_atomic(path, validate(dict(schedule)))


def read_schedule(path: str | os.PathLike) -> dict[str, Any]:
    """Load and validate a schedule file (UsageError with one line on any problem)."""
    data = parse_json(read_small_text(path, "schedule file"), f"schedule file {path}")
    return validate(data, str(path))
