"""Sizes and durations as people write them (``80GiB``, ``30m``), for the command line."""

from __future__ import annotations

import re

from .errors import UsageError

_SIZE_UNITS = {"b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


MAX_SIZE = 2**60  # bytes (an exbibyte): far above any device's memory
MAX_DURATION = 366 * 24 * 3600.0  # seconds: a year and a day
_TEXT_MAX = 40  # characters of a size or duration (a 100,000-digit number is no size)


def parse_size(text: str) -> int:
    """``80GiB``, ``400MiB``, ``16GB``, ``1.5TiB`` or ``1024B`` -> bytes (above 0, at most :data:`MAX_SIZE`).
    A number without a unit is refused: ``--memory-budget 80`` meant 80 GiB, not 80 bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text)) if len(str(text)) <= _TEXT_MAX else None
    unit = match.group(2).lower() if match else None
    if match and not unit:
        raise UsageError(f"size '{str(text).strip()}' has no unit: write it with one (e.g. {match.group(1)}GiB, "
                         f"{match.group(1)}MiB, or {match.group(1)}B for bytes)")
    if not match or unit not in _SIZE_UNITS:
        raise UsageError(f"unparsable size '{str(text)[:_TEXT_MAX]}' (use e.g. 80GiB, 400MiB, 16GB)")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value < 1 or value > MAX_SIZE:
        raise UsageError(f"size must be from 1 byte to {MAX_SIZE // 2**60} EiB, got '{text}'")
    return int(value)


def parse_duration(text: str) -> float:
    """``90``/``90s``, ``30m``, ``2h`` -> seconds (above 0, at most :data:`MAX_DURATION`: a limit of
    0 s would end every trial before it started)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "") if len(text or "") <= _TEXT_MAX else None
    if not match:
        raise UsageError(f"unparsable duration '{(text or '')[:_TEXT_MAX]}' (examples: 90s, 30m, 2h)")
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not 0 < seconds <= MAX_DURATION:
        raise UsageError(f"a duration must be above 0 and at most 366 days, got '{text.strip()}'")
    return seconds


def size_argument(n: int) -> str:
    """Bytes as a size :func:`parse_size` reads back exactly: in the largest binary unit that divides
    them (``80GiB``, ``16MiB``), else in bytes (``1000B``)."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


def size_at_least(n: int) -> str:
    """A size :func:`parse_size` reads as at least ``n`` bytes, as a person would write it: rounded
    up to a tenth of a MiB, or of a GiB from 1 GiB (``2.3MiB``, ``70.4GiB``)."""
    import math

    unit, factor = ("GiB", 2**30) if n >= 2**30 else ("MiB", 2**20)
    tenths = math.ceil(n * 10 / factor)
    while int(tenths / 10 * factor) < n:  # (a float's rounding must not take a byte off)
        tenths += 1
    return f"{tenths / 10:g}{unit}"


def format_size(n: float) -> str:
    """Bytes as MiB, or GiB from 1 GiB up."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
