"""Tuning drivers for the shared-study tests (importable by spawned processes)."""

from __future__ import annotations

import time

from runners.replay import ReplayRunner


class LastingReplay(ReplayRunner):
    """Replayed trials that take a moment, as real ones do (drivers on one study interleave)."""

    def run(self, spec):
        result = super().run(spec)
        time.sleep(0.1)
        return result


def drive(storage: str, out: str, strategy: str, seed: int, trials: int, queue, barrier=None) -> None:
    """One driver on the shared study: the points it launched, put on ``queue``. With ``barrier``:
    its search starts when every driver's tuner is built and its study opened (a driver that
    started up faster would otherwise run every trial before the other asks for one)."""
    from pathlib import Path

    from benchmarks.search_strategies import load_grid, replay_tuner

    try:
        results, budget = load_grid()
        runner = LastingReplay(results)
        tuner, _ = replay_tuner(strategy, seed, "analytic", results, budget, trials, runner=runner,
                                storage=storage, out=Path(out), study="shared")
        tuner.open()  # (registered in the study before any driver's search starts)
        if barrier is not None:
            barrier.wait(timeout=300)
        summary = tuner.run()
        queue.put((runner.launched, summary["best"]))
    except BaseException:  # the test shows why instead of waiting for a report that never comes
        import traceback

        queue.put(("failed", traceback.format_exc()))
