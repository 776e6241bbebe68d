"""The ranking of a space's points by the cost model alone: every legal point's verdict, the best
point of each layout that fits, and the pruned points of smallest peak. ``slapo-tune plan`` prints
it, ``tune`` asks it whether anything fits before it starts, the benchmarks rank published
configurations with it (:func:`rank_points`)."""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._partition import rank_block_counts
from ..plan import KNOB_DEFAULTS, Plan, knob_value
from . import BLOCK_KNOBS, Predictions, Variants, block_groups
from ._columns import row_codes
from .analytic import optimistic

if TYPE_CHECKING:
    from ..problem import Problem
    from . import CostModel


class Ranking:
    """What ``plan`` found: counts, the rows it shows, and the pruned points (some only bounded)."""

    def __init__(self, points: int, rows: list[dict], pruned: int, examples: list[dict]):
        self.points, self.rows, self.pruned, self.examples = points, rows, pruned, examples
        self.feasible = 0
        # (peak, index, False, row); (a lower bound of the peak, index, True, the point's knobs); or
        # (a lower bound of the peaks of some points, the first's index, _LAZY, a function of the
        # cost model and budget listing those points' entries)
        self.pruned_rows: list[tuple[int, int, bool | int, Any]] = []

    def smallest(self, model, budget: int, k: int) -> list[dict]:
        """The ``k`` pruned rows of smallest peak (first in space order among equal peaks), as a
        sort of every pruned row would give: a point known by a lower bound of its peak only is
        evaluated once that bound comes first (points pruned together are listed then)."""

        heap = list(self.pruned_rows)
        heapq.heapify(heap)
        out: list[dict] = []
        while heap and len(out) < k:
            peak, index, bounded, item = heapq.heappop(heap)
            if bounded == _LAZY:
                for entry in item(model, budget):
                    heapq.heappush(heap, entry)
            elif bounded:
                row = point_row(model, Plan.of(item, model.workload), budget)
                heapq.heappush(heap, (row["peak"], index, False, row))
            else:
                out.append(item)
        return out


_LAZY = 2  # _Found.pruned_rows: the entry stands for several points' (after a point's: True == 1)


def _subtree_entries(space, prefix: dict, first: int, bound: int):
    """A function of the cost model and budget listing the ``_Found.pruned_rows`` entries of the
    points of ``prefix`` (indices from ``first``, peaks at least ``bound``), each bounded by the
    larger of ``bound`` and the stages :meth:`CostModel.group_verdicts` reads."""

    def entries(model, budget: int) -> list[tuple[int, int, bool, Any]]:
        raws = list(space.enumerate(prefix))
        points = [{**KNOB_DEFAULTS, **raw} for raw in raws]
        bounds = [bound] * len(points)
        groups = list(block_groups(points, range(len(points))).values())
        verdicts = model.group_verdicts([(points[members[0]], [points[i] for i in members]) for members in groups],
                                        budget)
        for members, (_, peaks) in zip(groups, verdicts):
            for i, peak in zip(members, peaks):
                bounds[i] = max(bound, peak)
        return [(b, first + i, True, raw) for i, (b, raw) in enumerate(zip(bounds, raws))]

    return entries


def _listed_entries(bounds, indices, knobs_of, members):
    """A function listing the ``_Found.pruned_rows`` entries of the points ``members`` (positions in
    ``bounds`` and ``indices``; their knobs by ``knobs_of``)."""
    return lambda model, budget: [(int(bounds[v]), int(indices[v]), True, knobs_of(v)) for v in members.tolist()]


def _stem_entries(stems: list[tuple[int, dict, Any]], tail: list[dict], bound: int):
    """A function listing the ``_Found.pruned_rows`` entries of the points the ``(first index,
    knobs)`` of ``stems`` stand for (each ``tail`` in turn), all bounded by ``bound``."""
    return lambda model, budget: [(bound, first + c, True, {**stem, **t}) for first, stem, *_ in stems
                                  for c, t in enumerate(tail)]


def point_row(model: CostModel, point: Plan, budget: int) -> dict:
    """One point's row: its memory prediction, verdict and (where it fits) time."""
    mem = model.memory(point)
    verdict = model.verdict(point, budget, prediction=mem)
    timing = model.time(point) if verdict.fits else None
    return {"point": point.knobs(), "peak": mem.peak, "upper": mem.upper, "stage": mem.worst_stage,
            "breakdown": mem.breakdown, "step_s": timing.step if timing else None,
            "throughput": timing.throughput(model.workload) if timing else None, "fits": verdict.fits,
            "reason": verdict.reason, "stage_blocks": _stage_blocks(model.layout.layers, point)}


def _stage_blocks(layers: int, point) -> list[int]:
    """The blocks each pipeline rank holds (one number without a pipeline)."""

    return rank_block_counts(layers, point["pp"], knob_value(point, "vpp"))


# what CostModel.layout_floor reads of a point
_LAYOUT_KNOBS = ("tp", "pp", "dp", "zero")
# the knobs whose values make a layout the top list shows once (dp follows from them)
DISTINCT_LAYOUT = ("tp", "pp", "cp")


class _Walk:
    """How :func:`rank_points` and :func:`fitting_points` walk a space: by blocks (the knobs
    before the first block knob: a group's points are in one block), each cut into subtrees (the
    knobs up to the layout's and the micro-batch size), listed by stems (a point but its trailing
    knobs of fixed domains that change only what a block keeps: each stem stands for every one
    of their ``combos``)."""

    def __init__(self, space) -> None:
        names, knobs = space.names, space.knobs
        self.space = space
        self.depth = max(names.index(k) for k in (*_LAYOUT_KNOBS, "micro_batch")) + 1
        self.block_depth = min([names.index(k) for k in BLOCK_KNOBS if k in names] + [self.depth])
        stem_depth = len(names)
        while (not space.constraints and stem_depth > self.depth and names[stem_depth - 1] in BLOCK_KNOBS
               and knobs[stem_depth - 1].derive is None and not callable(knobs[stem_depth - 1].choices)
               and knobs[stem_depth - 1].choices):
            stem_depth -= 1
        self.stem_depth = stem_depth
        self.combos = [dict(zip(names[stem_depth:], values))
                       for values in itertools.product(*(knob.choices for knob in knobs[stem_depth:]))]

    def stems_of(self, sub: dict):
        """The stems of subtree ``sub``, in the space's order."""
        space = self.space
        return space.enumerate(sub) if space.constraints else space.prefixes(self.stem_depth, sub)


class _Evaluation:
    """What :func:`_evaluate` finds of a space: every point's verdict but those its floors prune,
    and the throughput of those that fit.

    ``stems``: (first index, knobs, complete but the tail) of the stems of the layouts that may
    fit, each standing for every one of ``combos`` (their points' indices the first's on); their
    ``groups`` (indices in ``stems``), each one's ``variants`` and ``floors``: the groups
    ``floored`` (indices in ``groups``) and the ``evaluated``. The evaluated points as flat
    arrays: ``oks``, ``peaks``, ``stem_of``, ``tail_of`` (in ``combos``), ``index_of``,
    ``group_of`` (in ``evaluated``); of those that fit (``fit``, positions in those arrays), their
    knobs as ``columns`` and their ``throughputs``. ``layout_floors``: each layout's floor;
    ``points``: the index after the last point."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def knobs_of(self, v: int) -> dict:
        """The knobs of evaluated point ``v`` (a position in the flat arrays)."""
        return {**self.stems[self.stem_of[v]][1], **self.combos[self.tail_of[v]]}


def _evaluate(model: CostModel, space, workload, budget: int, weights: dict[str, float],
              layout_pruned: Callable[[dict, dict, int, int], int]) -> _Evaluation:
    """Every point's verdict, as :meth:`CostModel.predictions` of the whole space gives it, without
    listing the whole space (see :func:`rank_points`); ``layout_pruned(block, sub, index, bound)``
    is told of each subtree ``sub`` (of ``block``) whose layout's floor ``bound`` prunes it, its
    first point's index ``index``, and gives the number of points it holds (0: not counted)."""
    uncertainty = model.calibration.uncertainty
    walk = _Walk(space)
    combos = walk.combos
    width = len(combos)  # the points a stem stands for
    checked: set[tuple] = set()
    floors: dict[tuple, int] = {}
    stems: list[tuple[int, dict, dict]] = []  # (first index, knobs, complete but the tail) to evaluate
    groups: list[list[int]] = []  # stems (indices in ``stems``) evaluated together
    index = 0
    for block in space.prefixes(walk.block_depth):
        start = len(stems)
        for sub in space.prefixes(walk.depth, block):
            listed = walk.stems_of(sub)
            head = next(listed, None)
            if head is None:
                continue
            first = {**head, **combos[0]}
            shape = (sub["tp"], sub["pp"], sub["dp"], sub["micro_batch"])
            if shape not in checked:  # what Plan.of checks (the knobs, the batch and world sizes)
                Plan.of(first, workload)
                checked.add(shape)
            layout = tuple(sub[k] for k in _LAYOUT_KNOBS)
            if layout not in floors:
                floors[layout] = model.layout_floor({**KNOB_DEFAULTS, **first}, weights)
            if optimistic(floors[layout], uncertainty) > budget:
                index += layout_pruned(block, sub, index, floors[layout])
                continue
            for stem in itertools.chain((head,), listed):
                stems.append((index, stem, {**KNOB_DEFAULTS, **stem}))
                index += width
        groups += [[start + s for s in group]
                   for group in block_groups([point for *_, point in stems[start:]], range(len(stems) - start)).values()]
    # groups whose model states and activations alone cannot fit: pruned together, unlisted
    tails = tuple(combos)  # one tuple all groups share (Variants reads it once)
    variants = [Variants([stems[s][2] for s in group], tails) for group in groups]
    heads = [v[0] for v in variants]
    group_floors = model.group_floors(heads, variants, weights)
    floored = [g for g, floor in enumerate(group_floors) if optimistic(floor, uncertainty) > budget]
    evaluated = [g for g, floor in enumerate(group_floors) if not optimistic(floor, uncertainty) > budget]
    verdicts = model.group_verdicts([(heads[g], variants[g]) for g in evaluated], budget, weights, BLOCK_KNOBS)
    # every evaluated point as flat arrays: verdict, peak, stem, tail (in ``combos``), index, group
    chain = itertools.chain.from_iterable
    oks = np.fromiter(chain(oks for oks, _ in verdicts), dtype=bool)
    peaks = np.fromiter(chain(peaks for _, peaks in verdicts), dtype=np.int64)
    stem_of = np.repeat(np.fromiter(chain(groups[g] for g in evaluated), dtype=np.int64), width)
    tail_of = np.tile(np.arange(width), len(stem_of) // width)
    index_of = np.array([i for i, *_ in stems], dtype=np.int64)[stem_of] + tail_of if stems else stem_of
    group_of = np.repeat(np.arange(len(evaluated)), [len(groups[g]) * width for g in evaluated])
    # the points that fit, their knobs as columns, and their throughputs, all at once
    fit = np.flatnonzero(oks)
    used, inverse = np.unique(stem_of[fit], return_inverse=True)
    columns = {k: np.array([c[k] for c in combos])[tail_of[fit]] if k in combos[0] else
               np.array([stems[s][2][k] for s in used.tolist()])[inverse.reshape(-1)] for k in {**stems[0][2], **combos[0]}
               } if len(fit) else {}
    throughputs = model.column_throughputs(columns) if len(fit) else np.zeros(0)
    return _Evaluation(points=index, stems=stems, groups=groups, variants=variants, floors=group_floors,
                       floored=floored, evaluated=evaluated, oks=oks, peaks=peaks, stem_of=stem_of, tail_of=tail_of,
                       index_of=index_of, group_of=group_of, combos=combos, fit=fit, columns=columns,
                       throughputs=throughputs, layout_floors=floors, walk=walk)


def rank_points(model: CostModel, problem: Problem, budget: int, top: int, distinct: tuple[str, ...] = DISTINCT_LAYOUT) -> Ranking:
    """Every legal point's verdict, and the rows ``plan`` shows, as evaluating each point fully
    (:func:`_row`) and sorting would give, for less:

    * the space is walked by prefixes up to the layout's knobs (tp, pp, dp, zero) and the micro-batch
      size (:meth:`Space.prefixes`): a layout whose model states alone cannot fit
      (:meth:`CostModel.layout_floor`, with the verdict's margin) prunes its points unlisted
      (counted by :meth:`Space.completions`);
    * the other points are listed up to the trailing knobs of fixed domains that change only what a
      block keeps (attn, fuse): each such stem stands for their product;
    * points that differ only in what a block keeps (sp, ckpt_policy, attn, fuse) form a group: a
      group whose model states and activations alone cannot fit (:meth:`CostModel.group_floors`)
      is pruned unevaluated; the others are evaluated together, every group at once
      (:meth:`CostModel.group_verdicts`, which evaluates apart what its stages tell apart);
    * the pruned points are bounded together (per prefix or group) and listed only when asked;
    * step time only for the points that fit (every knob may change it), all at once
      (:meth:`CostModel.column_throughputs`); full rows only for the shown ones: the best point of
      each layout (``distinct``'s knobs; ``()``: every point) that fits (predicted to fit first, then by throughput,
      then by the lower peak, then in space order) and the first
      pruned ones; the pruned ones of smallest peak when asked (:meth:`Ranking.smallest`).
    """
    space, workload = problem.space, problem.workload
    found = Ranking(0, [], 0, [])
    firsts: list[tuple[int, dict, dict]] = []  # (index, knobs but the tail, tail) of pruned points: the first ones among them
    # points pruned with their layout in earlier blocks (from ``top`` on, no later one comes
    # first), and in this block so far
    pruned = {"block": None, "before": 0, "here": 0}

    def layout_pruned(block: dict, sub: dict, index: int, bound: int) -> int:
        nonlocal firsts
        if block != pruned["block"]:
            pruned.update(block=block, before=pruned["before"] + pruned["here"], here=0)
        n = space.completions(sub)
        found.pruned_rows.append((bound, index, _LAZY, _subtree_entries(space, sub, index, bound)))
        found.pruned += n
        if pruned["before"] < top:
            firsts += [(i, raw, {}) for i, raw in zip(itertools.count(index), itertools.islice(space.enumerate(sub), top))]
        pruned["here"] += n
        return n

    e = _evaluate(model, space, workload, budget, model._weights(), layout_pruned)
    stems, groups, combos, index_of, peaks = e.stems, e.groups, e.combos, e.index_of, e.peaks
    found.points = e.points
    for g in e.floored:  # groups whose model states and activations alone cannot fit: pruned together, unlisted
        members = [stems[s] for s in groups[g]]
        found.pruned += len(e.variants[g])
        found.pruned_rows.append((e.floors[g], members[0][0], _LAZY, _stem_entries(members, combos, e.floors[g])))
    not_ok = np.flatnonzero(~e.oks)
    found.pruned += len(not_ok)
    # per group, its pruned points' smallest (bound, index), and their entries, listed when asked
    not_ok = not_ok[np.lexsort((index_of[not_ok], peaks[not_ok], e.group_of[not_ok]))]
    for members in np.split(not_ok, np.flatnonzero(np.diff(e.group_of[not_ok])) + 1) if len(not_ok) else ():
        first = members[0]
        found.pruned_rows.append((int(peaks[first]), int(index_of[first]), _LAZY,
                                  _listed_entries(peaks, index_of, e.knobs_of, members)))
    firsts += [(int(index_of[v]), e.knobs_of(v), {}) for v in not_ok[np.argsort(index_of[not_ok], kind="stable")[:top]].tolist()]
    # the groups pruned by their floor, by their first point (their first stem's, the first tail)
    firsts.sort(key=operator.itemgetter(0))
    last = firsts[top - 1][0] if len(firsts) >= top else e.points
    for g in e.floored:
        members = [stems[s] for s in groups[g]]
        if members[0][0] < last:
            firsts += itertools.islice(((i + c, stem, rest) for i, stem, _ in members for c, rest in enumerate(combos)), top)
    found.examples = [point_row(model, Plan.of({**raw, **tail}, workload), budget)
                      for _, raw, tail in sorted(firsts, key=operator.itemgetter(0))[:top]]
    # the points that fit: predicted to fit first, then by throughput, then by the lower peak, then
    # in space order
    fit, columns, throughputs = e.fit, e.columns, e.throughputs
    found.feasible = len(fit)
    # equal predicted speed (points that differ in what the step does not feel): the lower peak
    # first, the headroom a user would keep
    best = np.lexsort((index_of[fit], peaks[fit], -throughputs, peaks[fit] > budget))
    # one row per layout, its best point: the list shows choices of parallelism, not variants of
    # one (a layout's other knobs are what --knobs pins to see them)
    present = [k for k in distinct if k in columns]
    if present:
        keys = row_codes([np.asarray(columns[k])[best] for k in present])
        best = best[np.sort(np.unique(keys, return_index=True)[1])]
    found.rows = [point_row(model, Plan.of(e.knobs_of(v), workload), budget) for v in fit[best[:top]].tolist()]
    return found


@dataclass
class Fitting:
    """The points of a space the analytic verdict lets through (``points``, in the space's order)
    and their ``predictions``, as :meth:`CostModel.predictions` of the whole space gives them, but
    found as :func:`rank_points` walks the space: without listing the points the floors prune (a
    large model's millions). :meth:`peak` gives any other point's predicted peak, as there too."""

    points: list[dict]
    predictions: Predictions
    evaluation: _Evaluation

    def peak(self, point: Mapping[str, Any]) -> int:
        """The predicted peak of ``point`` (a point of the space not in :attr:`points`), as
        :meth:`CostModel.predictions` of the whole space gives it: where the verdict evaluated it,
        the verdict's; where its group's floor pruned it, that floor; else its layout's floor."""
        e = self.evaluation
        if "stem_rows" not in e.__dict__:  # looked up rarely (points the study knows besides these): listed once
            e.stem_rows = {tuple(stem.values()): s for s, (_, stem, _) in enumerate(e.stems)}
            e.position = np.full(len(e.stems) * len(e.combos), -1, dtype=np.int64)
            e.position[e.stem_of * len(e.combos) + e.tail_of] = np.arange(len(e.stem_of))
            e.group_floor = np.zeros(len(e.stems), dtype=np.int64)
            for g, members in enumerate(e.groups):
                e.group_floor[members] = e.floors[g]
        names = e.walk.space.names
        s = e.stem_rows.get(tuple(point[k] for k in names[:e.walk.stem_depth]))
        if s is None:
            return e.layout_floors[tuple(point[k] for k in _LAYOUT_KNOBS)]
        tail = {k: point[k] for k in names[e.walk.stem_depth:]}
        v = int(e.position[s * len(e.combos) + e.combos.index(tail)])
        return int(e.peaks[v]) if v >= 0 else int(e.group_floor[s])


def fitting_points(model: CostModel, space, budget: int) -> Fitting:
    """The points of ``space`` (a problem's, or one pinned from it) that the analytic verdict lets
    through, with their predictions (:class:`Fitting`): what the model-ranked strategies rank (the
    others cannot fit), without a large model's whole space listed and predicted."""
    e = _evaluate(model, space, model.problem.workload, budget, model._weights(), lambda *_: 0)
    order = np.argsort(e.index_of[e.fit], kind="stable")  # the space's order
    fit = e.fit[order]
    return Fitting([e.knobs_of(v) for v in fit.tolist()],
                   Predictions(np.ones(len(fit), dtype=bool), e.peaks[fit], e.throughputs[order]), e)


def least_peak_if_none_fits(model: CostModel, problem: Problem, budget: int) -> dict | None:
    """The row of the point of smallest predicted peak when no point of ``problem``'s space fits
    ``budget`` (the one ``plan`` names then); None when one fits. ``tune`` asks it before it starts."""
    found = rank_points(model, problem, budget, 1)
    return None if found.feasible else found.smallest(model, budget, 1)[0]
