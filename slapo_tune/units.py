"""Sizes and durations as people write them (``80GiB``, ``30m``), for the command line."""

from __future__ import annotations

import re

from .errors import UsageError

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_size(text: str) -> int:
    """``80GiB``, ``400MiB``, ``16GB``, ``1.5TiB`` or bytes -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise UsageError(f"unparsable size '{text}' (use e.g. 80GiB, 400MiB, 16GB)")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value <= 0:
        raise UsageError(f"size must be positive, got '{text}'")
    return int(value)


def parse_duration(text: str) -> float:
    """``90``/``90s``, ``30m``, ``2h`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not match:
        raise UsageError(f"unparsable duration '{text}' (examples: 90s, 30m, 2h)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def format_size(n: float) -> str:
    """Bytes as MiB, or GiB from 1 GiB up."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
