"""Side-by-side timing: alternate the variants step by step, report medians and spread."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def median_iqr(values: list[float]) -> tuple[float, float, float]:
    """Median and the 25th / 75th percentiles."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q[0], q[2]


def alternate(variants: dict[str, Callable[[], None]], steps: int, warmup: int = 2,
              sync: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Run each variant once per round, ``warmup`` rounds unmeasured, then ``steps`` timed rounds.

    Alternating makes slow periods of a shared machine hit every variant alike.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + steps):
        for name, fn in variants.items():
            if sync:
                sync()
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def ratio_summary(times: dict[str, list[float]], numerator: str, denominator: str) -> dict[str, float]:
    """Ratio of medians, plus the median and spread of the per-round ratios."""
    per_round = [a / b for a, b in zip(times[numerator], times[denominator])]
    med, lo, hi = median_iqr(per_round)
    return {
        "ratio_of_medians": statistics.median(times[numerator]) / statistics.median(times[denominator]),
        "per_round_median": med,
        "per_round_p25": lo,
        "per_round_p75": hi,
    }


def describe(name: str, values: list[float]) -> str:
    med, lo, hi = median_iqr(values)
    return f"{name:<34} median {med * 1e3:8.2f} ms  (p25 {lo * 1e3:.2f}, p75 {hi * 1e3:.2f}, n={len(values)})"


def results_dir() -> Path:
    path = Path(os.environ.get("SLAPO_BENCH_DIR", "results/benchmarks"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_json(name: str, data: dict) -> Path:
    path = results_dir() / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
    return path
