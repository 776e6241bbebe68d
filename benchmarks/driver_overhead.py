"""Driver overhead per trial at 1,000 trials: what the tuner itself costs (ask, cost-model
pruning, tell, the journal, the outputs written after every trial) when trials take no time.

The space is Llama-7B on 64 ranks (11,060 legal points); every launched point is answered at once
by a synthetic runner with a throughput that depends on the point. Run:
``python -m benchmarks.driver_overhead [--trials 1000] [--strategies tpe,random]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks._stats import isolated_cache, save_json  # noqa: E402
from runners._base import Runner  # noqa: E402


class InstantRunner(Runner):
    """Answers every trial at once (a throughput derived from the point); nothing runs."""

    name = "instant"

    def _execute(self, spec, point):
        raise NotImplementedError  # run() is overridden

    def run(self, spec):
        from runners.trial import TrialResult
        from slapo_tune.plan import TrialStatus

        digest = hashlib.sha256(repr(sorted(spec.knobs.items())).encode()).digest()
        value = 10.0 + digest[0] / 25.5
        return TrialResult(status=TrialStatus.OK, knobs=dict(spec.knobs), samples_per_s=value, step_times=[1.0 / value],
                           peak_memory=[1], losses=[1.0], runner=self.name)


def driver_seconds_per_trial(strategy: str, trials: int, out: Path) -> dict:
    from slapo_tune.problem import ProblemSpec
    from slapo_tune.search import TuneConfig, Tuner

    problem = ProblemSpec("llama-7b", 64, precision="bf16", device="cuda", memory_budget=80 * 2**30)
    config = TuneConfig(problem, out=out, trials=trials, strategy=strategy, prune="analytic", seed=0,
                        hardware="a100-80gb")
    tuner = Tuner(config, InstantRunner())
    started = time.perf_counter()
    summary = tuner.run()
    wall = time.perf_counter() - started
    asked = summary["launched"] + summary["pruned"] + summary["duplicates"]
    return {"launched": summary["launched"], "pruned": summary["pruned"], "asked": asked, "wall_seconds": wall,
            "seconds_per_launched_trial": wall / max(1, summary["launched"]),
            "seconds_per_asked_point": wall / max(1, asked)}


def _in_temp_dir(strategy: str, trials: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return driver_seconds_per_trial(strategy, trials, Path(tmp) / "study")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--strategies", default="tpe,random")
    args = parser.parse_args(argv)
    isolated_cache()  # no calibration or measurement from a user's cache
    strategies = args.strategies.split(",")
    # one process per strategy (the driver is single-threaded Python): both run at once on 2 cores
    with cf.ProcessPoolExecutor(max_workers=max(1, min(len(strategies), os.cpu_count() or 1)),
                                mp_context=multiprocessing.get_context("spawn")) as pool:
        results = dict(zip(strategies, pool.map(_in_temp_dir, strategies, [args.trials] * len(strategies))))
    for strategy, r in results.items():
        print(f"{strategy}: {r['launched']} trials launched ({r['pruned']} pruned) in {r['wall_seconds']:.1f} s: "
              f"{r['seconds_per_launched_trial'] * 1e3:.1f} ms per trial")
    save_json("driver_overhead", {"trials": args.trials, "results": results,
                                  "median_ms_per_trial": statistics.median(
                                      r["seconds_per_launched_trial"] * 1e3 for r in results.values())})
    return results


if __name__ == "__main__":
    main()
