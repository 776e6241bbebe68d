"""Fit the analytic model's term weights to exact-mode or measured peaks.

Weights are fitted by non-negative least squares on *relative* errors (each point counts alike,
small or large), then cached per (device, model family, dtype). The fit reports its own
uncertainty: the largest relative residual on the calibration points, with a floor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .analytic import ACTIVATION_TERMS, DEFAULT_UNCERTAINTY, DEFAULT_WEIGHTS, MEMORY_TERMS, PHASES, combine

MIN_UNCERTAINTY = 0.03


@dataclass
class Calibration:
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    uncertainty: float = DEFAULT_UNCERTAINTY
    points: int = 0
    source: str = "default"

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


# Model states are counted, not estimated: a parameter, its gradient and AdamW's two moments are
# alive at the peak, whatever the data says; only the terms that depend on how PyTorch runs the
# step (activations, temporaries) are fitted.
FIXED_TERMS = ("weights", "gradients", "optimizer")


def _active_terms(terms: Mapping[str, float], phase: str) -> set[str]:
    inactive = {t for name, members in PHASES.items() if name != phase for t in members}
    if phase == "optimizer":
        inactive |= set(ACTIVATION_TERMS)
    return set(terms) - inactive


def fit(samples: Sequence[tuple[Mapping[str, float], float]], source: str = "exact",
        iterations: int = 10) -> Calibration:
    """Weights from (terms of one stage, measured peak bytes) pairs.

    The peak is a maximum over phases, so the fit alternates: assign each sample to the phase that
    reaches its peak under the current weights, solve the (linear) least squares, repeat.
    """
    fixed = {k: DEFAULT_WEIGHTS[k] for k in FIXED_TERMS}
    columns = [k for k in MEMORY_TERMS if k not in fixed and any(t.get(k, 0.0) for t, _ in samples)]
    weights = dict(DEFAULT_WEIGHTS)
    phases = None
    for _ in range(iterations):
        assigned = [combine(t, weights)[1] for t, _ in samples]
        if assigned == phases:
            break
        phases = assigned
        active = [_active_terms(t, ph) for (t, _), ph in zip(samples, phases)]
        a = np.array([[t.get(k, 0.0) / y if k in act else 0.0 for k in columns]
                      for (t, y), act in zip(samples, active)])
        b = np.array([1.0 - sum(w * t.get(k, 0.0) for k, w in fixed.items()) / y for t, y in samples])
        x = nnls(a, b)
        weights.update({k: float(v) for k, v in zip(columns, x)})
    predicted = np.array([combine(t, weights)[0] / y for t, y in samples])
    residual = np.abs(predicted - 1.0)
    uncertainty = max(MIN_UNCERTAINTY, float(residual.max()) * 1.25) if len(samples) else DEFAULT_UNCERTAINTY
    return Calibration(weights, uncertainty, len(samples), source)


def _cache_path(device: str, family: str, dtype: str) -> Path:
    root = Path(os.environ.get("SLAPO_TUNE_CACHE", Path.home() / ".cache" / "slapo-tune"))
    root.mkdir(parents=True, exist_ok=True)
    return root / f"calibration-{device}-{family}-{dtype}.json"


def load(device: str, family: str, dtype: str) -> Calibration | None:
    path = _cache_path(device, family, dtype)
    try:
        return Calibration(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def save(calibration: Calibration, device: str, family: str, dtype: str) -> Path:
    path = _cache_path(device, family, dtype)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calibration.as_dict(), indent=1))
    os.replace(tmp, path)
    return path
