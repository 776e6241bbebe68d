"""How long ``tune``'s default strategy (``guided``, and ``model``) takes to propose its first
point on a large model's space: the tuner built, its study opened (the baseline recorded: the
default made to fit, the nearest fitting points predicted by the number of knobs changed), and the
points that may fit ranked, found and predicted as ``plan`` ranks a space
(``ranking.fitting_points``: the millions of others are not listed). The baseline made to fit is
checked by the analytic verdict (``prune="analytic"``): exact mode checks it by a fake step of each
candidate, which for this model takes from a quarter of a minute (one stage) to hours (its sixth
candidate on 64 ranks: 64 stages of 1,536 micro-batches), exact mode's cost, not the ranking's.
Beside it, in the same process, the per-point path the ranking replaced (each point's verdict,
memory and time predicted one at a time): timed on a seeded sample of the space's points and
scaled to all of them. Nothing is launched (a replay runner with no trials).
Run: ``python -m benchmarks.search_startup [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from benchmarks._stats import publish, round_orders

# (label, model, world size, global batch); sequence 2048, H100 80 GB ranks
WORKLOADS = (
    ("gpt3-175b w64", "gpt3-175b", 64, 1536),
    ("gpt3-175b w1024", "gpt3-175b", 1024, 1536),
)
SAMPLE = 1000  # points timed one at a time (the per-point path), scaled to the space


def first_point(model: str, world: int, global_batch: int) -> dict:
    """Seconds to the default strategy's first point (the tuner built, its baseline recorded, the
    points that may fit found, predicted and ranked), and the per-point path's seconds for the same
    space, estimated from :data:`SAMPLE` points drawn uniformly."""
    from pathlib import Path

    from runners.replay import ReplayRunner
    from slapo_tune.problem import ProblemSpec
    from slapo_tune.search import TuneConfig, Tuner

    spec = ProblemSpec(model, world, global_batch=global_batch, seq_len=2048, memory_budget=80 * 2**30,
                       device="cuda")
    started = time.perf_counter()
    tuner = Tuner(TuneConfig(problem=spec, out=Path("unused"), trials=1, storage="memory", hardware="h100-80gb",
                             prune="analytic"), ReplayRunner([]), write_outputs=False)
    sampler = getattr(tuner.sampler, "strategy", tuner.sampler)
    point = sampler.next_point(tuner._known(tuner.study))
    batched = time.perf_counter() - started
    count = tuner.space.count()
    chosen = set(random.Random(0).sample(range(count), min(SAMPLE, count)))  # by index: the space is not listed
    sample = [p for i, p in enumerate(tuner.space.enumerate()) if i in chosen]
    budget = tuner.config.memory_budget
    started = time.perf_counter()
    for p in sample:  # what each point cost before: its verdict and throughput, then its peak again
        if tuner.cost.verdict(p, budget).fits:
            tuner.cost.time(p).throughput(tuner.workload)
        tuner.cost.memory(p)
    per_point = (time.perf_counter() - started) / len(sample) * count
    return {"points": count, "first_point_s": batched, "per_point_estimate_s": per_point,
            "first_point": point}


def run(rounds: int) -> dict:
    """Each workload in a fresh process per round (imports count, as for a user), in shuffled orders."""
    runs: dict[str, list[dict]] = {label: [] for label, *_ in WORKLOADS}
    arguments = {label: rest for label, *rest in WORKLOADS}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    for order in round_orders(list(runs), rounds):
        for label in order:
            code = f"import json; from benchmarks.search_startup import first_point; " \
                   f"print(json.dumps(first_point(*{arguments[label]!r})))"
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
            runs[label].append(json.loads(done.stdout.splitlines()[-1]))
    rows = {}
    for label, measured in runs.items():
        first = [m["first_point_s"] for m in measured]
        before = [m["per_point_estimate_s"] for m in measured]
        rows[label] = {"points": measured[0]["points"], "first_point_median": statistics.median(first),
                       "first_point_min": min(first), "first_point_max": max(first),
                       "per_point_median": statistics.median(before),
                       "ratio_median": statistics.median(b / f for b, f in zip(before, first)),
                       "first_point": measured[0]["first_point"], "rounds": len(measured)}
    return {"rows": rows, "cpus": os.cpu_count(), "sample": SAMPLE}


def report_section(data: dict) -> list[str]:
    lines = ["## `tune` start-up on a large model's space", "",
             f"Seconds to the default strategy's first point, a fresh process each run ({data['cpus']} CPUs), "
             f"beside the per-point path (timed on {data['sample']} points, scaled):", "",
             "| workload | points | first point: median (min-max) | per point, estimated | ratio |",
             "|---|---|---|---|---|"]
    for label, r in data["rows"].items():
        lines.append(f"| {label} | {r['points']:,} | {r['first_point_median']:.1f} s ({r['first_point_min']:.1f}-"
                     f"{r['first_point_max']:.1f}) | {r['per_point_median']:.0f} s | {r['ratio_median']:.0f}x |")
    return lines + [""]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each workload (default: %(default)s)")
    args = parser.parse_args(argv)
    data = run(args.rounds)
    return publish("search_startup", data, report_section(data))


if __name__ == "__main__":
    main()
