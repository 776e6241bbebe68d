"""Side-by-side timing: alternate the variants step by step, report medians and spread."""

from __future__ import annotations

import json
import math
import os
import random
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


def censored(values: list[float | None]) -> dict[str, float | None]:
    """Median and quartiles of runs of which some missed their target (``None``): a miss counts as
    worse than every run that reached it, never dropped. A quantile that falls on misses is None
    ("not reached"). Also the fraction of runs that reached the target."""
    ordered = sorted(math.inf if v is None else v for v in values)
    if not ordered:
        return {"median": None, "p25": None, "p75": None, "reached": 0.0}

    def at(q: float) -> float | None:  # linear interpolation between order statistics
        pos = q * (len(ordered) - 1)
        lo, hi = ordered[math.floor(pos)], ordered[math.ceil(pos)]
        value = lo + (hi - lo) * (pos - math.floor(pos)) if math.isfinite(hi) else hi
        return None if math.isinf(value) else value

    return {"median": at(0.5), "p25": at(0.25), "p75": at(0.75),
            "reached": sum(1 for v in values if v is not None) / len(values)}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks, tied values sharing their average
    rank (0.0 when either side is constant)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def round_orders(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """The order the variants run in, per round: shuffled with a fixed seed (every rank of a
    launch draws the same orders), so that no variant always runs first, or always after the
    same one (warm caches, a neighbour's allocations)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def alternate(variants: dict[str, Callable[[], None]], steps: int, warmup: int = 2,
              sync: Callable[[], None] | None = None, seed: int = 0) -> dict[str, list[float]]:
    """Run each variant once per round, ``warmup`` rounds unmeasured, then ``steps`` timed rounds,
    in a shuffled order per round (:func:`round_orders`).

    Alternating makes slow periods of a shared machine hit every variant alike.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i, order in enumerate(round_orders(list(variants), warmup + steps, seed)):
        for name in order:
            fn = variants[name]
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


RECORDED_CPU = Path(__file__).with_name("data") / "cpu.json"  # the CPU the recorded grids were measured on


def isolated_cache(cpu: Path | None = None) -> Path:
    """Point the cost model's cache (calibrations, layouts, the measured CPU) at a fresh folder for
    this run, so that nothing a user calibrated or measured before changes a benchmark's figures.
    With ``cpu``, that description of the CPU is used instead of measuring this one (a replay of a
    grid recorded on another machine). Child processes inherit the folder."""
    import atexit
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="slapo-bench-cache-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    if cpu is not None:
        shutil.copy(cpu, path / "cpu.json")
    os.environ["SLAPO_TUNE_CACHE"] = str(path)
    return path


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


def publish(name: str, data: dict, section: list[str]) -> dict:
    """A benchmark's end: its report section printed, its figures saved (``results/benchmarks/NAME.json``)."""
    print("\n".join(section))
    print(f"wrote {save_json(name, data)}")
    return data
