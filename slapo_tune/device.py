"""Where ranks run: the device kind and everything that follows from it.

``--device`` says where trials and training ranks run: ``cpu`` (gloo; each rank a process pinned to
cores of its own) or ``cuda`` (nccl; each rank a process with one GPU of its own). It is not the
cost model's hardware (the presets of :mod:`slapo_tune.cost_model.hardware`, ``--hardware``).

:func:`device_setup` is the one place that decides the kind (``cuda`` when CUDA is available,
unless asked otherwise), the backend, how many devices ranks can be given, and the defaults that
follow from them (trials in flight, the memory budget on a GPU). Commands and runners ask it
instead of comparing strings. This module imports torch only inside its functions: a launcher
imports it before any rank has chosen its GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import UsageError

GiB = 2**30
KINDS = ("cpu", "cuda")

# What a GPU holds besides the tensors a memory budget counts (the caching allocator's peak), so
# what the default budget leaves free on a device of M bytes: CUDA_RESERVE_FIXED + CUDA_RESERVE_FRACTION x M.
# - the CUDA context and loaded kernels, cuBLAS/cuDNN workspaces: 0.5 to 1 GiB per process;
# - NCCL's communicator buffers: NCCL_BUFFSIZE (4 MiB) per channel and peer, for each of a rank's
#   communicators (tensor, pipeline and data-parallel groups): up to about 1 GiB;
# - the caching allocator's fragmentation: a trial's budget caps what the allocator may reserve,
#   but training with the tuned schedule runs uncapped, and what it reserves exceeds the peak it
#   allocates by a few per cent of the memory in use.
CUDA_RESERVE_FIXED = 2 * GiB
CUDA_RESERVE_FRACTION = 0.05
# NCCL's watchdog, on a collective that outlasts the process group's timeout: abort the
# communicator (which frees the GPU of a kernel spinning on a peer that is gone) and end the
# process; the launcher then sees the rank die and ends the trial.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cuda_reserve(memory: int) -> int:
    """Bytes of a GPU of ``memory`` bytes that the default memory budget leaves free (see
    :data:`CUDA_RESERVE_FIXED`)."""
    return CUDA_RESERVE_FIXED + int(CUDA_RESERVE_FRACTION * memory)


def collective_timeout(time_limit: float) -> float:
    """Seconds after which a collective counts as hung: half a trial's wall-clock limit (at least
    30 s, at most the limit), so that NCCL's watchdog ends the ranks of a hung trial well before the
    runner's wall-clock kill, which stays the last resort."""
    return min(time_limit, max(30.0, time_limit / 2))


def visible_gpu_ids(count: int) -> list[str]:
    """How a child process names each of this process's ``count`` GPUs in its own
    ``CUDA_VISIBLE_DEVICES``: the entries of ours (indices, UUIDs or MIG ids) when it is set, so a
    rank given GPU 1 of ``CUDA_VISIBLE_DEVICES=4,5`` gets physical GPU 5; else the indices."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [entry.strip() for entry in visible.split(",") if entry.strip()][:count]
    return [str(i) for i in range(count)]


# local cpu ranks per core beyond which a run is a fork bomb (each rank is a process of ~300 MB with
# torch imported), not a trial: the tests run 4 ranks on 2 cores
CPU_RANKS_PER_CORE = 16


def default_concurrency(kind: str, world_size: int, devices: int) -> int:
    """Trials in flight by default: on ``cuda`` the trials that ``devices`` GPUs hold at one GPU per
    rank (a world larger than the GPUs is a :class:`UsageError`), on ``cpu`` the trials that
    ``devices`` cores hold at a core per rank (at least 1: ranks of one trial may share cores, up
    to :data:`CPU_RANKS_PER_CORE` each, beyond which it is a :class:`UsageError`)."""
    if kind == "cuda":
        if world_size > devices:
            raise _too_few_gpus(world_size, devices)
        return devices // world_size
    if devices and world_size > CPU_RANKS_PER_CORE * devices:
        raise UsageError(f"{world_size} cpu ranks on this machine's {devices} core(s): at most {CPU_RANKS_PER_CORE} "
                         "per core (each is a process); plan it with slapo-tune plan, or run it on a cluster")
    return max(1, devices // world_size)


@dataclass(frozen=True)
class GPU:
    """One GPU ranks can be given: ``id`` as a child's ``CUDA_VISIBLE_DEVICES`` names it."""

    id: str
    name: str
    memory: int  # bytes


@dataclass(frozen=True)
class DeviceSetup:
    """Where ranks run (see :func:`device_setup`). ``count``: the devices ranks can be given (GPUs
    on ``cuda``, usable cores on ``cpu``; 0 when the ranks run on a cluster this process cannot
    see); ``gpus``: this machine's GPUs (empty on ``cpu``, or when none is visible here)."""

    kind: str
    backend: str
    count: int
    gpus: tuple[GPU, ...] = ()

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def name(self) -> str:
        """The GPUs' name (``NVIDIA H200``), or the kind when no GPU is visible here."""
        return self.gpus[0].name if self.gpus else self.kind

    @property
    def memory(self) -> int | None:
        """Bytes of the smallest visible GPU (None on ``cpu`` or when no GPU is visible here)."""
        return min(g.memory for g in self.gpus) if self.gpus else None

    @property
    def gpu_ids(self) -> list[str]:
        return [g.id for g in self.gpus]

    def default_memory_budget(self) -> int | None:
        """The per-rank budget when none is given: on ``cuda`` the GPU's memory less
        :func:`cuda_reserve`; None on ``cpu`` (the command's own default applies)."""
        memory = self.memory
        if not self.cuda:
            return None
        if memory is None:
            raise UsageError("the GPUs' memory is not known here (no GPU visible to this process): give --memory-budget")
        return memory - cuda_reserve(memory)

    def concurrency(self, world_size: int) -> int:
        """Trials in flight by default on this machine's devices (:func:`default_concurrency`)."""
        return default_concurrency(self.kind, world_size, self.count)

    def shares_cores(self, world_size: int) -> bool:
        """Whether ``world_size`` local ranks on ``cpu`` would outnumber the usable cores, so that
        ranks take turns on them and a trial times that as much as its schedule."""
        return not self.cuda and 0 < self.count < world_size

    def check_world(self, world_size: int) -> None:
        """A :class:`UsageError` when ``world_size`` local ranks cannot each have a GPU of their own."""
        self.concurrency(world_size)

    def rank_device(self, local_rank: int = 0) -> str:
        """The torch device of a rank: ``cpu``, or its GPU: ``cuda:0`` when its launcher gave it one
        GPU through ``CUDA_VISIBLE_DEVICES`` (local ranks, Ray), ``cuda:LOCAL_RANK`` when it sees
        every GPU of its node (torchrun)."""
        if not self.cuda:
            return "cpu"
        if self.count <= 1:
            return "cuda:0"
        if local_rank >= self.count:
            raise UsageError(f"local rank {local_rank} has no GPU of its own ({self.count} visible): "
                             f"start at most {self.count} ranks per node, or use --device cpu")
        return f"cuda:{local_rank}"


# Where a GPU driver shows on Linux (NVIDIA, AMD's ROCm, WSL's GPU paravirtualisation): without
# one of them torch cannot see a GPU, so a command that only plans need not import torch (2-3 s) to
# ask it
_GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, without importing torch on a Linux machine with no GPU driver
    (once torch is imported, it is asked: tests mock it)."""
    import sys

    if "torch" not in sys.modules and sys.platform == "linux" and not any(map(os.path.exists, _GPU_DRIVER_PATHS)):
        return False
    import torch

    return torch.cuda.is_available()


def device_setup(requested: str | None = None, *, here: bool = True) -> DeviceSetup:
    """Where ranks run: ``requested`` is ``cpu``, ``cuda``, or None / ``auto`` (``cuda`` when
    ``torch.cuda.is_available()``, else ``cpu``).

    ``here``: the ranks run on this machine, so ``cuda`` needs CUDA here (else a
    :class:`UsageError`, one line). With ``here=False`` (ranks on a Ray cluster, or a ``plan`` for
    a cluster) ``cuda`` is taken as asked, with this machine's GPUs as the description when it has
    any. Anything else (a hardware preset such as ``a100-80gb``) is a :class:`UsageError` pointing
    to ``--hardware``."""
    kind = requested or "auto"
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    if kind not in KINDS:
        raise UsageError(f"unknown device '{kind}': --device is where ranks run (cpu or cuda); "
                         f"a cost-model hardware preset goes to --hardware")
    if kind == "cpu":
        return DeviceSetup("cpu", "gloo", len(usable_cores()))
    if not cuda_available():
        if here:
            raise UsageError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); "
                             "use --device cpu")
        return DeviceSetup("cuda", "nccl", 0)
    import torch

    count = torch.cuda.device_count()
    ids = visible_gpu_ids(count)
    gpus = []
    for index, gpu_id in enumerate(ids):
        props = torch.cuda.get_device_properties(index)
        gpus.append(GPU(gpu_id, props.name, int(props.total_memory)))
    return DeviceSetup("cuda", "nccl", len(gpus), tuple(gpus))


def auto_setup(world_size: int) -> DeviceSetup:
    """The library's default when nobody asked (:func:`slapo_tune.launch.launch` without a
    backend, ``torchrun``): ``cuda`` when CUDA gives each of ``world_size`` local ranks a GPU of
    its own, else ``cpu``."""
    setup = device_setup(None)
    if setup.cuda and setup.count < world_size:
        return device_setup("cpu")
    return setup


def rank_environment(backend: str, gpu: str | None) -> dict[str, str]:
    """What a rank process's environment adds for ``backend``: on nccl its one GPU
    (``CUDA_VISIBLE_DEVICES``, so it sees ``cuda:0``) and NCCL's error handling (:data:`NCCL_ENV`)."""
    if backend != "nccl":
        return {}
    if gpu is None:
        raise ValueError("an nccl rank needs a GPU of its own")
    return {"CUDA_VISIBLE_DEVICES": gpu, **NCCL_ENV}


def split_gpus(gpus: Sequence[str], world_size: int) -> list[str]:
    """One GPU per rank from ``gpus`` (a :class:`UsageError` when there are too few)."""
    if len(gpus) < world_size:
        raise _too_few_gpus(world_size, len(gpus))
    return list(gpus[:world_size])


def _too_few_gpus(world_size: int, gpus: int) -> UsageError:
    return UsageError(f"world size {world_size} needs {world_size} GPUs (one per rank) but {gpus} "
                      f"{'is' if gpus == 1 else 'are'} available: lower --world-size or use --device cpu")
