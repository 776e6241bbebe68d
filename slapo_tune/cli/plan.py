"""``slapo-tune plan``: rank a cluster's schedule points with the cost model alone (nothing runs)."""

from __future__ import annotations

import argparse
import json
import time

from ..units import format_size
from ._common import add_precision_argument, add_problem_arguments, positive_int, problem_spec

HELP = "rank a cluster's schedule points with the cost model alone (nothing runs)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_problem_arguments(p)
    p.add_argument("--memory-budget", required=True, help="per-device memory, e.g. 80GiB")
    p.add_argument("--device", default="a100-80gb",
                   help="hardware preset: cpu, a100-80gb, a100-40gb, h100-80gb, h200, v100-32gb (default: %(default)s)")
    add_precision_argument(p, "bf16 on GPUs, fp32 on cpu")
    p.add_argument("--knobs", default="", help="evaluate one point (others: first legal value)")
    p.add_argument("--top", type=positive_int, default=5)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from ..cost_model import CostModel, hardware
    from ..cost_model.cards import preset_card
    from ..errors import UsageError
    from ..precision import default_precision
    from ..space import format_point
    from ..units import parse_size
    from . import EXIT_OK

    t0 = time.perf_counter()
    budget = parse_size(args.memory_budget)
    device = hardware(args.device)
    precision = args.precision or default_precision("cpu" if args.device == "cpu" else "cuda")
    # a preset's shipped card spares loading transformers and building the model to measure it
    card = None if args.space else preset_card(args.model)
    config, layout = card or (None, None)
    problem = problem_spec(args, precision=precision, memory_budget=budget).resolve(config)
    workload = problem.workload
    model = CostModel(problem, device, layout=layout)
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
        print(json.dumps({"model": args.model, "device": device.name, "budget": budget, "precision": precision,
                          "points": len(points), "feasible": len(rows), "pruned": len(pruned),
                          "top": rows[: args.top], "pruned_examples": pruned[: args.top],
                          "seconds": round(elapsed, 3)}, default=str))
        return EXIT_OK
    print(f"{args.model} on {workload.world_size} x {device.name} ({format_size(budget)} each), {precision}, global batch "
          f"{workload.global_batch}, seq {workload.seq_len}: {len(points)} point(s), {len(rows)} fit, "
          f"{len(pruned)} pruned ({elapsed:.2f} s, template {problem.template.describe()})")
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
