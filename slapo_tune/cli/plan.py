"""``slapo-tune plan``: rank a cluster's schedule points with the cost model alone (nothing runs)."""

from __future__ import annotations

import argparse
import itertools
import json
import time

from ..cost_model import CostModel
from ..cost_model.cards import preset_card
from ..cost_model.ranking import Ranking, point_row, rank_points
from ..device import cuda_reserve
from ..errors import UsageError
from ..plan import SHORT_NAMES, Plan, readable
from ..precision import default_precision
from ..space import format_point
from ..units import format_size, parse_size
from . import EXIT_OK
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


def _runs(counts: list[int]) -> str:
    """``7, 8 x14, 7``: equal neighbours as one count with its repetitions."""
    runs = [(k, len(list(g))) for k, g in itertools.groupby(counts)]
    return ", ".join(f"{k} x{n}" if n > 1 else f"{k}" for k, n in runs)




_SEQ_DEFAULT = {"cpu": "128 or the model's positions", "cuda": "the model's context length"}


def _defaulted(args: argparse.Namespace) -> list[str]:
    """The workload sizes the user left to their defaults."""
    return [name for name in ("global_batch", "seq_len") if getattr(args, name) is None]


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def _recheck_exact(model, rows: list[dict], budget: int) -> None:
    """``--mode exact``: each shown row's peak again by a fake step per pipeline stage."""
    for r in rows:
        peaks = {stage: b.total for stage, b in model.exact(Plan.of(r["point"], model.workload)).items()}
        r["exact_stage"] = max(peaks, key=peaks.get)
        r["exact_peak"] = peaks[r["exact_stage"]]


def _pinned_point_refusal(model, problem, knobs: str, row: dict, budget: int) -> str:
    """Why ``--knobs`` gave no plan: its point (the knobs left out at their first legal value) does
    not fit, and what does among the points with those knobs held: the fastest that fits, or the
    one of smallest peak (a user pinning tp, pp and recomputation has not chosen the schedule that
    came first, gpipe)."""
    given = f"{format_point(row['point'])} is predicted at {format_size(row['peak'])}, over {format_size(budget)}"
    pinned = problem.pinned(knobs)
    found = rank_points(model, pinned, budget, 1)
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
    t0, cpu0 = time.perf_counter(), time.process_time()
    # a plan is for a cluster: GPU ranks by default, and nothing of it has to run here
    setup = device_of(args.device or ("cpu" if args.hardware == "cpu" else "cuda"), here=False)
    hw, hardware_line = hardware_of(args, setup, fallback=CLUSTER_HARDWARE)
    budget, budget_line = _budget(args, setup, hw)
    precision = args.precision or default_precision(setup.kind)
    if args.mode == "exact" and precision == "fp8":  # before the search, not after it
        # torch-free: plan and every --help import this module; exact imports torch
        from ..cost_model.exact import FP8_EXACT_REFUSAL

        raise UsageError(FP8_EXACT_REFUSAL)
    # a preset's shipped card spares loading transformers and building the model to measure it
    card = None if args.space else preset_card(args.model)
    config, layout = card or (None, None)
    problem = problem_spec(args, precision=precision, device=setup.kind, memory_budget=budget).resolve(config)
    workload = problem.workload
    model = CostModel(problem, hw, layout=layout)
    if args.knobs:
        row = point_row(model, problem.plan(args.knobs), budget)
        found = Ranking(1, [row] if row["fits"] else [], 0 if row["fits"] else 1, [] if row["fits"] else [row])
        found.feasible = int(row["fits"])
        if not row["fits"]:
            found.pruned_rows.append((row["peak"], 0, False, row))
    else:
        found = rank_points(model, problem, budget, args.top)
    if args.mode == "exact":
        _recheck_exact(model, found.rows[: args.top], budget)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rows = found.rows  # a plan recommends what should fit first (see rank_points)
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
