"""Cost model: predict the peak memory and step time of schedule points, before running them.

Two fidelities of memory: *analytic* (closed-form terms, microseconds per point, for whole spaces
and ``plan``) and *exact* (one fake step per pipeline stage, seconds per point, equal to a real
step's tensor-level peak on CPU). The analytic weights are calibrated from exact points and cached
per (device, family, precision). Time is analytic (compute, overheads, communication, bubble).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..plan import knob_value
from ..problem import Problem
from . import calibration as _calibration
from ._tracker import MemoryBreakdown, PeakTracker, tracked_step
from .analytic import (
    DEFAULT_WEIGHTS,
    BlockActivations,
    MemoryPrediction,
    ModelLayout,
    TimePrediction,
    block_activations,
    dominant_stages,
    layout_of,
    memory_terms,
    model_flops_per_step,
    optimistic,
    predict_memory,
    predict_time,
    stage_builder,
    time_terms,
    vector_peak,
)
from .calibration import Calibration
from .hardware import PRESETS, Hardware, detect_hardware, hardware, hardware_for


@dataclass
class Verdict:
    """Whether a point fits a memory budget, and why not."""

    fits: bool
    predicted: int
    reason: str = ""


class CostModel:
    """Memory and time predictions for one problem (model, template, workload) on one device."""

    def __init__(self, problem: Problem, device: Hardware, calibration: Calibration | None = None,
                 layout: ModelLayout | None = None):
        self.problem, self.device = problem, device
        self.template, self.workload = problem.template, problem.workload
        self.layout = layout or _layout(problem)
        self.precision = self.workload.precision
        # the collective backend the ranks would use: its temporaries are part of the peak (gloo
        # reduce-scatters on a full-size copy of the input; NCCL in place)
        self.backend = "gloo" if device.cores else "nccl"
        self.calibration = calibration or _calibration.load(device.name, self.layout.family, self.precision) or Calibration()

    # ------------------------------------------------------------------ memory
    def memory(self, point: Mapping[str, Any]) -> MemoryPrediction:
        """Analytic peak per stage (calibrated weights where available)."""
        return predict_memory(self.layout, point, self.workload, self.calibration.weights,
                              self.calibration.uncertainty, self.backend)

    def _weights(self) -> dict[str, float]:
        """The memory weights :func:`~.analytic.predict_memory` uses (defaults, then the calibration's)."""
        return {**DEFAULT_WEIGHTS, **(self.calibration.weights or {})}

    def quick_verdicts(self, point: Mapping[str, Any], variants: list[Mapping[str, Any]], budget: int,
                       weights: Mapping[str, float] | None = None) -> tuple[list[bool], list[int]]:
        """``verdict(v, budget).fits`` of each of ``variants`` without the rest of :meth:`memory`,
        and its peak where it fits (where not, a lower bound: the stages that can hold the peak
        are read one at a time, stopping once none fits). ``variants`` are points that differ from
        ``point`` only in what a block keeps (sequence parallelism, checkpoint policy, attention
        kernel, fusion: the knobs only :func:`~.analytic.block_activations` reads), evaluated
        together (numpy arrays, the same float operations per point as one point's)."""
        import numpy as np

        w = weights if weights is not None else self._weights()
        uncertainty = self.calibration.uncertainty
        acts = BlockActivations(*(np.array(f, dtype=float) for f in zip(*map(self._block_activations, variants))))
        stage_terms = stage_builder(self.layout, point, self.workload, self.backend, acts)
        peaks: list[int] = [-1] * len(variants)
        for stage in dominant_stages(self.layout, point):
            totals = vector_peak(stage_terms(stage), w, len(variants)).tolist()
            peaks = [max(p, int(t)) for p, t in zip(peaks, totals)]
            if all(optimistic(p, uncertainty) > budget for p in peaks):
                break
        return [not optimistic(p, uncertainty) > budget for p in peaks], peaks

    def _block_activations(self, point: Mapping[str, Any]) -> BlockActivations:
        """:func:`~.analytic.block_activations`, once per the knobs it reads."""
        key = (point["tp"], point["micro_batch"], point["attn"], point["fuse"], knob_value(point, "sp"),
               point["ckpt_ratio"] > 0, knob_value(point, "ckpt_policy"))
        cache = self.__dict__.setdefault("_acts", {})
        if key not in cache:
            cache[key] = block_activations(self.layout, point, self.workload)
        return cache[key]

    def layout_floor(self, point: Mapping[str, Any], weights: Mapping[str, float] | None = None) -> int:
        """A lower bound of the predicted peak of every point with ``point``'s tp, pp, dp and zero:
        the first and last stages' model states (weights, master weights, optimizer state, the
        constant) and the optimizer step's moment (its temporaries beside the gradients), which no
        micro-batch, checkpointing or other knob changes. 0 where a weight is negative."""
        w = weights if weights is not None else self._weights()
        if min(w.values()) < 0:
            return 0
        floor = 0.0
        for st in memory_terms(self.layout, point, self.workload, self.backend, sorted({0, point["pp"] - 1})):
            opt = st.moments.get("optimizer", {})
            states = sum(w[k] * st.base.get(k, 0.0) for k in ("weights", "master", "optimizer", "constant"))
            step = (w["optimizer_temp"] * opt.get("optimizer_temp", 0.0) + min(w["gradients"], w["gradients_single"])
                    * (opt.get("gradients", 0.0) + opt.get("gradients_single", 0.0)))
            floor = max(floor, states + step)
        return int(floor * (1 - 1e-9))  # a margin for the order the full sums add in

    def exact(self, point: Mapping[str, Any]) -> dict[int, MemoryBreakdown]:
        """Exact peak per stage (one fake step per stage)."""
        from .exact import exact_memory

        return exact_memory(self.problem, point, backend=self.backend)

    def verdict(self, point: Mapping[str, Any], budget: int, exact: bool = False,
                prediction: MemoryPrediction | None = None) -> Verdict:
        """Does ``point`` fit ``budget`` bytes per rank? Prunes only what cannot fit even at the
        optimistic end of the prediction's uncertainty (exact mode has none)."""
        if exact:
            peaks = {s: b.total for s, b in self.exact(point).items()}
            worst = max(peaks, key=peaks.get)
            if peaks[worst] > budget:
                return Verdict(False, peaks[worst], f"exact peak {_fmt(peaks[worst])} on stage {worst} > budget {_fmt(budget)}")
            return Verdict(True, peaks[worst])
        pred = prediction or self.memory(point)
        if pred.lower > budget:
            return Verdict(False, pred.peak, f"predicted peak {_fmt(pred.peak)} (at least {_fmt(pred.lower)}) "
                                             f"on stage {pred.worst_stage} > budget {_fmt(budget)}")
        return Verdict(True, pred.peak)

    def calibrate(self, points: Iterable[Mapping[str, Any]], measured: Iterable[Mapping[int, int]] | None = None,
                  save: bool = True) -> Calibration:
        """Fit the analytic weights to exact-mode peaks of ``points`` (or to ``measured`` peaks per
        stage, same order), and cache them for this device, family and precision."""
        points = list(points)
        peaks = list(measured) if measured is not None else [
            {s: b.total for s, b in self.exact(p).items()} for p in points]
        samples = []
        for point, per_stage in zip(points, peaks):
            terms = memory_terms(self.layout, point, self.workload, self.backend)
            for st in terms:
                if st.stage in per_stage:
                    samples.append((st.events, per_stage[st.stage]))
        fitted = _calibration.fit(samples, "measured" if measured is not None else "exact")
        fitted.time_weights, fitted.time_points = self.calibration.time_weights, self.calibration.time_points
        self.calibration = fitted
        if save:
            _calibration.save(self.calibration, self.device.name, self.layout.family, self.precision)
        return self.calibration

    # -------------------------------------------------------------------- time
    def time(self, point: Mapping[str, Any]) -> TimePrediction:
        return predict_time(self.layout, point, self.workload, self.device, self.calibration.time_weights)

    def calibrate_time(self, points: Iterable[Mapping[str, Any]], step_seconds: Iterable[float],
                       save: bool = True) -> Calibration:
        """Fit the time terms' weights to measured step times of ``points`` (e.g. finished trials)."""
        samples = [(time_terms(self.layout, p, self.workload, self.device), s)
                   for p, s in zip(points, step_seconds) if s and s > 0]
        self.calibration.time_weights = _calibration.fit_time(samples)
        self.calibration.time_points = len(samples)
        if save:
            _calibration.save(self.calibration, self.device.name, self.layout.family, self.precision)
        return self.calibration

    def mfu(self, step_seconds: float, world_size: int) -> float:
        """Model FLOPs utilisation of a measured step time."""
        return model_flops_per_step(self.layout, self.workload) / (step_seconds * world_size * self.device.flops)


def _layout(problem: Problem) -> ModelLayout:
    """A preset's shipped layout when it applies (no overrides, its own template), else measured."""
    from search_spaces import template_for

    from .cards import preset_card

    model, config = problem.model, problem.config
    if not model.overrides and problem.template is template_for(config):
        card = preset_card(model.name)
        if card is not None:
            return card[1]
    return layout_of(config, problem.template)


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


__all__ = [
    "PRESETS", "Calibration", "CostModel", "Hardware", "MemoryBreakdown", "MemoryPrediction", "ModelLayout",
    "PeakTracker", "TimePrediction", "Verdict", "detect_hardware", "hardware", "hardware_for", "layout_of",
    "tracked_step",
]
