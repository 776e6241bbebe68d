"""``slapo-tune plan``: rank a cluster's schedule points with the cost model alone (nothing runs)."""

from __future__ import annotations

import argparse
import json
import time

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


def run(args: argparse.Namespace) -> int:
    from ..cost_model import CostModel
    from ..cost_model.cards import preset_card
    from ..errors import UsageError
    from ..precision import default_precision
    from ..space import format_point
    from ..units import parse_size
    from . import EXIT_OK

    t0 = time.perf_counter()
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
    points = [problem.plan(args.knobs)] if args.knobs else list(problem.plans())
    rows, pruned = [], []
    for point in points:
        mem = model.memory(point)
        verdict = model.verdict(point, budget, prediction=mem)
        timing = model.time(point) if verdict.fits else None
        row = {"point": point.knobs(), "peak": mem.peak, "upper": mem.upper, "stage": mem.worst_stage,
               "breakdown": mem.breakdown, "step_s": timing.step if timing else None,
               "throughput": timing.throughput(workload) if timing else None, "fits": verdict.fits,
               "reason": verdict.reason}
        (rows if verdict.fits else pruned).append(row)
    elapsed = time.perf_counter() - t0
    # a point predicted above the budget is kept (it may fit, within the prediction's uncertainty)
    # but ranked after every point predicted to fit: a plan recommends what should fit first
    rows.sort(key=lambda r: (r["peak"] > budget, -r["throughput"]))
    if not rows:
        smallest = min(pruned, key=lambda r: r["peak"])
        raise UsageError(
            f"no point fits {format_size(budget)}: smallest predicted peak is {format_size(smallest['peak'])} at "
            f"{format_point(smallest['point'])}"
        )
    if args.json:
        print(json.dumps({"model": args.model, "device": setup.kind, "hardware": hw.name, "budget": budget,
                          "precision": precision,
                          "points": len(points), "feasible": len(rows), "pruned": len(pruned),
                          "top": rows[: args.top], "pruned_examples": pruned[: args.top],
                          "seconds": round(elapsed, 3)}, default=str))
        return EXIT_OK
    print(f"{args.model} on {workload.world_size} x {hw.name} ({format_size(budget)} each), {precision}, global batch "
          f"{workload.global_batch}, seq {workload.seq_len}: {len(points)} point(s), {len(rows)} fit, "
          f"{len(pruned)} pruned ({elapsed:.2f} s, template {problem.template.describe()}; {hardware_line})")
    for i, r in enumerate(rows[: args.top], 1):
        parts = ", ".join(f"{k} {format_size(v)}" for k, v in r["breakdown"].items() if v >= 2**20)
        print(f"{i:>3}. {format_point(r['point'])}")
        maybe = "; above the budget, may fit: check it" if r["peak"] > budget else ""
        print(f"     peak {format_size(r['peak'])} (stage {r['stage']}; up to {format_size(r['upper'])}{maybe}) = {parts}")
        print(f"     step {r['step_s']:.3f} s, {r['throughput']:.1f} samples/s")
    if pruned:
        print(f"pruned {len(pruned)} point(s), for example:")
        for r in sorted(pruned, key=lambda r: r["peak"])[: min(3, args.top)]:
            print(f"  {format_point(r['point'])}: {r['reason']}")
    return EXIT_OK
