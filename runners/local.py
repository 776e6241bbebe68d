"""Trials on local processes: one per rank, pinned to cores no other trial uses."""

from __future__ import annotations

import threading
from typing import Any

from slapo_tune.launch import kill_processes, launch, usable_cores

from ._base import Runner
from .trial import TrialSpec, trial_rank


class CorePool:
    """Disjoint sets of CPU cores for concurrent trials: a trial waits rather than share a core
    (a shared core makes both trials' timings meaningless)."""

    def __init__(self, cores: list[int] | None = None):
        self.cores = sorted(cores) if cores else usable_cores()
        self._free = list(self.cores)
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self.cores)

    def acquire(self, n: int) -> list[int]:
        n = min(n, len(self.cores))
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, cores: list[int]) -> None:
        with self._cond:
            self._free = sorted(self._free + cores)
            self._cond.notify_all()


def rank_cores(cores: list[int], world_size: int) -> list[list[int]]:
    """Split a trial's cores among its ranks: a slice each, or round-robin when ranks outnumber
    cores (ranks of one trial then share, never with another trial)."""
    if len(cores) >= world_size:
        per = len(cores) // world_size
        return [cores[i * per:(i + 1) * per] for i in range(world_size)]
    return [[cores[i % len(cores)]] for i in range(world_size)]


class LocalRunner(Runner):
    """Runs each trial's ranks as local processes (gloo on CPU, nccl on GPUs) with a hard wall-clock
    limit; every rank process is killed by PID when the trial ends, fails or times out.

    ``concurrency`` trials may run at once; each gets ``cores // concurrency`` cores.
    """

    name = "local"

    def __init__(self, concurrency: int = 1, cores: list[int] | None = None):
        self.pool = CorePool(cores)
        self.concurrency = max(1, concurrency)
        self.share = max(1, len(self.pool) // max(1, concurrency))
        self._running: set = set()

    def cancel(self) -> None:
        kill_processes(list(self._running))

    def _execute(self, spec: TrialSpec, point: dict[str, Any]) -> list[dict[str, Any]]:
        cores = self.pool.acquire(self.share) if spec.device == "cpu" else None
        try:
            return launch(trial_rank, spec.world_size, args=(spec, point), timeout=spec.time_limit,
                          backend="nccl" if spec.device == "cuda" else "gloo",
                          cores=rank_cores(cores, spec.world_size) if cores else None, running=self._running)
        finally:
            if cores:
                self.pool.release(cores)


def run_trial(spec: TrialSpec, runner: Runner | None = None):
    """Run one trial (locally unless a runner is given) and return its :class:`TrialResult`."""
    return (runner or LocalRunner()).run(spec)
