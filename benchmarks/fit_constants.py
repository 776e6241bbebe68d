"""Fit the GPU time model's fitted constants on the published runs not held out.

The constants: the achievable bf16 rate of a linear layer's product (``flops``) of the A100 and of
the H100 (``slapo_tune/cost_model/hardware_presets.json``; H200, B200 and V100 follow from these by
the rules their presets state), the products' shape efficiency (``gemm_half_dim``) and the host's
per-block time where FSDP1's rate limiter makes it wait (``overhead_per_layer``: FsdpHost), shared
by every GPU preset, and the share of compute that
FSDP's prefetched collectives hide behind (:data:`~slapo_tune.cost_model.analytic.FSDP_OVERLAP`).

The fit reads the llm-foundry MPT runs of ``benchmarks/data/published_runs.json`` not marked
``held_out`` and the rows of Megatron-LM's Table 1 (Narayanan et al. 2021) other than 1.7B, 18.4B
and 1T (:data:`HELD_OUT_MEGATRON`, which tests/test_time_model.py checks): each case's cost model is
built once, then the time model is evaluated over a grid of candidate constants (the hardware's
fields replaced, the FSDP overlap passed in), and the candidate with the smallest median
|log(predicted / published)| over the cases among those that keep every case within 0.85-1.15 is
chosen (ties: the smallest mean; the median alone trades the constants against each other and lets
a fitted run leave the band). Held-out runs are
never read by the fit; the summary after it evaluates them at the chosen constants, apart.

Run: ``python -m benchmarks.fit_constants`` (about a minute on two cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

# Table 1 rows kept out of the fit (1.7B, 18.4B, 1T): tests/test_time_model.py's megatron_rows
HELD_OUT_MEGATRON = (0, 3, 9)
# the candidates: each GPU's achievable rate (FLOP/s), the products' half-rate dimension, FSDP's
# per-block seconds and its overlap share
GRID = {
    "a100_flops": [float(x) * 1e12 for x in range(190, 306, 5)],
    "h100_flops": [float(x) * 1e12 for x in range(480, 721, 10)],
    "gemm_half_dim": [256.0, 384.0, 512.0, 640.0, 768.0, 896.0, 1024.0, 1152.0, 1280.0, 1536.0],
    "overhead_per_layer": [x * 2.5e-4 for x in range(4, 25)],
    "fsdp_overlap": [0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0],
}
# every fitted case must stay within the band tests/test_time_model.py holds the published runs to
BAND = (0.85, 1.15)
# the fitted rate a GPU's follows (hardware_presets.json: H200 and B200 at the H100's share of their
# datasheet peak, V100 at the A100's), and those two GPUs' peaks
RATE_OF = {"a100": "a100_flops", "v100": "a100_flops", "h100": "h100_flops", "h200": "h100_flops", "b200": "h100_flops"}
PEAK_OF = {"a100_flops": 312e12, "h100_flops": 989e12}


def rate_key(hw: Any) -> str:
    """The :data:`GRID` rate a preset's ``flops`` follows (by its name: ``a100-80gb`` -> the A100's)."""
    return RATE_OF[hw.name.split("-")[0]]


class Case(NamedTuple):
    """One published figure: its model's layout, point and workload, its GPU, and how a step's
    seconds become the ratio of predicted to published."""

    name: str
    group: str  # "fitted", "held_out", "megatron_fitted", "megatron_held_out", "other"
    hardware: Any  # slapo_tune.cost_model.Hardware
    layout: Any
    point: Any
    workload: Any
    weights: dict
    ratio_of_step: Callable[[float], float]
    runtime: Any  # slapo_tune.cost_model.Runtime: the run's framework's, as the time model charges it


def published_cases(runs: list[dict]) -> list[Case]:
    """A case per published run (benchmarks/published_runs.py's configuration of it)."""
    from benchmarks.published_runs import _spec, layout_of_run, published_point, runtime_of
    from slapo_tune.cost_model import CostModel, hardware

    out = []
    for run in runs:
        hw = hardware(run["hardware"])
        problem = _spec(run).resolve()
        model = CostModel(problem, hw, layout=layout_of_run(problem))
        tokens, published = run["global_batch"] * run["seq_len"], run["published"]["tokens_per_s_per_gpu"]
        group = "other" if "runtime" in run else ("held_out" if run["held_out"] else "fitted")
        out.append(Case(run["id"], group, hw, model.layout, problem.plan(published_point(run)), model.workload,
                        model.calibration.time_weights,
                        lambda step, t=tokens, g=run["gpus"], p=published: t / step / g / p, runtime_of(run)))
    return out


def megatron_cases() -> list[Case]:
    """A case per row of Megatron-LM's Table 1 (benchmarks/paper_tables.py's configuration of it)."""
    from benchmarks.paper_tables import MEGATRON_2021_ATTN, MEGATRON_TABLE_1, _gpt_spec, megatron_flops
    from slapo_tune.cost_model import OUR_RUNTIME, CostModel, hardware

    hw = hardware("a100-80gb")
    out = []
    for index, (params, heads, hidden, layers, tp, pp, gpus, batch, published) in enumerate(MEGATRON_TABLE_1):
        problem = _gpt_spec(layers, hidden, heads, gpus, batch).resolve()
        model = CostModel(problem, hw)
        point = problem.plan(dict(tp=tp, pp=pp, dp=gpus // (tp * pp), zero=0, micro_batch=1, ckpt_ratio=1.0,
                                  pipeline_schedule="1f1b", attn=MEGATRON_2021_ATTN, fuse="on"))
        flops = megatron_flops(batch, layers, hidden)
        group = "megatron_held_out" if index in HELD_OUT_MEGATRON else "megatron_fitted"
        out.append(Case(f"megatron-2021 {params}B", group, hw, model.layout, point, model.workload,
                        model.calibration.time_weights, lambda step, f=flops, g=gpus, p=published: f / step / g / 1e12 / p,
                        OUR_RUNTIME))  # no FSDP there (zero=0); the paper states no gradient-accumulation fusion
    return out


def ratio(case: Case, constants: dict[str, float]) -> float:
    """Predicted / published of one case at ``constants`` (a value per :data:`GRID` key)."""
    from slapo_tune.cost_model.analytic import time_terms, weighted_time

    key = rate_key(case.hardware)
    flops = constants[key] * case.hardware.peak_flops / PEAK_OF[key]
    hw = dataclasses.replace(case.hardware, flops=flops, fp8_flops=2 * flops if case.hardware.fp8_flops else 0.0,
                             gemm_half_dim=constants["gemm_half_dim"],
                             overhead_per_layer=constants["overhead_per_layer"])
    terms = time_terms(case.layout, case.point, case.workload, hw, constants["fsdp_overlap"], case.runtime)
    return case.ratio_of_step(weighted_time(terms, case.weights)[1])


class Fit(NamedTuple):
    """The chosen constants and their median |log ratio|; and the grid's best with no run kept in the
    band, for comparison (the median alone is flat along trades between the constants: a lower rate
    against a smaller half-rate dimension, a larger per-block cost against more overlap, along which
    it lets the tails go)."""

    chosen: dict[str, float]
    median: float
    unconstrained: dict[str, float]
    unconstrained_median: float


def fit(cases: list[Case], grid: dict[str, list[float]] = GRID, band: tuple[float, float] = BAND) -> Fit:
    """The grid's constants with the smallest median |log ratio| over ``cases`` (ties: the mean)
    among those that keep every case's ratio within ``band``. Each case depends on one GPU's rate:
    its log ratios are evaluated once per (shape, overhead, overlap, its GPU's rate) and combined
    over the two rates' grid afterwards."""
    shared = ("gemm_half_dim", "overhead_per_layer", "fsdp_overlap")
    rates = sorted({rate_key(c.hardware) for c in cases})
    low, high = math.log(band[0]), math.log(band[1])
    best: dict[bool, tuple[float, float, dict[str, float]]] = {}
    for values in itertools.product(*(grid[k] for k in shared)):
        constants = dict(zip(shared, values))
        # per GPU rate key: an array [rate value, case] of log ratios
        logs = {r: np.array([[math.log(ratio(c, {**constants, r: v})) for c in cases
                              if rate_key(c.hardware) == r] for v in grid[r]]) for r in rates}
        for picks in itertools.product(*(range(len(grid[r])) for r in rates)):
            signed = np.concatenate([logs[r][i] for r, i in zip(rates, picks)])
            errors = np.abs(signed)
            score = (float(np.median(errors)), float(errors.mean()))
            within = bool(signed.min() >= low and signed.max() <= high)
            for key in {False, within}:  # False: any candidate; True: those within the band
                if key not in best or score < best[key][:2]:
                    best[key] = (*score, {**constants, **{r: grid[r][i] for r, i in zip(rates, picks)}})
    if True not in best:
        raise ValueError(f"no candidate of the grid keeps every case within {band}")
    return Fit(best[True][2], best[True][0], best[False][2], best[False][0])


def current_constants() -> dict[str, float]:
    """The constants as the presets and the time model hold them now."""
    from slapo_tune.cost_model import hardware
    from slapo_tune.cost_model.analytic import FSDP_OVERLAP

    a100, h100 = hardware("a100-80gb"), hardware("h100-80gb")
    return {"a100_flops": a100.flops, "h100_flops": h100.flops, "gemm_half_dim": h100.gemm_half_dim,
            "overhead_per_layer": h100.overhead_per_layer, "fsdp_overlap": FSDP_OVERLAP}


def summary(cases: list[Case], constants: dict[str, float]) -> list[str]:
    """A line per case and per group: ratio, median |ratio - 1|, range."""
    lines, by_group = [], {}
    for c in cases:
        r = ratio(c, constants)
        by_group.setdefault(c.group, []).append(r)
        lines.append(f"  {c.group:18} {c.name:48} {r:.3f}")
    for group, rs in by_group.items():
        lines.append(f"{group:18} n={len(rs):2} median ratio {statistics.median(rs):.3f} "
                     f"({min(rs):.3f}-{max(rs):.3f}), median |ratio - 1| {statistics.median(abs(x - 1) for x in rs):.3f}, "
                     f"within 0.85-1.15: {sum(0.85 <= x <= 1.15 for x in rs)}")
    return lines


def _show(constants: dict[str, float]) -> str:
    return (f"a100 flops {constants['a100_flops'] / 1e12:.0f}e12, h100 flops {constants['h100_flops'] / 1e12:.0f}e12, "
            f"gemm_half_dim {constants['gemm_half_dim']:.0f}, overhead_per_layer {constants['overhead_per_layer']:.2e}, "
            f"FSDP_OVERLAP {constants['fsdp_overlap']}")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    from benchmarks._stats import isolated_cache
    from benchmarks.published_runs import load_runs

    isolated_cache()
    t0 = time.perf_counter()
    runs = load_runs()
    # the fit's cases are built from the runs not held out alone
    fitted = published_cases([r for r in runs if not r["held_out"]])
    megatron = megatron_cases()
    result = fit(fitted + [c for c in megatron if c.group == "megatron_fitted"])
    chosen = result.chosen
    print(f"fitted in {time.perf_counter() - t0:.0f} s")
    print(f"before: {_show(current_constants())}")
    print(f"chosen: {_show(chosen)}: median |log ratio| {result.median:.4f}, every fitted case within {BAND}")
    print(f"(best with no band: {_show(result.unconstrained)}: {result.unconstrained_median:.4f})")
    # only now the held-out runs, to report them at the chosen constants
    every = fitted + published_cases([r for r in runs if r["held_out"]]) + megatron
    for label, constants in (("before", current_constants()), ("chosen", chosen),
                             ("best with no band", result.unconstrained)):
        print(f"-- {label}")
        print("\n".join(summary(every, constants)))
    return chosen


if __name__ == "__main__":
    main()
