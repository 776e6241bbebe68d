"""Cost model: predict the peak memory and step time of schedule points, before running them.

Two fidelities of memory: *analytic* (closed-form terms, microseconds per point, for whole spaces
and ``plan``) and *exact* (one fake step per pipeline stage, seconds per point, equal to a real
step's tensor-level peak on CPU). The analytic weights are calibrated from exact points and cached
per (device, family, precision). Time is analytic (compute, overheads, communication, bubble).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from search_spaces import template_for

from ..errors import UsageError
from ..plan import KNOB_DEFAULTS, accumulation, knob_value
from ..problem import Problem
from ..space import Reads
from ..units import format_size
from . import calibration as _calibration
from .analytic import (
    DEFAULT_WEIGHTS,
    OUR_RUNTIME,
    BlockActivations,
    FsdpHost,
    GradAccumulation,
    LinearFeatures,
    MemoryPrediction,
    ModelLayout,
    Runtime,
    StageTerms,
    TimePrediction,
    _each,
    _flights,
    block_activations,
    blocks_in_flight,
    by_branches,
    checkpointed_in_flight,
    dominant_stages,
    layout_of,
    linear_terms,
    memory_terms,
    model_flops_per_step,
    optimistic,
    point_columns,
    predict_memory,
    predict_steps,
    predict_time,
    samples_per_second,
    stage_builder,
    time_terms,
    vector_peak,
)
from .calibration import Calibration
from .cards import preset_card
from .hardware import PRESETS, Hardware, detect_hardware, hardware, hardware_for

if TYPE_CHECKING:
    from ._tracker import MemoryBreakdown, PeakTracker, tracked_step

# exact mode's tracker imports torch: loaded on first use, so analytic planning runs without it
_TRACKER = ("MemoryBreakdown", "PeakTracker", "tracked_step")


def __getattr__(name: str):
    if name not in _TRACKER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # torch-free: plan and every --help import this module; _tracker imports torch
    from . import _tracker

    return getattr(_tracker, name)


# the knobs that change only what a block keeps (:func:`~.analytic.block_activations`): the points
# that differ only in them are evaluated together
BLOCK_KNOBS = frozenset({"sp", "ckpt_policy", "attn", "fuse"})


def block_groups(points: Sequence[Mapping[str, Any]], indices: Iterable[int]) -> dict[tuple, list[int]]:
    """``indices`` of ``points`` (complete points, their knobs in one order) by their knobs other
    than :data:`BLOCK_KNOBS`: the points :meth:`CostModel.quick_verdicts` evaluates together."""
    groups: dict[tuple, list[int]] = {}
    if not points:
        return groups
    keys = [k for k in points[0] if k not in BLOCK_KNOBS]
    key = operator.itemgetter(*keys) if keys else (lambda p: ())
    for i in indices:
        groups.setdefault(key(points[i]), []).append(i)
    return groups


@dataclass
class Verdict:
    """Whether a point fits a memory budget, and why not."""

    fits: bool
    predicted: int
    reason: str = ""


@dataclass(frozen=True)
class Predictions:
    """:meth:`CostModel.predictions` of some points, one array entry per point."""

    fits: Any  # bool: ``verdict(point, budget).fits``, the analytic verdict (optimistic end)
    # ``memory(point).peak`` where the point fits (within 1e-8 of it: the terms added in another
    # order); where not, a lower bound of it above the budget
    peaks: Any
    throughputs: Any  # ``time(point).throughput``, samples/s, where the point fits; 0 where not


class Variants(Sequence[Mapping[str, Any]]):
    """A group's variants (points that differ only in what a block keeps): each of ``bases`` with
    each of ``tails`` (knobs that replace the base's), made a dict only when one is asked for. What
    :func:`~.analytic.block_activations` reads of them is read once per distinct base and tail, and
    remembered (a group's floor and its verdicts both read it)."""

    def __init__(self, bases: Sequence[Mapping[str, Any]], tails: Sequence[Mapping[str, Any]] = ({},)):
        # tails given as a tuple are kept as they are: groups that share them share what is read of them
        self.bases, self.tails = list(bases), tails if isinstance(tails, tuple) else tuple(tails)
        self.acts_key: int | None = None

    def __len__(self) -> int:
        return len(self.bases) * len(self.tails)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        base, tail = divmod(i, len(self.tails))
        return {**self.bases[base], **self.tails[tail]}


class CostModel:
    """Memory and time predictions for one problem (model, template, workload) on one device."""

    def __init__(self, problem: Problem, device: Hardware, calibration: Calibration | None = None,
                 layout: ModelLayout | None = None, runtime: Runtime = OUR_RUNTIME):
        self.problem, self.device = problem, device
        # the runtime that runs the points, as the time model charges it: ours by default; the
        # published-runs benchmark predicts other frameworks' runs too (FSDP1's host waits,
        # Megatron's gradient accumulation in its GEMMs)
        self.runtime = runtime
        self.template, self.workload = problem.template, problem.workload
        self.layout = layout or _layout(problem)
        self.precision = self.workload.precision
        if self.workload.mode.fp8 and not device.fp8_flops:
            raise UsageError(f"precision fp8: {device.name} has no FP8 tensor cores (no fp8_flops); "
                             f"choose a preset with FP8 ({', '.join(k for k, v in PRESETS.items() if v.fp8_flops)}) "
                             f"or bf16")
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
        and a peak: where it fits, one that is above ``budget`` exactly where the predicted peak
        is; where not, a lower bound of the predicted peak. ``variants`` are points that differ from
        ``point`` only in what a block keeps (sequence parallelism, checkpoint policy, attention
        kernel, fusion: the knobs only :func:`~.analytic.block_activations` reads), evaluated
        together: :meth:`group_verdicts` of one group."""
        return self.group_verdicts([(point, variants)], budget, weights)[0]

    def group_verdicts(self, groups: Sequence[tuple[Mapping[str, Any], list[Mapping[str, Any]]]], budget: int,
                       weights: Mapping[str, float] | None = None, differ: Iterable[str] | None = None
                       ) -> list[tuple[list[bool], list[int]]]:
        """:meth:`quick_verdicts` of each ``(point, variants)`` of ``groups``, all evaluated at once.

        Each event's total is the product of the terms' multiples of what a block keeps
        (:func:`~.analytic.linear_terms`, the knobs read once for a group) with each variant's
        (:class:`~.analytic.LinearFeatures`): the predicted peak's products added in another
        order, within 1e-9 of the total (of the sum of the terms' magnitudes, where one is
        negative) of it. The multiples of every group's stages that can hold the peak
        (:func:`~.analytic.dominant_stages`) are one batch of rows, the knobs array columns
        (:func:`~.analytic.stage_builder`, rows that branch apart run apart). Variants that differ
        from their point in a knob the stages read are evaluated apart; where the margin leaves a
        verdict or the side of the budget open, or a feature is negative or a term unknown: as
        :meth:`memory` adds them. ``differ``: the only knobs in which any variant may differ from its
        point, where the caller knows them (else each variant is compared)."""
        w = weights if weights is not None else self._weights()
        results: list[tuple[list[bool], list[int]] | None] = [None] * len(groups)
        batches: dict[tuple, list[int]] = {}  # groups by their points' knobs (the columns)
        matrices = [self._feature_matrix(variants) for _, variants in groups]
        for g, (point, variants) in enumerate(groups):
            if matrices[g] is None:
                results[g] = self._exact_verdicts(point, variants, budget, w)
            else:
                batches.setdefault(tuple(point), []).append(g)
        for members in batches.values():
            verdicts = self._linear_verdicts([groups[g] for g in members], [matrices[g] for g in members], budget, w,
                                             None if differ is None else set(differ))
            for g, result in zip(members, verdicts):
                results[g] = result
        return results  # type: ignore[return-value]

    def _linear_verdicts(self, groups: list[tuple[Mapping[str, Any], list[Mapping[str, Any]]]], matrices: list,
                         budget: int, w: Mapping[str, float], differ: set[str] | None
                         ) -> list[tuple[list[bool], list[int]]]:
        """:meth:`group_verdicts` of groups whose points have the same knobs, their variants'
        features known (``matrices``: :meth:`_feature_matrix`)."""
        import numpy as np

        points = [point for point, _ in groups]
        stages = [dominant_stages(self.layout, point) for point in points]
        row_group = np.repeat(np.arange(len(groups)), [len(s) for s in stages])
        read = {"pp", "ckpt_ratio", "vpp"}  # what dominant_stages reads
        batches = self._linear_stages(points, stages, lambda st, n: linear_terms(st, w, n), read)
        width = max(m.shape[1] for m in matrices)
        features = np.zeros((len(groups), matrices[0].shape[0], width))
        for g, m in enumerate(matrices):
            features[g, :, :m.shape[1]] = m
        counts = np.array([m.shape[1] for m in matrices])
        valid = np.arange(width) < counts[:, None]  # the padding of groups of fewer variants: not evaluated
        totals = np.where(valid, -np.inf, 0.0)
        sizes = np.zeros((len(groups), width))  # the largest sum of the magnitudes of an event's terms, where one is negative
        unknown = np.zeros(len(groups), dtype=bool)  # a term without a feature
        for rows, events in batches:
            where = row_group[rows]
            if events is None:
                unknown[where] = True
                continue
            events, magnitudes = events
            np.maximum.at(totals, where, np.matmul(events, features[where]).max(axis=1))
            if magnitudes is not None:
                np.maximum.at(sizes, where, np.matmul(magnitudes, features[where]).max(axis=1))
        # the predicted peak (an int) is between these: the verdict and the side of the budget
        # are known where both ends agree (the optimistic end of each, as optimistic() takes it)
        # (int() truncates; np.trunc of these floats, far below 2**53, is the same whole number)
        keep = 1 - self.calibration.uncertainty
        margin = 1e-9 * np.maximum(np.abs(totals), sizes) + 2
        low, high = np.trunc(totals - margin), np.trunc(totals + margin)
        pruned = np.trunc(low * keep) > budget
        open_ = valid & ((pruned != (np.trunc(high * keep) > budget)) | (~pruned & ((low > budget) != (high > budget))))
        opened = set(np.flatnonzero(open_.any(axis=1)).tolist())
        all_oks, all_peaks = (~pruned).tolist(), low.astype(np.int64).tolist()
        results, apart = [], {}
        for g, (point, variants) in enumerate(groups):
            parts = None if differ is not None and not read & differ else _apart(read, point, variants)
            if parts is not None:  # the stages read a knob in which the variants differ
                apart[g] = parts
                results.append(None)
                continue
            if unknown[g]:
                results.append(self._exact_verdicts(point, variants, budget, w))
                continue
            n = len(variants)
            oks, peaks = all_oks[g][:n], all_peaks[g][:n]
            where = np.flatnonzero(open_[g, :n]).tolist() if g in opened else []
            if where:
                for i, ok, peak in zip(where, *self._exact_verdicts(point, [variants[i] for i in where], budget, w)):
                    oks[i], peaks[i] = ok, peak
            results.append((oks, peaks))
        if apart:
            parts = [part for g in apart for part in apart[g].values()]
            verdicts = iter(self.group_verdicts([(members[0], members) for _, members in parts], budget, w))
            for g in apart:
                results[g] = _merged(apart[g], lambda members: next(verdicts))
        return results

    def _feature_matrix(self, variants: list[Mapping[str, Any]]):
        """The (features, variants) matrix of ``variants``' :class:`~.analytic.LinearFeatures`, or
        None where one is negative; once per the knobs :func:`~.analytic.block_activations` reads."""
        import numpy as np

        key = self._variants_key(variants)
        cache = self.__dict__.setdefault("_feature_matrices", {})
        if key not in cache:
            matrix = np.array([self._features(v) for v in variants]).T.copy()
            cache[key] = None if matrix.min() < 0 else matrix
        return cache[key]

    def _exact_verdicts(self, point: Mapping[str, Any], variants: list[Mapping[str, Any]], budget: int,
                        weights: Mapping[str, float]) -> tuple[list[bool], list[int]]:
        """:meth:`quick_verdicts` by the predicted peaks' own float operations (numpy arrays, the
        same per point as one point's): where a variant fits, its predicted peak."""
        import numpy as np

        uncertainty = self.calibration.uncertainty
        acts = BlockActivations(*(np.array(f, dtype=float) for f in zip(*map(self._block_activations, variants))))
        reads = Reads(point)
        stage_terms = stage_builder(self.layout, reads, self.workload, self.backend, acts)
        peaks: list[int] = [-1] * len(variants)
        for stage in dominant_stages(self.layout, reads):
            totals = vector_peak(stage_terms(stage), weights, len(variants)).tolist()
            peaks = [max(p, int(t)) for p, t in zip(peaks, totals)]
            if all(optimistic(p, uncertainty) > budget for p in peaks):
                break
        apart = _apart(reads.read, point, variants)
        if apart is not None:
            return _merged(apart, lambda members: self._exact_verdicts(members[0], members, budget, weights))
        return [not optimistic(p, uncertainty) > budget for p in peaks], peaks

    def _variants_key(self, variants: list[Mapping[str, Any]]) -> tuple | int:
        """What :func:`~.analytic.block_activations` reads of each of ``variants`` (remembered by a
        :class:`Variants` list: a group's floor and its verdicts read it)."""
        if not isinstance(variants, Variants):
            return tuple(map(self._acts_key, variants))
        if variants.acts_key is None:
            # by what the bases and the tails give of the knobs read (groups share them; most share
            # one tuple of tails, read once), numbered: a number is hashed faster than the keys
            known = self.__dict__.setdefault("_acts_keys", {})
            numbers = self.__dict__.setdefault("_acts_numbers", {})
            tails = self.__dict__.setdefault("_tails_read", {})
            if id(variants.tails) not in tails:  # the tails kept beside: their id is not reused
                tails[id(variants.tails)] = (variants.tails, tuple(tuple(map(t.get, _ACTS_READ, _UNSET))
                                                                   for t in variants.tails))
            read = (tuple(tuple(map(b.get, _ACTS_READ, _UNSET)) for b in variants.bases), tails[id(variants.tails)][1])
            if read not in known:
                key = tuple(self._acts_key({**b, **t}) for b in variants.bases for t in variants.tails)
                known[read] = numbers.setdefault(key, len(numbers))
            variants.acts_key = known[read]
        return variants.acts_key

    @staticmethod
    def _acts_key(point: Mapping[str, Any]) -> tuple:
        """The knobs :func:`~.analytic.block_activations` reads (of the checkpoint ratio, whether
        there is one)."""
        try:
            return _ACTS_KNOBS(point), point["ckpt_ratio"] > 0
        except KeyError:  # a point without the knobs added since (plan.KNOB_DEFAULTS)
            return tuple(knob_value(point, k) for k in _ACTS_KNOBS_NAMES), point["ckpt_ratio"] > 0

    def _block_activations(self, point: Mapping[str, Any]) -> BlockActivations:
        """:func:`~.analytic.block_activations`, once per the knobs it reads."""
        key = self._acts_key(point)
        cache = self.__dict__.setdefault("_acts", {})
        if key not in cache:
            cache[key] = block_activations(self.layout, point, self.workload, self.backend)
        return cache[key]

    def _features(self, point: Mapping[str, Any]) -> LinearFeatures:
        """:class:`~.analytic.LinearFeatures` of :meth:`_block_activations`, once per the knobs it reads."""
        key = self._acts_key(point)
        cache = self.__dict__.setdefault("_linear", {})
        if key not in cache:
            cache[key] = LinearFeatures.of(self._block_activations(point))
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

    def group_floor(self, point: Mapping[str, Any], variants: list[Mapping[str, Any]],
                    weights: Mapping[str, float] | None = None) -> int:
        """A lower bound of the predicted peak of every one of ``variants``, points that differ
        from ``point`` only in what a block keeps (as :meth:`quick_verdicts` takes them), without
        building their stages: on the first and the last stage, the model states (as
        :meth:`layout_floor`) beside the activations of the micro-batches the stage holds before
        its first backward (the forward's moment) or, accumulating, after it beside the
        accumulated gradients (the loss's), each block keeping the least any variant's does. 0
        where a weight is negative. :meth:`group_floors` of one group."""
        return self.group_floors([point], [variants], weights)[0]

    def group_floors(self, points: Sequence[Mapping[str, Any]], variants: Sequence[list[Mapping[str, Any]]],
                     weights: Mapping[str, float] | None = None) -> list[int]:
        """:meth:`group_floor` of each of ``points`` and its ``variants``, evaluated together (the
        per-group sizes looked up, once per distinct key; the floors as array operations)."""
        import numpy as np

        w = weights if weights is not None else self._weights()
        if min(w.values()) < 0 or not points:
            return [0] * len(points)
        layout = self.layout
        pp = np.array([p["pp"] for p in points])
        vpp = np.array([knob_value(p, "vpp") if p["pp"] > 1 else 1 for p in points])
        m = np.array([accumulation(self.workload, p["dp"], p["micro_batch"]) for p in points])
        ratio = np.array([p["ckpt_ratio"] for p in points])
        schedule = np.array([p["pipeline_schedule"] for p in points])
        least = np.array([self._least_kept(v, w) for v in variants]).reshape(-1, 2)
        plain, kept = least[:, 0], least[:, 1]
        floor = np.zeros(len(points))
        for stages in (np.zeros_like(pp), pp - 1):  # the first stage, the last
            # the blocks a micro-batch in flight holds, as the stage's terms count them
            in_flight = _each(blocks_in_flight, layout.layers, pp, stages, vpp, m).astype(float)
            states, gradients = self._stage_floors(points, stages.tolist(), w).T
            ckpt = _each(checkpointed_in_flight, ratio, layout.layers, pp, stages, vpp, m).astype(float)
            block = (in_flight - ckpt) * plain + ckpt * kept
            fresh, held = (a.astype(float) for a in _each(_flights, pp, schedule, stages, m, vpp))
            moment = np.where(m > 1, np.maximum(fresh * block, gradients + held * block), fresh * block)
            floor = np.maximum(floor, states + moment)
        return np.trunc(floor * (1 - 1e-9)).astype(np.int64).tolist()  # a margin for the order the full sums add in

    def _weighted(self, name: str, weights: Mapping[str, float]) -> dict:
        """A cache of values that depend on ``weights`` (emptied when they change)."""
        caches = self.__dict__.setdefault("_weighted_caches", {})
        if caches.get(name, (None,))[0] != weights:
            caches[name] = (dict(weights), {})
        return caches[name][1]

    def _least_kept(self, variants: list[Mapping[str, Any]], weights: Mapping[str, float]) -> tuple[float, float]:
        """The least any of ``variants``' blocks keeps, weighted: not checkpointed, and checkpointed
        (its input; selective: and its matmul outputs)."""
        cache = self._weighted("least_kept", weights)
        key = self._variants_key(variants)
        if key not in cache:
            w = weights
            acts = [self._block_activations(v) for v in variants]
            cache[key] = (min(w["act_replicated"] * a.replicated + w["act_parallel"] * a.parallel
                              + w["act_scores"] * a.scores + w["act_fused"] * a.fused for a in acts),
                          min(w["act_checkpointed"] * a.input + w["act_selective"] * a.selective for a in acts))
        return cache[key]

    def _stage_floors(self, points: Sequence[Mapping[str, Any]], stages: Sequence[int],
                      weights: Mapping[str, float]):
        """Each point's stage's weighted model states (as :meth:`layout_floor`) and, accumulating,
        the gradients its loss moment holds (an (n, 2) array): once per layout, micro-batch size,
        stage and vpp, the missing ones evaluated together (:func:`~.analytic.stage_builder`'s
        columns; neither reads what a block keeps)."""
        import numpy as np

        cache = self._weighted("stage_floor", weights)
        # vpp: an interleaved stage with no steady state accumulates less at its loss (stage_builder)
        keys = [(p["tp"], p["pp"], p["dp"], p["zero"], p["micro_batch"], stage,
                 knob_value(p, "vpp") if p["pp"] > 1 else 1, knob_value(p, "cp")) for p, stage in zip(points, stages)]
        missing: dict[tuple, tuple[Mapping[str, Any], int]] = {}
        for key, p, stage in zip(keys, points, stages):
            if key not in cache and key not in missing:
                missing[key] = (p, stage)
        if missing:
            def floors(st: StageTerms, n: int):
                loss = st.moments.get("loss", {})  # there only when accumulating
                states = sum(weights[k] * st.base.get(k, 0.0) for k in ("weights", "master", "optimizer", "constant"))
                return np.broadcast_to(states, n), np.broadcast_to(weights["gradients"] * loss.get("gradients", 0.0), n)

            new = list(missing)
            todo = missing.values()
            for rows, (states, gradients) in self._linear_stages([p for p, _ in todo], [[s] for _, s in todo], floors):
                for r, s, g in zip(rows.tolist(), states.tolist(), gradients.tolist()):
                    cache[new[r]] = (s, g)
        return np.array([cache[key] for key in keys]).reshape(-1, 2)

    def _linear_stages(self, points: Sequence[Mapping[str, Any]], stages: Sequence[Sequence[int]],
                       evaluate: Callable[[StageTerms, int], Any], read: set[str] | None = None
                       ) -> list[tuple[Any, Any]]:
        """``evaluate(terms, rows)`` of the ``linear`` stage terms (:func:`~.analytic.stage_builder`)
        of each of ``points`` at each of its ``stages``, every (point, stage) a row of one batch (the
        knobs array columns; rows that branch apart run apart): ``(rows, result)`` per part, rows
        numbered point by point, stage by stage. ``read`` gathers the knobs the stages read."""
        import numpy as np

        per_point = [len(s) for s in stages]
        columns = {k: np.repeat(np.array([knob_value(p, k) for p in points]), per_point) for k in points[0]}
        columns[_STAGE] = np.array([s for of_point in stages for s in of_point])

        def run(batch: dict[str, Any]):
            reads = Reads({k: v for k, v in batch.items() if k != _STAGE})
            terms = stage_builder(self.layout, reads, self.workload, self.backend, linear=True)(batch[_STAGE])
            if read is not None:
                read.update(reads.read)
            return evaluate(terms, len(batch[_STAGE]))

        return by_branches(columns, run)

    def exact(self, point: Mapping[str, Any]) -> dict[int, MemoryBreakdown]:
        """Exact peak per stage (one fake step per stage)."""
        # torch-free: plan and every --help import this module; .exact imports torch
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
                return Verdict(False, peaks[worst], f"exact peak {format_size(peaks[worst])} on stage {worst} > budget {format_size(budget)}")
            return Verdict(True, peaks[worst])
        pred = prediction or self.memory(point)
        if pred.lower > budget:
            return Verdict(False, pred.peak, f"predicted peak {format_size(pred.peak)} (at least {format_size(pred.lower)}) "
                                             f"on stage {pred.worst_stage} > budget {format_size(budget)}")
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
        return predict_time(self.layout, point, self.workload, self.device, self.calibration.time_weights,
                            self.runtime)

    def throughputs(self, points: Sequence[Mapping[str, Any]]):
        """``time(p).throughput(workload)`` of each of ``points`` (a numpy array), evaluated together."""
        return self.column_throughputs(point_columns(points))

    def predictions(self, points: Sequence[Mapping[str, Any]], budget: int) -> Predictions:
        """Every one of ``points``' analytic verdict, predicted peak and throughput, evaluated
        together (what a search ranks a whole space by: one point at a time, a large model's space
        of 10^5-10^6 points takes minutes). A layout whose model states alone cannot fit
        (:meth:`layout_floor`) is pruned whole, its floor the peaks' bound; of the others, points
        that differ only in what a block keeps are one group: pruned whole where its floor cannot
        fit (:meth:`group_floors`), else evaluated by :meth:`group_verdicts`; the throughputs only
        of the points that fit, at once (as ``plan`` evaluates a space)."""
        import numpy as np

        complete = [{**KNOB_DEFAULTS, **p} for p in points]
        fits, peaks = np.zeros(len(complete), dtype=bool), np.zeros(len(complete), dtype=np.int64)
        # a layout whose model states alone cannot fit (layout_floor, as plan prunes them): its
        # points' peak is at least its floor, which is above the budget
        weights, floors, evaluated = self._weights(), {}, []
        for i, p in enumerate(complete):
            layout = (p["tp"], p["pp"], p["dp"], p["zero"])
            if layout not in floors:
                floors[layout] = self.layout_floor(p, weights)
            if optimistic(floors[layout], self.calibration.uncertainty) > budget:
                peaks[i] = floors[layout]
            else:
                evaluated.append(i)
        # of the others, groups whose model states and activations alone cannot fit (group_floors)
        groups, members = [], []
        for group in block_groups(complete, evaluated).values():
            groups.append(group)
            members.append([complete[i] for i in group])
        group_floors = self.group_floors([m[0] for m in members], members, weights)
        floored = [optimistic(floor, self.calibration.uncertainty) > budget for floor in group_floors]
        verdicts = iter(self.group_verdicts([(m[0], m) for m, out in zip(members, floored) if not out],
                                            budget, weights, differ=BLOCK_KNOBS))
        for group, floor, out in zip(groups, group_floors, floored):
            if out:
                peaks[group] = floor
            else:
                oks, group_peaks = next(verdicts)
                fits[group], peaks[group] = oks, group_peaks
        throughputs = np.zeros(len(complete))
        fit = np.flatnonzero(fits)
        if len(fit):
            throughputs[fit] = self.throughputs([complete[i] for i in fit.tolist()])
        return Predictions(fits, peaks, throughputs)

    def column_throughputs(self, columns: Mapping[str, Any]):
        """:meth:`throughputs` of points given as one array per knob (:func:`~.analytic.point_columns`)."""
        steps = predict_steps(self.layout, columns, self.workload, self.device, self.calibration.time_weights,
                              self.runtime)
        return samples_per_second(self.workload.global_batch, steps)

    def calibrate_time(self, points: Iterable[Mapping[str, Any]], step_seconds: Iterable[float],
                       save: bool = True) -> Calibration:
        """Fit the time terms' weights to measured step times of ``points`` (e.g. finished trials)."""
        samples = [(time_terms(self.layout, p, self.workload, self.device, runtime=self.runtime), s)
                   for p, s in zip(points, step_seconds) if s and s > 0]
        self.calibration.time_weights = _calibration.fit_time(samples)
        self.calibration.time_points = len(samples)
        if save:
            _calibration.save(self.calibration, self.device.name, self.layout.family, self.precision)
        return self.calibration

    def mfu(self, step_seconds: float, world_size: int) -> float:
        """Model FLOPs utilisation of a step time: the model's FLOPs (no recomputation) over the
        devices' peak, the conventional MFU (PaLM, Chowdhery et al. 2022). A GPU's peak is its
        datasheet's; a CPU's, every core at the measured one-thread GEMM rate (its ranks share them)."""
        hw = self.device
        peak = hw.flops * hw.cores if hw.cores else (hw.peak_flops or hw.flops) * world_size
        return model_flops_per_step(self.layout, self.workload) / (step_seconds * peak)


_STAGE = "\0stage"  # group_verdicts' column of each row's stage (no knob's name)
# what block_activations reads of a point besides whether there is a checkpoint ratio
_ACTS_KNOBS_NAMES = ("tp", "micro_batch", "attn", "fuse", "sp", "ckpt_policy", "cp")
_ACTS_KNOBS = operator.itemgetter(*_ACTS_KNOBS_NAMES)
_ACTS_READ = (*_ACTS_KNOBS_NAMES, "ckpt_ratio")  # all _acts_key reads
_UNSET = (object(),) * len(_ACTS_READ)  # a knob a base or a tail leaves to the other


def _apart(read_names: set[str], point: Mapping[str, Any], variants: list[Mapping[str, Any]]) -> dict | None:
    """``variants`` (indices) by the values of the knobs of ``read_names`` in which they differ
    from ``point``; None where they differ in none (evaluated together rightly)."""
    names = [k for k in read_names if k in point]
    read = operator.itemgetter(*names) if names else (lambda v: ())
    mine = read(point)
    if all(read(v) == mine for v in variants):
        return None
    differ = [k for k in names if any(v[k] != point[k] for v in variants)]
    apart: dict[tuple, list[int]] = {}
    for i, v in enumerate(variants):
        apart.setdefault(tuple(v.get(k) for k in differ), []).append(i)
    return {key: (members, [variants[i] for i in members]) for key, members in apart.items()}


def _merged(apart: dict, evaluate) -> tuple[list[bool], list[int]]:
    """The verdicts of each part of ``apart`` (:func:`_apart`) by ``evaluate``, in the variants' order."""
    n = sum(len(members) for members, _ in apart.values())
    oks, peaks = [False] * n, [0] * n
    for members, variants in apart.values():
        for i, ok, peak in zip(members, *evaluate(variants)):
            oks[i], peaks[i] = ok, peak
    return oks, peaks


def _layout(problem: Problem) -> ModelLayout:
    """A preset's shipped layout when it applies (no overrides, its own template), else measured."""
    model, config = problem.model, problem.config
    if not model.overrides and problem.template is template_for(config):
        card = preset_card(model.name)
        if card is not None:
            return card[1]
    return layout_of(config, problem.template)


__all__ = [
    "OUR_RUNTIME", "PRESETS", "Calibration", "CostModel", "FsdpHost", "GradAccumulation", "Hardware", "MemoryBreakdown", "MemoryPrediction", "ModelLayout",
    "PeakTracker", "Runtime", "TimePrediction", "Variants", "Verdict", "detect_hardware", "hardware", "hardware_for", "layout_of",
    "tracked_step",
]
