"""Hardware descriptions: memory, achievable compute rate and an alpha-beta communication model.

Presets describe common GPUs (large GEMMs' achievable rate, and the datasheet peak for MFU). ``measure_cpu`` measures
this machine: a GEMM rate per thread and, with ``measure_collectives``, gloo all-reduce latency
and bandwidth between local processes. Measurements are cached per machine.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..device import DeviceSetup, device_setup
from ..errors import UsageError
from ..launch import launch

GiB = 2**30


# The time model evaluates one point (Python numbers) or many at once (numpy arrays, one element
# per point) by the same code: its branches on a point's knobs are these selections
def choose(condition: Any, if_true: Any, if_false: Any) -> Any:
    """``if_true if condition else if_false``, elementwise where ``condition`` is an array."""
    if isinstance(condition, np.ndarray):
        return np.where(condition, if_true, if_false)
    return if_true if condition else if_false


def smaller(a: Any, b: Any) -> Any:
    """``min(a, b)``, elementwise over arrays."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return min(a, b)


def larger(a: Any, b: Any) -> Any:
    """``max(a, b)``, elementwise over arrays."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return max(a, b)


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
    # fixed seconds per block per micro-batch: on a CPU, Python and the operators' dispatch; on a GPU
    # (whose host otherwise runs ahead of the kernels it launches), under an FSDP that makes the
    # host wait once per unit (FSDP1's rate limiter: cost_model.FsdpHost), the hooks and launches
    # the host makes after each wait
    overhead_per_layer: float = 0.0
    cores: int = 0  # CPU only: cores shared by the ranks of one node
    # a GEMM over T tokens runs at rate * T / (T + gemm_half_tokens): small micro-batches make
    # small matrices, which no device runs at full rate (0: not measured, every size at full rate).
    # On a CPU this is the figure for all its cores on one GEMM; one thread has no such loss
    gemm_half_tokens: float = 0.0
    # GPU: a linear layer's product whose smallest dimension is D runs at flops * D^2 / (D^2 + D0^2),
    # D0 = gemm_half_dim (half the rate at D0; 0: every shape at ``flops``)
    gemm_half_dim: float = 0.0
    # NICs a node's rings can drive at once across nodes (0: one per device, rail-optimised)
    nics_per_node: int = 0
    memory_bandwidth: float = 0.0  # bytes/s per device for streaming kernels (0: not modelled)
    peak_flops: float = 0.0  # the datasheet's dense peak for the training dtype (MFU's denominator; 0: flops)
    # achievable dense FLOP/s of large FP8 GEMMs (precision fp8's linear layers); 0: no FP8 tensor cores
    fp8_flops: float = 0.0

    def gemm_rate(self, tokens: Any, threads: Any = 1) -> Any:
        """Achievable FLOP/s of the GEMMs of a micro-batch of ``tokens`` tokens (on ``threads``
        threads of a CPU; a GPU is one device); elementwise over arrays of points."""
        half = self.gemm_half_tokens
        if self.cores:
            rate = self.flops * threads
            half *= (threads - 1) / (self.cores - 1) if self.cores > 1 else 0.0
        else:
            rate = self.flops
        return choose(tokens > 0, rate * tokens / choose(tokens > 0, tokens + half, 1.0), rate)

    def bandwidth(self, group_size: Any, spans_nodes: Any, per_node: Any = 1) -> Any:
        """Per direction, per rank, of a ring over a group with ``per_node`` of its ranks in each node
        (elementwise over arrays of groups). Across nodes NCCL runs a ring (channel) per NIC: each
        of the group's ranks in a node drives its own NIC (one per GPU, rail-optimised), and each
        ring crosses a node boundary once per node, so the group's bytes leave a node over
        ``per_node`` NICs at once (at most the node's ``nics_per_node``), up to what NVLink carries
        inside it; a group with one rank per node (ranks a node apart) has one NIC's bandwidth."""
        nics = self.nics_per_node or self.devices_per_node
        across = self.inter_bandwidth * larger(smaller(per_node, nics), 1)
        return choose(spans_nodes, smaller(across, self.intra_bandwidth), self.intra_bandwidth)

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS_FILE = Path(__file__).with_name("hardware_presets.json")
PRESET_FIELDS = {"memory_gib", "peak_flops", "flops", "memory_bandwidth", "intra_bandwidth", "inter_bandwidth",
                 "nics_per_node", "devices_per_node", "latency", "gemm_half_dim", "overhead_per_layer", "fp8_flops"}


def load_presets(path: Path = PRESETS_FILE) -> tuple[dict[str, Hardware], dict[str, str]]:
    """The GPU presets (``hardware_presets.json``: each figure with its source) and the GPU model
    each describes, as it appears in ``torch.cuda.get_device_properties(i).name`` ("NVIDIA H100
    80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA H200", "NVIDIA B200", "Tesla V100-SXM2-32GB")."""
    presets, models = {}, {}
    for name, entry in json.loads(path.read_text())["presets"].items():
        figures = {k: v for k, v in entry.items() if k in PRESET_FIELDS}
        if figures.keys() != PRESET_FIELDS or not entry.get("sources"):
            raise ValueError(f"{path.name}: preset {name} needs {sorted(PRESET_FIELDS)} and its sources")
        memory = int(figures.pop("memory_gib") * GiB)
        presets[name] = Hardware(name, memory, **figures)
        models[name] = entry["model"]
    return presets, models


PRESETS, PRESET_MODELS = load_presets()


def _cache_dir() -> Path:
    path = Path(os.environ.get("SLAPO_TUNE_CACHE", Path.home() / ".cache" / "slapo-tune"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


GEMM_TOKENS = (64, 128, 256, 512, 1024, 2048)  # rows of the measured GEMMs (tokens per micro-batch)


def _gemm_curve(threads: int, size: int = 512, repeats: int = 5) -> tuple[float, float]:
    """(full rate, half-rate tokens) on ``threads`` threads: ``tokens x size @ size x size`` GEMMs
    at several token counts, fitted to ``rate(T) = R * T / (T + T_half)`` (linear in 1 / T)."""
    import torch  # measuring only: a preset's figures need no torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = torch.randn(size, size)
        inverse_rates, inverse_tokens = [], []
        for tokens in GEMM_TOKENS:
            a = torch.randn(tokens, size)
            seconds = _best_seconds(lambda a=a: a @ b, repeats)
            inverse_rates.append(seconds / (2 * tokens * size * size))
            inverse_tokens.append(1.0 / tokens)
    finally:
        torch.set_num_threads(previous)
    n = len(GEMM_TOKENS)
    mean_x, mean_y = sum(inverse_tokens) / n, sum(inverse_rates) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(inverse_tokens, inverse_rates))
             / sum((x - mean_x) ** 2 for x in inverse_tokens))
    intercept = mean_y - slope * mean_x
    if intercept <= 0:  # the smallest GEMMs were the fastest: no curve to model
        return 1.0 / min(inverse_rates), 0.0
    return 1.0 / intercept, max(0.0, slope / intercept)


def _stream_bandwidth(megabytes: int = 64, repeats: int = 5) -> float:
    """Bytes/s of one thread accumulating one tensor into another (a gradient accumulation)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = megabytes * 2**20 // 4
        total, part = torch.zeros(n), torch.ones(n)
        return 3 * n * 4 / _best_seconds(lambda: total.add_(part), repeats)  # read both, write one
    finally:
        torch.set_num_threads(previous)


def _collective_rank(ctx, sizes):
    import torch
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
    sizes = [4096, 1 << 18, 1 << 21]
    # this CPU's collectives (gloo), also on a machine with GPUs
    times = launch(_collective_rank, world_size, args=(sizes,), timeout=120, threads_per_rank=1,
                   backend=device_setup("cpu").backend)[0]
    factor = 2 * (world_size - 1) / world_size  # ring all-reduce moves this many bytes per byte
    slope = (times[-1] - times[0]) / ((sizes[-1] - sizes[0]) * factor)
    bandwidth = 1.0 / max(slope, 1e-12)
    latency = max(times[0] - sizes[0] * factor / bandwidth, 1e-6) / (2 * (world_size - 1))
    return latency, bandwidth


CPU_MEASURES = {"flops", "latency", "intra_bandwidth", "gemm_half_tokens", "memory_bandwidth"}


def measure_cpu(refresh: bool = False, with_collectives: bool = True) -> Hardware:
    """This CPU as a :class:`Hardware` (cached in ~/.cache/slapo-tune/cpu.json)."""
    cache = _cache_dir() / "cpu.json"
    if cache.exists() and not refresh:
        try:
            cached = json.loads(cache.read_text())
            if cached.keys() >= CPU_MEASURES:  # a cache from before a measure was added is redone
                return Hardware(**cached)
        except (ValueError, TypeError):
            pass
    cores = os.cpu_count() or 1
    rate, _ = _gemm_curve(1)
    half_tokens = _gemm_curve(cores)[1] if cores > 1 else 0.0
    latency, bandwidth = measure_collectives(2) if with_collectives and cores >= 1 else (50e-6, 2e9)
    hw = Hardware("cpu", memory=_physical_memory(), flops=rate, intra_bandwidth=bandwidth,
                  inter_bandwidth=bandwidth, latency=latency, devices_per_node=cores, cores=cores,
                  overhead_per_layer=4e-4, gemm_half_tokens=half_tokens, memory_bandwidth=_stream_bandwidth())
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(hw.as_dict()))
    os.replace(tmp, cache)
    return hw


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 16 * GiB


def detect_hardware(name: str, memory: int) -> tuple[Hardware, str]:
    """The preset for a GPU described by its ``name`` and ``memory`` in bytes (what
    ``torch.cuda.get_device_properties(i)`` reports as ``.name`` and ``.total_memory``), with the
    device's own memory, and one line saying what was chosen.

    A GPU of a preset's model gets that model's preset closest in memory (an A100 of 40 or 80 GB).
    An unknown GPU gets the preset closest in memory, as a fallback the line names, with a pointer to
    ``--hardware``: its rates may be far from the device's."""
    lowered = name.lower()
    size = f"{memory / GiB:.1f} GiB"
    same_model = [key for key, model in PRESET_MODELS.items() if model in lowered]

    def closest(keys):
        return min(keys, key=lambda key: (abs(PRESETS[key].memory - memory), key))

    if same_model:
        key = closest(same_model)
        line = f"hardware {key} (detected: {name}, {size})"
    else:
        key = closest(PRESETS)
        line = (f"hardware {key} (fallback: {name}, {size}, matches no preset; {key} is the closest in memory, "
                f"choose another with --hardware)")
    return replace(PRESETS[key], memory=memory), line


def hardware_for(setup: DeviceSetup) -> tuple[Hardware, str]:
    """The hardware of the devices ranks run on: this CPU (measured) on ``cpu``, the visible GPU's
    preset (:func:`detect_hardware`) on ``cuda``; with the one line saying what was chosen."""
    if not setup.cuda:
        return measure_cpu(), "hardware cpu (this machine, measured)"
    if not setup.gpus:
        raise UsageError(f"no GPU is visible here to detect the hardware from: give --hardware "
                         f"({', '.join(PRESETS)})")
    smallest = min(setup.gpus, key=lambda g: g.memory)
    return detect_hardware(smallest.name, smallest.memory)


def hardware(name: str, memory: int | None = None) -> Hardware:
    """A preset by name (``cpu`` measures this machine); ``memory`` overrides the device memory."""
    if name == "cpu":
        hw = measure_cpu()
    elif name in PRESETS:
        hw = PRESETS[name]
    else:
        raise UsageError(f"unknown hardware '{name}' (choose from cpu, {', '.join(PRESETS)})")
    return replace(hw, memory=memory) if memory is not None else hw
