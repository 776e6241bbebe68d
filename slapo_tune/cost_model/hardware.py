"""Hardware descriptions: memory, achievable compute rate and an alpha-beta communication model.

Presets describe common GPUs (achievable rates, not datasheet peaks). ``measure_cpu`` measures
this machine: a GEMM rate per thread and, with ``measure_collectives``, gloo all-reduce latency
and bandwidth between local processes. Measurements are cached per machine.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..errors import UsageError

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One device kind and its links. Rates in FLOP/s, bandwidths in bytes/s, latencies in s."""

    name: str
    memory: int  # bytes per device
    flops: float  # achievable dense FLOP/s per device, for the training dtype
    intra_bandwidth: float  # per direction, within a node
    inter_bandwidth: float  # per device, across nodes
    latency: float = 10e-6
    devices_per_node: int = 8
    overhead_per_layer: float = 0.0  # fixed seconds per block per micro-batch (launches, Python)
    cores: int = 0  # CPU only: cores shared by the ranks of one node

    def bandwidth(self, group_size: int, spans_nodes: bool) -> float:
        return self.inter_bandwidth if spans_nodes else self.intra_bandwidth

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, Hardware] = {
    # achievable bf16 rates ~50% of peak for transformer training; NVLink / InfiniBand per GPU
    "a100-80gb": Hardware("a100-80gb", 80 * GiB, 156e12, 250e9, 25e9, 8e-6),
    "a100-40gb": Hardware("a100-40gb", 40 * GiB, 156e12, 250e9, 25e9, 8e-6),
    "h100-80gb": Hardware("h100-80gb", 80 * GiB, 450e12, 400e9, 50e9, 6e-6),
    "h200": Hardware("h200", 141 * GiB, 450e12, 400e9, 50e9, 6e-6),
    "v100-32gb": Hardware("v100-32gb", 32 * GiB, 60e12, 130e9, 12e9, 10e-6),
}


def _cache_dir() -> Path:
    path = Path(os.environ.get("SLAPO_TUNE_CACHE", Path.home() / ".cache" / "slapo-tune"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _gemm_rate(threads: int, size: int = 512, repeats: int = 5) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * size**3 / best
    finally:
        torch.set_num_threads(previous)


def _collective_rank(ctx, sizes):
    import torch.distributed as dist

    out = []
    for n in sizes:
        t = torch.zeros(n // 4)
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append(sorted(times)[len(times) // 2])
    return out


def measure_collectives(world_size: int = 2) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of gloo all-reduce between local processes (alpha-beta fit)."""
    from ..launch import launch

    sizes = [4096, 1 << 18, 1 << 21]
    times = launch(_collective_rank, world_size, args=(sizes,), timeout=120, threads_per_rank=1)[0]
    factor = 2 * (world_size - 1) / world_size  # ring all-reduce moves this many bytes per byte
    slope = (times[-1] - times[0]) / ((sizes[-1] - sizes[0]) * factor)
    bandwidth = 1.0 / max(slope, 1e-12)
    latency = max(times[0] - sizes[0] * factor / bandwidth, 1e-6) / (2 * (world_size - 1))
    return latency, bandwidth


def measure_cpu(refresh: bool = False, with_collectives: bool = True) -> Hardware:
    """This CPU as a :class:`Hardware` (cached in ~/.cache/slapo-tune/cpu.json)."""
    cache = _cache_dir() / "cpu.json"
    if cache.exists() and not refresh:
        try:
            return Hardware(**json.loads(cache.read_text()))
        except (ValueError, TypeError):
            pass
    cores = os.cpu_count() or 1
    rate = _gemm_rate(1)
    latency, bandwidth = measure_collectives(2) if with_collectives and cores >= 1 else (50e-6, 2e9)
    hw = Hardware("cpu", memory=_physical_memory(), flops=rate, intra_bandwidth=bandwidth,
                  inter_bandwidth=bandwidth, latency=latency, devices_per_node=cores, cores=cores,
                  overhead_per_layer=4e-4)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(hw.as_dict()))
    os.replace(tmp, cache)
    return hw


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 16 * GiB


def hardware(name: str, memory: int | None = None) -> Hardware:
    """A preset by name (``cpu`` measures this machine); ``memory`` overrides the device memory."""
    if name == "cpu":
        hw = measure_cpu()
    elif name in PRESETS:
        hw = PRESETS[name]
    else:
        raise UsageError(f"unknown device '{name}' (devices: cpu, {', '.join(PRESETS)})")
    return replace(hw, memory=memory) if memory is not None else hw
