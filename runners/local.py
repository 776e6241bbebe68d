"""Trials on local processes: one per rank, pinned to cores no other trial uses, and on CUDA
each rank with a GPU no other rank uses."""

from __future__ import annotations

import threading
from typing import Any

from slapo_tune.device import DeviceSetup, device_setup, split_gpus
from slapo_tune.launch import kill_processes, launch, usable_cores

from ._base import Runner
from .trial import TrialSpec, trial_rank


class _Pool:
    """Disjoint sets of items for concurrent trials: a trial waits until enough are free."""

    def __init__(self, items: list):
        self.items = list(items)
        self._free = list(self.items)
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self.items)

    def _take(self, n: int) -> list:
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, items: list) -> None:
        with self._cond:
            self._free = [x for x in self.items if x in self._free or x in items]  # the pool's order
            self._cond.notify_all()


class CorePool(_Pool):
    """Disjoint sets of CPU cores for concurrent trials: a trial waits rather than share a core
    (a shared core makes both trials' timings meaningless)."""

    def __init__(self, cores: list[int] | None = None):
        super().__init__(sorted(cores) if cores else usable_cores())

    @property
    def cores(self) -> list[int]:
        return self.items

    def acquire(self, n: int) -> list[int]:
        return self._take(min(n, len(self.items)))  # more ranks than cores: they share this trial's


class GPUPool(_Pool):
    """Disjoint sets of GPUs for concurrent trials: one GPU per rank, never shared with another
    rank (two ranks on one GPU would share its memory and its compute: neither the budget nor the
    timing would mean anything). ``gpus``: as ``CUDA_VISIBLE_DEVICES`` names them."""

    def acquire(self, n: int) -> list[str]:
        split_gpus(self.items, n)  # more ranks than GPUs would wait forever: a UsageError instead
        return self._take(n)


def rank_cores(cores: list[int], world_size: int) -> list[list[int]]:
    """Split a trial's cores among its ranks: a slice each, or round-robin when ranks outnumber
    cores (ranks of one trial then share, never with another trial)."""
    if len(cores) >= world_size:
        per = len(cores) // world_size
        return [cores[i * per:(i + 1) * per] for i in range(world_size)]
    return [[cores[i % len(cores)]] for i in range(world_size)]


class LocalRunner(Runner):
    """Runs each trial's ranks as local processes (gloo on CPU, nccl on GPUs: see
    :func:`slapo_tune.device.device_setup`) with a hard wall-clock limit; every rank process is
    killed by PID when the trial ends, fails or times out.

    ``concurrency`` trials may run at once; each gets ``cores // concurrency`` cores, and on CUDA
    one GPU per rank from a pool of ``gpus`` (default: every GPU visible here), so concurrent
    trials never share a GPU (:meth:`for_device` sizes ``concurrency`` to the GPUs).
    """

    name = "local"

    def __init__(self, concurrency: int = 1, cores: list[int] | None = None, gpus: list[str] | None = None):
        self.pool = CorePool(cores)
        self.concurrency = max(1, concurrency)
        self.share = max(1, len(self.pool) // max(1, concurrency))
        self._gpus = GPUPool(gpus) if gpus is not None else None
        self._gpus_lock = threading.Lock()
        self._running: set = set()

    @classmethod
    def for_device(cls, setup: DeviceSetup, world_size: int, concurrency: int | None = None) -> LocalRunner:
        """A runner for trials of ``world_size`` ranks on ``setup``: ``concurrency`` trials in flight
        (default: what the GPUs hold at one per rank on CUDA, the cores on CPU)."""
        fit = setup.concurrency(world_size)  # also with concurrency given: a world larger than the GPUs fails here
        return cls(concurrency=concurrency or fit, gpus=setup.gpu_ids if setup.cuda else None)

    def gpu_pool(self) -> GPUPool:
        """The GPUs trials take theirs from (made at the first CUDA trial unless given)."""
        with self._gpus_lock:
            if self._gpus is None:
                self._gpus = GPUPool(device_setup("cuda").gpu_ids)
            return self._gpus

    def cancel(self) -> None:
        kill_processes(list(self._running))

    def _execute(self, spec: TrialSpec, point: dict[str, Any]) -> list[dict[str, Any]]:
        setup = device_setup(spec.device, here=False)  # the kind's backend; the GPU pool checks for CUDA here
        gpus = self.gpu_pool().acquire(spec.world_size) if setup.cuda else None
        cores = self.pool.acquire(self.share)  # GPU ranks too: their host threads never share a core
        try:
            return launch(trial_rank, spec.world_size, args=(spec, point), timeout=spec.time_limit,
                          backend=setup.backend, gpus=gpus, cores=rank_cores(cores, spec.world_size),
                          running=self._running)
        finally:
            self.pool.release(cores)
            if gpus:
                self.gpu_pool().release(gpus)


def run_trial(spec: TrialSpec, runner: Runner | None = None):
    """Run one trial (locally unless a runner is given) and return its :class:`TrialResult`."""
    return (runner or LocalRunner()).run(spec)
