"""Fit the analytic model's term weights to exact-mode or measured peaks.

Weights are fitted by non-negative least squares on *relative* errors (each point counts alike,
small or large), then cached per (device, model family, precision): a precision decides the bytes
of every model state and which terms exist at all (master weights, autocast's copies), so weights
fitted under one say nothing of another. The fit reports its own uncertainty: the largest relative
residual on the calibration points, with a floor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .analytic import (
    DEFAULT_TIME_WEIGHTS,
    DEFAULT_UNCERTAINTY,
    DEFAULT_WEIGHTS,
    MEMORY_TERMS,
    TIME_TERMS,
    combine,
)

MIN_UNCERTAINTY = 0.03
PRIOR = 0.3  # the relative error a unit change of weight is worth
UNDER_WEIGHT = 2.0  # how much more an under-prediction counts


@dataclass
class Calibration:
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    uncertainty: float = DEFAULT_UNCERTAINTY
    points: int = 0
    source: str = "default"
    time_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIME_WEIGHTS))
    time_points: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 50) -> np.ndarray:
    """Non-negative least squares: columns whose weight would go negative are dropped and the rest refit."""
    active = np.ones(a.shape[1], dtype=bool)
    x = np.zeros(a.shape[1])
    for _ in range(iterations):
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        x[:] = 0
        x[active] = sol
        negative = x < 0
        if not negative.any():
            return x
        active &= ~negative
    x[x < 0] = 0
    return x


# Model states are counted, not estimated: a parameter, its master copy, its gradient and AdamW's
# two moments are alive at the peak, whatever the data says; only the terms that depend on how
# PyTorch runs the step (activations, temporaries, FSDP's buffers) are fitted.
FIXED_TERMS = ("weights", "master", "gradients", "optimizer")


def fit(samples: Sequence[tuple[Mapping[str, Mapping[str, float]], float]], source: str = "exact",
        iterations: int = 10) -> Calibration:
    """Weights from (events of one stage, measured peak bytes) pairs.

    The peak is a maximum over events, so the fit alternates: assign each sample the event that
    reaches its peak under the current weights, solve the (linear) least squares, repeat.
    """
    fixed = {k: DEFAULT_WEIGHTS[k] for k in FIXED_TERMS}
    columns = [k for k in MEMORY_TERMS if k not in fixed
               and any(terms.get(k, 0.0) for events, _ in samples for terms in events.values())]
    weights = dict(DEFAULT_WEIGHTS)
    assigned = None
    row_weight = np.ones(len(samples))
    for _ in range(iterations):
        peaks = [combine(events, weights)[1] for events, _ in samples]
        under = np.array([combine(events, weights)[0] < y for events, y in samples])
        new_row_weight = np.where(under, UNDER_WEIGHT, 1.0)
        if peaks == assigned and np.array_equal(new_row_weight, row_weight):
            break
        assigned, row_weight = peaks, new_row_weight
        rows = [events[name] for (events, _), name in zip(samples, assigned)]
        a = np.array([[t.get(k, 0.0) / y for k in columns] for t, (_, y) in zip(rows, samples)])
        b = np.array([1.0 - sum(w * t.get(k, 0.0) for k, w in fixed.items()) / y for t, (_, y) in zip(rows, samples)])
        # under-predictions cost more than over-predictions (a pruned point that would have fit is
        # lost to the search); a prior at the measured counts: a weight moves only as far as the
        # points insist
        a, b = a * row_weight[:, None], b * row_weight
        a = np.vstack([a, PRIOR * np.eye(len(columns))])
        b = np.concatenate([b, PRIOR * np.array([DEFAULT_WEIGHTS[k] for k in columns])])
        x = nnls(a, b)
        weights.update({k: float(v) for k, v in zip(columns, x)})
    predicted = np.array([combine(events, weights)[0] / y for events, y in samples])
    residual = np.abs(predicted - 1.0)
    uncertainty = max(MIN_UNCERTAINTY, float(residual.max()) * 1.25) if len(samples) else DEFAULT_UNCERTAINTY
    return Calibration(weights, uncertainty, len(samples), source)


def fit_time(samples: Sequence[tuple[Mapping[str, float], float]]) -> dict[str, float]:
    """Time-term weights from (time terms of a point, its measured step seconds) pairs, by
    non-negative least squares on relative errors: what this device really achieves for this
    model (small matrices, Python overhead, gloo) rather than its peak rates.

    A weight per term needs more points than terms: with fewer, any weights fit them exactly and
    say nothing about other points, so only one common scale is fitted (it keeps the model's
    ranking and corrects its level)."""
    if not samples:
        return dict(DEFAULT_TIME_WEIGHTS)
    a = np.array([[terms.get(k, 0.0) / y for k in TIME_TERMS] for terms, y in samples])
    if len(samples) <= len(TIME_TERMS):
        totals = a.sum(axis=1)
        scale = float(totals.sum() / (totals ** 2).sum()) if totals.any() else 1.0
        return {k: scale * DEFAULT_TIME_WEIGHTS[k] for k in TIME_TERMS}
    x = nnls(a, np.ones(len(samples)))
    return {k: float(v) for k, v in zip(TIME_TERMS, x)}


# Bump when the analytic terms change meaning: calibrations cached before are then not loaded.
# Version 2: terms per precision (not dtype: "bf16" used to mean autocast, now bf16 parameters with
# fp32 masters) and per ZeRO level 0-3. Version 3: pp_recv counts the receive buffers in flight
# (not one per micro-batch), logits and logits_grad follow loss_parallel, and tp_comm holds the LM
# head's all-gather of the logits. Version 4: ZeRO-1 is a unit per block (grads_unsharded: the
# running block's and the root's bf16 gradients; rs_buffer: a block's reduce-scatter). Version 5:
# an interleaved rank's pp_recv is what torch's action lists keep alive (the step's most, and at
# its last backward and last loss their own), not one per chunk and micro-batch in flight. Version 6:
# logits_grad on the last stage is the larger of the loss's two fp32 gradients and the head's backward
# (the logits' gradient beside the head's weight gradient) without loss_parallel, not the former only.
CALIBRATION_VERSION = 6


def _cache_path(device: str, family: str, precision: str) -> Path:
    root = Path(os.environ.get("SLAPO_TUNE_CACHE", Path.home() / ".cache" / "slapo-tune"))
    root.mkdir(parents=True, exist_ok=True)
    return root / f"calibration-v{CALIBRATION_VERSION}-{device}-{family}-{precision}.json"


def load(device: str, family: str, precision: str) -> Calibration | None:
    path = _cache_path(device, family, precision)
    try:
        return Calibration(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def save(calibration: Calibration, device: str, family: str, precision: str) -> Path:
    path = _cache_path(device, family, precision)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calibration.as_dict(), indent=1))
    os.replace(tmp, path)
    return path
