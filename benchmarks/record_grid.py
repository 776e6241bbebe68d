"""Record a measured grid: every legal point of a space, trained for real on local ranks.

The small grid (knobs, per-rank peak memory, step times) is the input of the search-strategy
benchmark and of the replay tests, which answer trials from it instead of running them. The
reference grid is the exhaustive search of the headline's GPT-2 workload: every point's peak
measured, and every point that fits the budget by that measurement timed, so that the headline
can say how far the tuned schedule is from the best one, and tests can check pruning against it.

Peaks are measured by :func:`slapo_tune.memory.measured_peak` (torch's MemTracker on CPU), a
tool the cost model's predictions do not use. ``--reuse-times`` keeps the step times of
points already timed in an earlier recording (timings need a quiet machine; memory does not).
Run: ``python -m benchmarks.record_grid [--reference] [--out FILE] [--reuse-times]``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slapo_tune.problem import Problem, ProblemSpec

# fixed: the knobs the grid holds at one value (sp, ckpt_policy, vpp, loss_parallel and cp did not exist when it was
# recorded: their values then); zero: the ZeRO levels it holds (recorded before levels 1 and 2)
GRID = dict(model="gpt2-tiny", world_size=2, global_batch=16, seq_len=64,
            fixed={"attn": "sdpa", "sp": "off", "ckpt_policy": "full", "vpp": 1, "loss_parallel": "off", "cp": 1}, zero=(0, 3))
DEFAULT_OUT = Path(__file__).with_name("data") / "gpt2_tiny_w2.csv"
REFERENCE_OUT = Path(__file__).with_name("data") / "gpt2_ref_w1.csv"


def grid_problem() -> Problem:
    """The small grid's problem (resolved: its defaults filled in, its space built)."""
    from slapo_tune.problem import ProblemSpec

    return ProblemSpec(GRID["model"], GRID["world_size"], global_batch=GRID["global_batch"],
                       seq_len=GRID["seq_len"]).resolve()


def grid_points(problem: Problem | None = None) -> list[dict]:
    space = (problem or grid_problem()).space
    return [p for p in space.enumerate()
            if all(p[k] == v for k, v in GRID["fixed"].items()) and p["zero"] in GRID["zero"]]


def _key(point: dict) -> tuple:
    """A point's identity, a recorded row's too (a row from before a fixed knob existed holds its value)."""
    return tuple(sorted({**{k: str(v) for k, v in GRID["fixed"].items()},
                         **{k: str(v) for k, v in point.items()}}.items()))


def _write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(out)
    print(f"wrote {out}")


def _launch_chunks(spec: ProblemSpec, points: list[dict], chunk: int, timed: int, tracked: int,
                   what: str) -> list[list[dict]]:
    """Each point's per-rank reports, ``chunk`` points per launch (ranks start once per chunk)."""
    from slapo_tune.cost_model.measure import measure_points_rank
    from slapo_tune.launch import launch

    reports, t0 = [], time.perf_counter()
    for i in range(0, len(points), chunk):
        part = points[i:i + chunk]
        per_rank = launch(measure_points_rank, spec.world_size, args=(spec, part, timed, tracked), timeout=3600)
        reports += [[r[j] for r in per_rank] for j in range(len(part))]
        print(f"{what}: {len(reports)}/{len(points)} points in {time.perf_counter() - t0:.0f} s", flush=True)
    return reports


def record(spec: ProblemSpec, points: list[dict], chunk: int, budget: int | None = None,
           times_from: Path | None = None) -> list[dict]:
    """Rows of ``points``: the measured peak (the largest rank's) of every point, and the step
    times (the slowest rank per step) of every point that fits ``budget`` (all when None), reused
    from ``times_from`` where that recording timed the point."""
    tracked = 2 if spec.world_size > 1 else 1  # gloo's late buffers: keep the smaller of two steps
    peaks = [max(r["total"] for r in reports)
             for reports in _launch_chunks(spec, points, chunk, 0, tracked, "memory")]
    known = {}
    if times_from is not None and times_from.exists():
        with open(times_from) as f:
            known = {_key({k: v for k, v in r.items() if k not in ("peak", "step_s", "step_times")}): r
                     for r in csv.DictReader(f) if r.get("step_s")}
    fits = [budget is None or peak <= budget for peak in peaks]
    to_time = [p for p, fit in zip(points, fits) if fit and _key(p) not in known]
    timed = dict(zip(map(_key, to_time), _launch_chunks(spec, to_time, chunk, 3, 0, "time")))
    rows = []
    for point, peak, fit in zip(points, peaks, fits):
        step_s, step_times = "", ""
        if fit and _key(point) in known:
            step_s, step_times = known[_key(point)]["step_s"], known[_key(point)]["step_times"]
        elif fit:
            reports = timed[_key(point)]
            steps = [max(r["step_times"][k] for r in reports) for k in range(len(reports[0]["step_times"]))]
            step_s, step_times = statistics.median(steps), " ".join(f"{s:.5f}" for s in steps)
        rows.append({**point, "peak": peak, "step_s": step_s, "step_times": step_times})
    return rows


def record_reference(out: Path, chunk: int, times_from: Path | None) -> None:
    """Every point of the headline's GPT-2 workload (world 1): its measured peak; timed if it fits."""
    from benchmarks.headline import BUDGET, GPT2_REF, problem_spec

    problem = problem_spec(GPT2_REF, 1).resolve()
    rows = record(problem.spec, list(problem.space.enumerate()), chunk, BUDGET, times_from)
    print(f"{sum(1 for r in rows if r['step_s'] != '')} of {len(rows)} points fit {BUDGET / 2**20:.0f} MiB")
    _write(rows, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", action="store_true",
                        help="the headline's GPT-2 workload (exhaustive search) instead of the small grid")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--chunk", type=int, default=40, help="points per launch (ranks start once per chunk)")
    parser.add_argument("--reuse-times", action="store_true",
                        help="keep the step times the output file already records (measure memory only)")
    args = parser.parse_args(argv)
    out = args.out or (REFERENCE_OUT if args.reference else DEFAULT_OUT)
    times_from = out if args.reuse_times else None
    if args.reference:
        record_reference(out, args.chunk, times_from)
        return

    problem = grid_problem()
    _write(record(problem.spec, grid_points(problem), args.chunk, times_from=times_from), out)


if __name__ == "__main__":
    main()
