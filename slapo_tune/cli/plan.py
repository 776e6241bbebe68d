"""``slapo-tune plan``: rank a cluster's schedule points with the cost model alone (nothing runs)."""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import operator
import time
from typing import Any

from ..units import format_size
from ._common import (
    add_device_argument,
    add_hardware_argument,
    add_precision_argument,
    add_problem_arguments,
    device_of,
    hardware_of,
    positive_int,
    problem_spec,
    table,
    wrapped,
)

HELP = "rank a cluster's schedule points with the cost model alone (nothing runs)"
CLUSTER_HARDWARE = "a100-80gb"  # planned GPU ranks' hardware when no GPU is visible here to detect it from


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_problem_arguments(p)
    p.add_argument("--memory-budget", default=None,
                   help="per-device memory, e.g. 80GiB (default on cuda: the hardware's memory less the reserve "
                        "tune keeps for the CUDA context and the allocator, 2 GiB + 5 %%)")
    add_device_argument(p, "where the planned ranks would run: cuda (default; no GPU needed here) or cpu")
    add_hardware_argument(p, f"on cuda the GPU visible here, else {CLUSTER_HARDWARE}; on cpu this machine")
    add_precision_argument(p, "bf16 on cuda, fp32 on cpu")
    p.add_argument("--knobs", default="", help="evaluate one point, e.g. tp=8,pp=4 (others: first legal value; default: every point)")
    p.add_argument("--mode", choices=("analytic", "exact"), default="analytic",
                   help="analytic: closed-form memory for every point; exact: also re-check the shown points' "
                   "memory with a fake step per pipeline stage (seconds each) (default: %(default)s)")
    p.add_argument("--top", type=positive_int, default=5, help="points shown, best first (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")


class _Found:
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
        from ..plan import Plan

        heap = list(self.pruned_rows)
        heapq.heapify(heap)
        out: list[dict] = []
        while heap and len(out) < k:
            peak, index, bounded, item = heapq.heappop(heap)
            if bounded == _LAZY:
                for entry in item(model, budget):
                    heapq.heappush(heap, entry)
            elif bounded:
                row = _row(model, Plan.of(item, model.workload), budget)
                heapq.heappush(heap, (row["peak"], index, False, row))
            else:
                out.append(item)
        return out


_LAZY = 2  # _Found.pruned_rows: the entry stands for several points' (after a point's: True == 1)


def _subtree_entries(space, prefix: dict, first: int, bound: int):
    """A function of the cost model and budget listing the ``_Found.pruned_rows`` entries of the
    points of ``prefix`` (indices from ``first``, peaks at least ``bound``), each bounded by the
    larger of ``bound`` and the stages :meth:`CostModel.group_verdicts` reads."""
    from ..cost_model import block_groups
    from ..plan import KNOB_DEFAULTS

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


def _row(model, point, budget: int) -> dict:
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
    from .._partition import rank_block_counts
    from ..plan import knob_value

    return rank_block_counts(layers, point["pp"], knob_value(point, "vpp"))


def _runs(counts: list[int]) -> str:
    """``7, 8 x14, 7``: equal neighbours as one count with its repetitions."""
    runs = [(k, len(list(g))) for k, g in itertools.groupby(counts)]
    return ", ".join(f"{k} x{n}" if n > 1 else f"{k}" for k, n in runs)


# what CostModel.layout_floor reads of a point
_LAYOUT_KNOBS = ("tp", "pp", "dp", "zero")
# the knobs whose values make a layout the top list shows once (dp follows from them)
DISTINCT_LAYOUT = ("tp", "pp", "cp")


def _search(model, problem, budget: int, top: int, distinct: tuple[str, ...] = DISTINCT_LAYOUT) -> _Found:
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
      pruned ones; the pruned ones of smallest peak when asked (:meth:`_Found.smallest`).
    """
    import numpy as np

    from ..cost_model import BLOCK_KNOBS, Variants, block_groups
    from ..cost_model.analytic import optimistic
    from ..plan import KNOB_DEFAULTS, Plan

    space, workload = problem.space, problem.workload
    names, knobs = space.names, space.knobs
    weights = model._weights()
    uncertainty = model.calibration.uncertainty
    found = _Found(0, [], 0, [])
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
    found.examples = [_row(model, Plan.of({**raw, **tail}, workload), budget)
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
    found.rows = [_row(model, Plan.of(knobs_of(v), workload), budget) for v in fit[best[:top]].tolist()]
    return found


def least_peak_if_none_fits(model, problem, budget: int) -> dict | None:
    """The row of the point of smallest predicted peak when no point of ``problem``'s space fits
    ``budget`` (the one ``plan`` names then); None when one fits. ``tune`` asks it before it starts."""
    found = _search(model, problem, budget, 1)
    return None if found.feasible else found.smallest(model, budget, 1)[0]


_SEQ_DEFAULT = {"cpu": "128 or the model's positions", "cuda": "the model's context length"}


def _defaulted(args: argparse.Namespace) -> list[str]:
    """The workload sizes the user left to their defaults."""
    return [name for name in ("global_batch", "seq_len") if getattr(args, name) is None]


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def _recheck_exact(model, rows: list[dict], budget: int) -> None:
    """``--mode exact``: each shown row's peak again by a fake step per pipeline stage."""
    from ..plan import Plan

    for r in rows:
        peaks = {stage: b.total for stage, b in model.exact(Plan.of(r["point"], model.workload)).items()}
        r["exact_stage"] = max(peaks, key=peaks.get)
        r["exact_peak"] = peaks[r["exact_stage"]]


def _pinned_point_refusal(model, problem, knobs: str, row: dict, budget: int) -> str:
    """Why ``--knobs`` gave no plan: its point (the knobs left out at their first legal value) does
    not fit, and what does among the points with those knobs held: the fastest that fits, or the
    one of smallest peak (a user pinning tp, pp and recomputation has not chosen the schedule that
    came first, gpipe)."""
    from ..space import format_point

    given = f"{format_point(row['point'])} is predicted at {format_size(row['peak'])}, over {format_size(budget)}"
    pinned = problem.pinned(knobs)
    found = _search(model, pinned, budget, 1)
    if found.rows:
        best = found.rows[0]
        return (f"{given}; {found.feasible} point(s) with {knobs} fit, the fastest: {format_point(best['point'])} "
                f"(peak {format_size(best['peak'])}): pin the knobs that differ")
    smallest = found.smallest(model, budget, 1)[0]
    return (f"{given}; no point with {knobs} fits: the smallest predicted peak is {format_size(smallest['peak'])} "
            f"at {format_point(smallest['point'])}")


def _budget(args: argparse.Namespace, setup, hw) -> tuple[int, str]:
    """The per-device budget and how the header says it: the one given, or on GPU ranks the
    hardware's memory less the reserve ``tune`` keeps (:func:`~slapo_tune.device.cuda_reserve`)."""
    from ..device import cuda_reserve
    from ..errors import UsageError
    from ..units import parse_size

    if args.memory_budget is not None:
        budget = parse_size(args.memory_budget)
        return budget, f"{format_size(budget)} each"
    if not setup.cuda:
        raise UsageError("plan for CPU ranks needs --memory-budget (e.g. --memory-budget 4GiB)")
    reserve = cuda_reserve(hw.memory)
    return hw.memory - reserve, (f"{format_size(hw.memory - reserve)} each: {format_size(hw.memory)} less "
                                 f"{format_size(reserve)} reserved, as tune keeps")


def _workload_line(args: argparse.Namespace, workload, device: str) -> str:
    """``global batch 1024 (4.2M tokens), seq 4096``, saying which sizes are defaults."""
    defaulted = _defaulted(args)
    tokens = _tokens(workload.global_batch * workload.seq_len)
    return (f"global batch {workload.global_batch} ({tokens} tokens{', default' if 'global_batch' in defaulted else ''})"
            f", seq {workload.seq_len}{' (default: ' + _SEQ_DEFAULT[device] + ')' if 'seq_len' in defaulted else ''}")


def _top_lines(rows: list[dict], budget: int) -> list[str]:
    """The shown points as text within :data:`~._common.WIDTH` columns: the knobs they share on one
    line, a table of the others (short names, :data:`~slapo_tune.plan.SHORT_NAMES`, with a legend)
    and their predictions, then each point's memory: its stages' blocks and its peak's parts."""
    from ..plan import SHORT_NAMES

    names = list(rows[0]["point"])
    varying = [k for k in names if len({str(r["point"][k]) for r in rows}) > 1]
    shared = [k for k in names if k not in varying]
    header = ["#", *(SHORT_NAMES.get(k, k) for k in varying), "peak", "step (s)", "samples/s", "MFU"]
    body = [[f"{i}", *(str(r["point"][k]) for k in varying), format_size(r["peak"]), f"{r['step_s']:.3f}",
             f"{r['throughput']:.1f}", f"{r['mfu']:.1%}"] for i, r in enumerate(rows, 1)]
    lines = wrapped(f"{'knobs' if len(rows) == 1 else 'every row'}: "
                    + " ".join(f"{SHORT_NAMES.get(k, k)}={rows[0]['point'][k]}" for k in shared)) if shared else []
    numeric = {i for i, k in enumerate(varying, 1) if all(isinstance(r["point"][k], (int, float)) for r in rows)}
    lines += table([header, *body], {0, *numeric, *range(len(varying) + 1, len(header))})  # numbers right-aligned
    legend = [f"{SHORT_NAMES[k]} = {k}" for k in names if k in SHORT_NAMES]
    lines += wrapped(f"({', '.join(legend)})") if legend else []
    for i, r in enumerate(rows, 1):
        number = f"{i:>3}. "
        if len(r["stage_blocks"]) > 1:
            lines += wrapped(f"blocks per stage: {_runs(r['stage_blocks'])}", number, " " * len(number))
            number = " " * len(number)
        maybe = "; above the budget, may fit: check it" if r["peak"] > budget else ""
        lines += wrapped(f"peak {format_size(r['peak'])} (stage {r['stage']}; up to {format_size(r['upper'])}{maybe}) =",
                         number, " " * len(number))
        parts = [f"{k} {format_size(v)}" for k, v in r["breakdown"].items() if v >= 2**20]
        lines += wrapped(parts, " " * (len(number) + 2), " " * (len(number) + 2))
        if "exact_peak" in r:
            verdict = "fits" if r["exact_peak"] <= budget else "does NOT fit"
            lines += wrapped(f"exact peak {format_size(r['exact_peak'])} (stage {r['exact_stage']}, a fake step): "
                             f"{verdict}", " " * len(number), " " * (len(number) + 2))
    return lines


def run(args: argparse.Namespace) -> int:
    from ..cost_model import CostModel
    from ..cost_model.cards import preset_card
    from ..errors import UsageError
    from ..plan import readable
    from ..precision import default_precision
    from ..space import format_point
    from . import EXIT_OK

    t0, cpu0 = time.perf_counter(), time.process_time()
    # a plan is for a cluster: GPU ranks by default, and nothing of it has to run here
    setup = device_of(args.device or ("cpu" if args.hardware == "cpu" else "cuda"), here=False)
    hw, hardware_line = hardware_of(args, setup, fallback=CLUSTER_HARDWARE)
    budget, budget_line = _budget(args, setup, hw)
    precision = args.precision or default_precision(setup.kind)
    if args.mode == "exact" and precision == "fp8":  # before the search, not after it
        from ..cost_model.exact import FP8_EXACT_REFUSAL

        raise UsageError(FP8_EXACT_REFUSAL)
    # a preset's shipped card spares loading transformers and building the model to measure it
    card = None if args.space else preset_card(args.model)
    config, layout = card or (None, None)
    problem = problem_spec(args, precision=precision, device=setup.kind, memory_budget=budget).resolve(config)
    workload = problem.workload
    model = CostModel(problem, hw, layout=layout)
    if args.knobs:
        row = _row(model, problem.plan(args.knobs), budget)
        found = _Found(1, [row] if row["fits"] else [], 0 if row["fits"] else 1, [] if row["fits"] else [row])
        found.feasible = int(row["fits"])
        if not row["fits"]:
            found.pruned_rows.append((row["peak"], 0, False, row))
    else:
        found = _search(model, problem, budget, args.top)
    if args.mode == "exact":
        _recheck_exact(model, found.rows[: args.top], budget)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rows = found.rows  # a plan recommends what should fit first (see _search)
    for r in rows:
        r["mfu"] = model.mfu(r["step_s"], workload.world_size) if r["step_s"] else None
    fallbacks = list(getattr(model.layout, "probe_fallbacks", ()) or ())
    if not rows and args.knobs:
        raise UsageError(_pinned_point_refusal(model, problem, args.knobs, row, budget))
    if not rows:
        smallest = found.smallest(model, budget, 1)[0]
        raise UsageError(
            f"no point fits {format_size(budget)}: smallest predicted peak is {format_size(smallest['peak'])} at "
            f"{format_point(smallest['point'])}"
        )
    if args.json:
        print(json.dumps({"model": args.model, "device": setup.kind, "hardware": hw.name, "budget": budget,
                          "precision": precision, "mode": args.mode, "seq_len": workload.seq_len,
                          "global_batch": workload.global_batch, "defaults": _defaulted(args),
                          "probe_fallbacks": fallbacks,
                          "points": found.points, "feasible": found.feasible, "pruned": found.pruned,
                          "top": rows[: args.top], "pruned_examples": found.examples[: args.top],
                          "seconds": round(elapsed, 3), "cpu_seconds": round(cpu, 3)}, default=str))
        return EXIT_OK
    summary = [
        f"{args.model} on {workload.world_size} x {hw.name}, {precision}: {found.points} point(s), {found.feasible} "
        f"fit, {found.pruned} pruned ({elapsed:.2f} s)",
        _workload_line(args, workload, setup.kind), f"memory budget {budget_line}",
        f"template {problem.template.describe()}; {hardware_line}; {args.mode} memory",
        *(f"activation probe fallback: {line}" for line in fallbacks)]
    lines = [*wrapped(summary[0]), *(line for text in summary[1:] for line in wrapped(text, "  ", "    "))]
    lines += _top_lines(rows[: args.top], budget)
    if found.pruned:
        lines.append(f"pruned {found.pruned} point(s), for example:")
        for r in found.smallest(model, budget, min(3, args.top)):
            lines += [*wrapped(f"{readable(r['point'])}:", "  ", "    "), *wrapped(r["reason"], "    ", "      ")]
    print("\n".join(lines))
    return EXIT_OK
