"""Per-trial overhead of the local and the Ray runner, next to the trial's own training time.

Overhead = the trial's wall time as the driver sees it minus its training time (first rank's
model build to the last rank's return): starting rank processes or actors, rendezvous, teardown.
Runners alternate trial by trial on the same point, the Ray cluster started beforehand ("once the
cluster is up"). Target: Ray overhead <= 1.5 x local. Run: ``python -m benchmarks.runner_overhead``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile

from benchmarks._stats import median_iqr, save_json  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)

    import ray

    from runners import LocalRunner, TrialSpec
    from runners.ray_runner import RayRunner
    from slapo_tune.problem import ProblemSpec

    tmp = tempfile.mkdtemp(prefix="slapo-bench-ray-")
    os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, _temp_dir=os.path.join(tmp, "ray"))
    runners = {"local": LocalRunner(), "ray": RayRunner()}
    summary = {}
    try:
        for world in args.worlds:
            problem = ProblemSpec("gpt2-tiny", world, global_batch=8, seq_len=32)
            figures = {name: {"overhead": [], "train": []} for name in runners}
            for i in range(args.repeats):
                for name, runner in runners.items():
                    spec = TrialSpec(problem, {"tp": 2, "micro_batch": 2}, measured_steps=2, time_limit=300,
                                     name=f"bench-{name}-{world}-{i}")
                    result = runner.run(spec)
                    if result.status != "ok":
                        raise SystemExit(f"{name} trial failed: {result.error}")
                    figures[name]["overhead"].append(result.overhead_seconds)
                    figures[name]["train"].append(result.train_seconds)
            row = {}
            for name, f in figures.items():
                med, lo, hi = median_iqr(f["overhead"])
                row[name] = {"overhead_median": med, "overhead_p25": lo, "overhead_p75": hi,
                             "train_median": statistics.median(f["train"]), "overheads": f["overhead"]}
                print(f"world {world} {name:<5}: overhead median {med:6.2f} s (p25 {lo:.2f}, p75 {hi:.2f}); "
                      f"training {row[name]['train_median']:.2f} s")
            per_round = [r / loc for r, loc in zip(figures["ray"]["overhead"], figures["local"]["overhead"])]
            row["ray_over_local"] = row["ray"]["overhead_median"] / row["local"]["overhead_median"]
            row["ray_over_local_per_round"] = median_iqr(per_round)
            print(f"world {world}: Ray/local overhead {row['ray_over_local']:.2f} "
                  f"(per round median {row['ray_over_local_per_round'][0]:.2f}, p25 {row['ray_over_local_per_round'][1]:.2f}, "
                  f"p75 {row['ray_over_local_per_round'][2]:.2f}; target <= 1.5)")
            summary[f"world{world}"] = row
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)  # the Ray session's folder: nothing left behind
    save_json("runner_overhead", summary)
    return summary


if __name__ == "__main__":
    main()
