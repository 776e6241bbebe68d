"""The ranking of a space's points by the cost model alone: every legal point's verdict, the best
point of each layout that fits, and the pruned points of smallest peak. ``slapo-tune plan`` prints
it, ``tune`` asks it whether anything fits before it starts, the benchmarks rank published
configurations with it (:func:`rank_points`)."""

from __future__ import annotations

import heapq
import itertools
import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._partition import rank_block_counts
from ..plan import KNOB_DEFAULTS, Plan, knob_value
from . import BLOCK_KNOBS, Variants, block_groups
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
    names, knobs = space.names, space.knobs
    weights = model._weights()
    uncertainty = model.calibration.uncertainty
    found = Ranking(0, [], 0, [])
    # the walk: blocks (the knobs before the first block knob: a group's points are in one block),
    # each cut into subtrees (the knobs up to the layout's and the micro-batch size), listed by stems
    depth = max(names.index(k) for k in (*_LAYOUT_KNOBS, "micro_batch")) + 1
    block_depth = min([names.index(k) for k in BLOCK_KNOBS if k in names] + [depth])
    stem_depth = len(names)
    while (not space.constraints and stem_depth > depth and names[stem_depth - 1] in BLOCK_KNOBS
           and knobs[stem_depth - 1].derive is None and not callable(knobs[stem_depth - 1].choices)
           and knobs[stem_depth - 1].choices):
        stem_depth -= 1
    combos = [dict(zip(names[stem_depth:], values))
              for values in itertools.product(*(knob.choices for knob in knobs[stem_depth:]))]
    width = len(combos)  # the points a stem stands for

    def stems_of(sub: dict):
        return space.enumerate(sub) if space.constraints else space.prefixes(stem_depth, sub)

    checked: set[tuple] = set()
    floors: dict[tuple, int] = {}
    stems: list[tuple[int, dict, dict]] = []  # (first index, knobs, complete but the tail) to evaluate
    groups: list[list[int]] = []  # stems (indices in ``stems``) evaluated together
    firsts: list[tuple[int, dict, dict]] = []  # (index, knobs but the tail, tail) of pruned points: the first ones among them
    pruned_before = 0  # points pruned with their layout in earlier blocks: from ``top`` on, no later one comes first
    index = 0
    for block in space.prefixes(block_depth):
        start, pruned_here = len(stems), 0
        for sub in space.prefixes(depth, block):
            listed = stems_of(sub)
            head = next(listed, None)
            if head is None:
                continue
            first = {**head, **combos[0]}
            shape = (sub["tp"], sub["pp"], sub["dp"], sub["micro_batch"])
            if shape not in checked:  # what Plan.of checks (the knobs, the batch and world sizes)
                Plan.of(first, workload)
                checked.add(shape)
            point = {**KNOB_DEFAULTS, **first}
            layout = tuple(sub[k] for k in _LAYOUT_KNOBS)
            if layout not in floors:
                floors[layout] = model.layout_floor(point, weights)
            bound = floors[layout]
            if optimistic(bound, uncertainty) > budget:
                n = space.completions(sub)
                found.pruned_rows.append((bound, index, _LAZY, _subtree_entries(space, sub, index, bound)))
                found.pruned += n
                if pruned_before < top:
                    firsts += [(i, raw, {}) for i, raw in zip(itertools.count(index), itertools.islice(space.enumerate(sub), top))]
                pruned_here += n
                index += n
                continue
            for stem in itertools.chain((head,), listed):
                stems.append((index, stem, {**KNOB_DEFAULTS, **stem}))
                index += width
        pruned_before += pruned_here
        groups += [[start + s for s in group]
                   for group in block_groups([point for *_, point in stems[start:]], range(len(stems) - start)).values()]
    found.points = index
    # groups whose model states and activations alone cannot fit: pruned together, unlisted
    variants = [Variants([stems[s][2] for s in group], combos) for group in groups]
    heads = [v[0] for v in variants]
    evaluated, floored = [], []  # indices in ``groups``: evaluated, pruned by their floor
    for g, floor in enumerate(model.group_floors(heads, variants, weights)):
        if optimistic(floor, uncertainty) > budget:
            members = [stems[s] for s in groups[g]]
            found.pruned += len(variants[g])
            found.pruned_rows.append((floor, members[0][0], _LAZY, _stem_entries(members, combos, floor)))
            floored.append(g)
        else:
            evaluated.append(g)
    verdicts = model.group_verdicts([(heads[g], variants[g]) for g in evaluated], budget, weights, BLOCK_KNOBS)
    # every evaluated point as flat arrays: verdict, peak, stem, tail (in ``combos``), index, group
    chain = itertools.chain.from_iterable
    oks = np.fromiter(chain(oks for oks, _ in verdicts), dtype=bool)
    peaks = np.fromiter(chain(peaks for _, peaks in verdicts), dtype=np.int64)
    stem_of = np.repeat(np.fromiter(chain(groups[g] for g in evaluated), dtype=np.int64), width)
    tail_of = np.tile(np.arange(width), len(stem_of) // width)
    index_of = np.array([i for i, *_ in stems], dtype=np.int64)[stem_of] + tail_of if stems else stem_of
    group_of = np.repeat(np.arange(len(evaluated)), [len(groups[g]) * width for g in evaluated])

    def knobs_of(v: int) -> dict:
        return {**stems[stem_of[v]][1], **combos[tail_of[v]]}

    pruned = np.flatnonzero(~oks)
    found.pruned += len(pruned)
    # per group, its pruned points' smallest (bound, index), and their entries, listed when asked
    pruned = pruned[np.lexsort((index_of[pruned], peaks[pruned], group_of[pruned]))]
    for members in np.split(pruned, np.flatnonzero(np.diff(group_of[pruned])) + 1) if len(pruned) else ():
        first = members[0]
        found.pruned_rows.append((int(peaks[first]), int(index_of[first]), _LAZY,
                                  _listed_entries(peaks, index_of, knobs_of, members)))
    firsts += [(int(index_of[v]), knobs_of(v), {}) for v in pruned[np.argsort(index_of[pruned], kind="stable")[:top]].tolist()]
    # the groups pruned by their floor, by their first point (their first stem's, the first tail)
    firsts.sort(key=operator.itemgetter(0))
    last = firsts[top - 1][0] if len(firsts) >= top else index
    for g in floored:
        members = [stems[s] for s in groups[g]]
        if members[0][0] < last:
            firsts += itertools.islice(((i + c, stem, rest) for i, stem, _ in members for c, rest in enumerate(combos)), top)
    found.examples = [point_row(model, Plan.of({**raw, **tail}, workload), budget)
                      for _, raw, tail in sorted(firsts, key=operator.itemgetter(0))[:top]]
    # the points that fit, their knobs as columns: predicted to fit first, then by throughput, then
    # by the lower peak, then in space order
    fit = np.flatnonzero(oks)
    found.feasible = len(fit)
    used, inverse = np.unique(stem_of[fit], return_inverse=True)
    columns = {k: np.array([c[k] for c in combos])[tail_of[fit]] if k in combos[0] else
               np.array([stems[s][2][k] for s in used.tolist()])[inverse.reshape(-1)] for k in {**stems[0][2], **combos[0]}
               } if len(fit) else {}
    throughputs = model.column_throughputs(columns) if len(fit) else np.zeros(0)
    # equal predicted speed (points that differ in what the step does not feel): the lower peak
    # first, the headroom a user would keep
    best = np.lexsort((index_of[fit], peaks[fit], -throughputs, peaks[fit] > budget))
    # one row per layout, its best point: the list shows choices of parallelism, not variants of
    # one (a layout's other knobs are what --knobs pins to see them)
    present = [k for k in distinct if k in columns]
    if present:
        keys = np.stack([np.asarray(columns[k])[best] for k in present], axis=1)
        best = best[np.sort(np.unique(keys, axis=0, return_index=True)[1])]
    found.rows = [point_row(model, Plan.of(knobs_of(v), workload), budget) for v in fit[best[:top]].tolist()]
    return found


def least_peak_if_none_fits(model: CostModel, problem: Problem, budget: int) -> dict | None:
    """The row of the point of smallest predicted peak when no point of ``problem``'s space fits
    ``budget`` (the one ``plan`` names then); None when one fits. ``tune`` asks it before it starts."""
    found = rank_points(model, problem, budget, 1)
    return None if found.feasible else found.smallest(model, budget, 1)[0]
