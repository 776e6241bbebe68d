"""Slapo's ``slapo.utils.report``: :func:`report_memory`."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from ..logger import get_logger

logger = get_logger()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _live_cpu_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of the tensors alive in this process (meta tensors
    hold none): what the CPU allocator holds for tensors, without the noise of the RSS."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        # plain tensors and parameters only (a fake or functional tensor holds no memory of its own);
        # type(), not isinstance(): isinstance reads __class__, which warns on deprecated torch objects
        if type(obj) in _PLAIN and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor with no real storage (fake, functional, freed)
                continue
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
    return sum(seen.values())


def report_memory(msg: str = "", report_gc: bool = False) -> float:
    """Log and return the device memory this rank's tensors hold, in MiB: CUDA's allocated
    memory on a GPU (as Slapo), the bytes of live CPU tensors on a CPU. ``report_gc`` also logs
    the count of tensor elements the garbage collector sees."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        used = torch.cuda.max_memory_allocated(torch.cuda.current_device()) / 2**20
        where = "GPU"
    else:
        used = _live_cpu_tensor_bytes() / 2**20
        where = "CPU tensors"
    logger.info("%s %s rank %d used: %.4f MiB", msg, where, rank, used)
    if report_gc:
        gc.collect()
        elements = sum(o.numel() for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
        logger.info("%s tensor elements alive: %d", msg, elements)
    return used


__all__ = ["report_memory"]
