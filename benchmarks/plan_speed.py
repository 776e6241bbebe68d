"""``slapo-tune plan`` at the scale users plan for: the whole command's wall time (a fresh process,
its imports included, as a user runs it), for GPT-3 175B on 1,024 ranks (target under 3 s) and
Megatron-LM's 1T GPT on 3,072 (under 5 s), with 175B on 384 ranks and Llama-2-70B on 64 beside them. The workloads run
in turn, round by round, so a slow period of a shared machine hits each alike; medians and spread.
Run: ``python -m benchmarks.plan_speed [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from benchmarks._stats import publish, round_orders

# (label, plan's arguments, target seconds or None)
WORKLOADS = (
    ("gpt3-175b w1024", ["--model", "gpt3-175b", "--world-size", "1024", "--seq-len", "2048",
                         "--global-batch", "1536"], 3.0),
    ("gpt-1t w3072", ["--model", "gpt-1t", "--world-size", "3072", "--seq-len", "2048", "--global-batch", "3072"], 5.0),
    ("gpt3-175b w384", ["--model", "gpt3-175b", "--world-size", "384", "--seq-len", "2048",
                        "--global-batch", "1536"], None),
    # Llama-2-70B on 8 nodes (1.29M points): the test suite's plan at scale, timed here rather than
    # asserted there (tests/multirank/test_cost_model.py::test_plan_llama70b_on_64_gpus)
    ("llama-70b w64", ["--model", "llama-70b", "--world-size", "64", "--seq-len", "4096", "--global-batch", "1024"],
     None),
)


def _plan(arguments: list[str]) -> tuple[float, float, str]:
    """One ``plan`` run: wall and CPU seconds, and its header line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "slapo_tune", "plan", *arguments, "--memory-budget", "80GiB"],
                          capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout.splitlines()[0]


def run(rounds: int) -> dict:
    walls: dict[str, list[float]] = {label: [] for label, *_ in WORKLOADS}
    cpus: dict[str, list[float]] = {label: [] for label, *_ in WORKLOADS}
    headers: dict[str, str] = {}
    arguments = {label: args for label, args, _ in WORKLOADS}
    for order in round_orders(list(walls), rounds + 1):
        for label in order:
            wall, cpu, headers[label] = _plan(arguments[label])
            walls[label].append(wall)
            cpus[label].append(cpu)
    rows = {}
    for label, _, target in WORKLOADS:
        wall, cpu = walls[label][1:], cpus[label][1:]  # the first round warms the file cache, unmeasured
        rows[label] = {"wall_median": statistics.median(wall), "wall_min": min(wall), "wall_max": max(wall),
                       "cpu_median": statistics.median(cpu), "target_s": target, "header": headers[label],
                       "rounds": len(wall)}
    return {"rows": rows, "cpus": os.cpu_count()}


def report_section(data: dict) -> list[str]:
    lines = ["## `plan` at scale", "", f"Whole command, a fresh process each run ({data['cpus']} CPUs here):", "",
             "| workload | wall median (min-max) | CPU median | target | points |", "|---|---|---|---|---|"]
    for label, r in data["rows"].items():
        points = r["header"].split(": ", 1)[1].split(" (", 1)[0]
        target = f"< {r['target_s']:.0f} s" if r["target_s"] else "-"
        lines.append(f"| {label} | {r['wall_median']:.2f} s ({r['wall_min']:.2f}-{r['wall_max']:.2f}) | "
                     f"{r['cpu_median']:.2f} s | {target} | {points} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured runs of each workload (default: %(default)s)")
    args = parser.parse_args(argv)
    data = run(args.rounds)
    return publish("plan_speed", data, report_section(data))


if __name__ == "__main__":
    main()
