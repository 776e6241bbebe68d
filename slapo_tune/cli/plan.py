"""``slapo-tune plan``: rank a cluster's schedule points with the cost model alone (nothing runs)."""

from __future__ import annotations

import argparse
import heapq
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
)

HELP = "rank a cluster's schedule points with the cost model alone (nothing runs)"
CLUSTER_HARDWARE = "a100-80gb"  # planned GPU ranks' hardware when no GPU is visible here to detect it from


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_problem_arguments(p)
    p.add_argument("--memory-budget", required=True, help="per-device memory, e.g. 80GiB")
    add_device_argument(p, "where the planned ranks would run: cuda (default; no GPU needed here) or cpu")
    add_hardware_argument(p, f"on cuda the GPU visible here, else {CLUSTER_HARDWARE}; on cpu this machine")
    add_precision_argument(p, "bf16 on cuda, fp32 on cpu")
    p.add_argument("--knobs", default="", help="evaluate one point (others: first legal value)")
    p.add_argument("--top", type=positive_int, default=5)
    p.add_argument("--json", action="store_true")


class _Found:
    """What ``plan`` found: counts, the rows it shows, and the pruned points (some only bounded)."""

    def __init__(self, points: int, rows: list[dict], pruned: int, examples: list[dict]):
        self.points, self.rows, self.pruned, self.examples = points, rows, pruned, examples
        self.feasible = 0
        # (peak, index, False, row), or (a lower bound of the peak, index, True, the point's knobs)
        self.pruned_rows: list[tuple[int, int, bool, Any]] = []

    def smallest(self, model, budget: int, k: int) -> list[dict]:
        """The ``k`` pruned rows of smallest peak (first in space order among equal peaks), as a
        sort of every pruned row would give: a point known by a lower bound of its peak only is
        evaluated once that bound comes first."""
        from ..plan import Plan

        heap = list(self.pruned_rows)
        heapq.heapify(heap)
        out: list[dict] = []
        while heap and len(out) < k:
            peak, index, bounded, item = heapq.heappop(heap)
            if bounded:
                row = _row(model, Plan.of(item, model.workload), budget)
                heapq.heappush(heap, (row["peak"], index, False, row))
            else:
                out.append(item)
        return out


def _row(model, point, budget: int) -> dict:
    """One point's row: its memory prediction, verdict and (where it fits) time."""
    mem = model.memory(point)
    verdict = model.verdict(point, budget, prediction=mem)
    timing = model.time(point) if verdict.fits else None
    return {"point": point.knobs(), "peak": mem.peak, "upper": mem.upper, "stage": mem.worst_stage,
            "breakdown": mem.breakdown, "step_s": timing.step if timing else None,
            "throughput": timing.throughput(model.workload) if timing else None, "fits": verdict.fits,
            "reason": verdict.reason}


# the knobs that change only what a block keeps (cost_model.analytic.block_activations): the points
# that differ only in them are evaluated together
_BLOCK_KNOBS = frozenset({"sp", "ckpt_policy", "attn", "fuse"})


def _search(model, problem, budget: int, top: int) -> _Found:
    """Every legal point's verdict, and the rows ``plan`` shows, as evaluating each point fully
    (:func:`_row`) and sorting would give, for less:

    * a layout (tp, pp, dp, zero) whose model states alone cannot fit (:meth:`CostModel.layout_floor`,
      with the verdict's margin) prunes all its points, unevaluated;
    * points that differ only in what a block keeps (sp, ckpt_policy, attn, fuse) are evaluated
      together, stage by stage, stopping once none can fit (:meth:`CostModel.quick_verdicts`);
    * step time does not depend on the attention kernel or fusion: computed once per the other knobs;
    * full rows only for the shown ones: the best points that fit (predicted to fit first, then by
      throughput, then in space order) and the first pruned ones; the pruned ones of smallest peak
      when asked (:meth:`_Found.smallest`).
    """
    from ..plan import KNOB_DEFAULTS, Plan

    workload = problem.workload
    weights = model._weights()
    keep = 1 - model.calibration.uncertainty
    found = _Found(0, [], 0, [])
    checked: set[tuple] = set()
    floors: dict[tuple, tuple[bool, int]] = {}
    times: dict[tuple, float] = {}
    fits: list[tuple] = []
    raws, points = [], []
    groups: dict[tuple, list[int]] = {}
    names = [k for k in {**KNOB_DEFAULTS, **next(problem.space.enumerate(), {})}]
    group_key, time_key = (operator.itemgetter(*keys) if keys else (lambda p: ()) for keys in (
        [k for k in names if k not in _BLOCK_KNOBS], [k for k in names if k not in ("attn", "fuse")]))
    for index, raw in enumerate(problem.space.enumerate()):
        point = {**KNOB_DEFAULTS, **raw}
        shape = (point["tp"], point["pp"], point["dp"], point["micro_batch"])
        if shape not in checked:  # what Plan.of checks (the knobs, the batch and world sizes)
            Plan.of(raw, workload)
            checked.add(shape)
        raws.append(raw)
        points.append(point)
        groups.setdefault(group_key(point), []).append(index)
    verdicts: list[tuple[bool, int]] = [(False, 0)] * len(points)
    for members in groups.values():
        point = points[members[0]]
        layout = (point["tp"], point["pp"], point["dp"], point["zero"])
        if layout not in floors:
            floor = model.layout_floor(point, weights)
            floors[layout] = (int(floor * keep) > budget, floor)
        whole, floor = floors[layout]
        if whole:
            for i in members:
                verdicts[i] = (False, floor)
            continue
        oks, peaks = model.quick_verdicts(point, [points[i] for i in members], budget, weights)
        for i, ok, peak in zip(members, oks, peaks):
            verdicts[i] = (ok, peak)
    for index, (raw, point, (ok, peak)) in enumerate(zip(raws, points, verdicts)):
        if not ok:
            found.pruned += 1
            if len(found.examples) < top:
                row = _row(model, Plan.of(raw, workload), budget)
                found.examples.append(row)
                found.pruned_rows.append((row["peak"], index, False, row))
            else:
                found.pruned_rows.append((peak, index, True, raw))
            continue
        key = time_key(point)
        throughput = times.get(key)
        if throughput is None:
            throughput = times[key] = model.time(point).throughput(workload)
        fits.append((peak > budget, -throughput, index, raw))
    index = len(points) - 1
    found.points, found.feasible = index + 1, len(fits)
    fits.sort(key=lambda f: f[:3])
    found.rows = [_row(model, Plan.of(raw, workload), budget) for *_, raw in fits[:top]]
    return found


def run(args: argparse.Namespace) -> int:
    from ..cost_model import CostModel
    from ..cost_model.cards import preset_card
    from ..errors import UsageError
    from ..precision import default_precision
    from ..space import format_point
    from ..units import parse_size
    from . import EXIT_OK

    t0, cpu0 = time.perf_counter(), time.process_time()
    budget = parse_size(args.memory_budget)
    # a plan is for a cluster: GPU ranks by default, and nothing of it has to run here
    setup = device_of(args.device or ("cpu" if args.hardware == "cpu" else "cuda"), here=False)
    hw, hardware_line = hardware_of(args, setup, fallback=CLUSTER_HARDWARE)
    precision = args.precision or default_precision(setup.kind)
    # a preset's shipped card spares loading transformers and building the model to measure it
    card = None if args.space else preset_card(args.model)
    config, layout = card or (None, None)
    problem = problem_spec(args, precision=precision, memory_budget=budget).resolve(config)
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
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rows = found.rows  # a plan recommends what should fit first (see _search)
    if not rows:
        smallest = found.smallest(model, budget, 1)[0]
        raise UsageError(
            f"no point fits {format_size(budget)}: smallest predicted peak is {format_size(smallest['peak'])} at "
            f"{format_point(smallest['point'])}"
        )
    if args.json:
        print(json.dumps({"model": args.model, "device": setup.kind, "hardware": hw.name, "budget": budget,
                          "precision": precision,
                          "points": found.points, "feasible": found.feasible, "pruned": found.pruned,
                          "top": rows[: args.top], "pruned_examples": found.examples[: args.top],
                          "seconds": round(elapsed, 3), "cpu_seconds": round(cpu, 3)}, default=str))
        return EXIT_OK
    print(f"{args.model} on {workload.world_size} x {hw.name} ({format_size(budget)} each), {precision}, global batch "
          f"{workload.global_batch}, seq {workload.seq_len}: {found.points} point(s), {found.feasible} fit, "
          f"{found.pruned} pruned ({elapsed:.2f} s, template {problem.template.describe()}; {hardware_line})")
    for i, r in enumerate(rows[: args.top], 1):
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in r["breakdown"].items() if v >= 2**20)
        print(f"{i:>3}. {format_point(r['point'])}")
        maybe = "; above the budget, may fit: check it" if r["peak"] > budget else ""
        print(f"     peak {format_size(r['peak'])} (stage {r['stage']}; up to {format_size(r['upper'])}{maybe}) = {parts}")
        print(f"     step {r['step_s']:.3f} s, {r['throughput']:.1f} samples/s")
    if found.pruned:
        print(f"pruned {found.pruned} point(s), for example:")
        for r in found.smallest(model, budget, min(3, args.top)):
            print(f"  {format_point(r['point'])}: {r['reason']}")
    return EXIT_OK
