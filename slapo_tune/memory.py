"""Measured peak memory of real training steps, by tools the cost model's predictions never use.

So that a fault in the prediction's own tracker (:mod:`slapo_tune.cost_model._tracker`, which
exact mode runs on fake tensors) cannot hide in its tests: on CUDA the caching allocator's
``max_memory_allocated``; on CPU torch's own ``torch.distributed._tools.mem_tracker.MemTracker``
(every live tensor storage on the device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class MemoryBreakdown:
    """Bytes per category at the moment of the peak (``total`` is the peak): parameters and
    buffers, optimizer state, activations (allocated in forward), gradients (allocated in
    backward: gradients and backward temporaries)."""

    total: int
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    reserved: int = 0  # CUDA: the caching allocator's peak reserved bytes (0 on CPU: no allocator cache)
    # the most activation bytes alive at any moment of the step, wherever the peak is: what a
    # forward keeps for backward (tensor-level trackers only)
    most_activations: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _NoModuleHooks:
    """Stands in for ``MemTracker``'s module tracker, which hooks every module's forward and
    backward. Those hooks change what they measure: on a pipeline stage they kept a hidden state
    per micro-batch alive (+2 % on a GPipe stage), and ``MemTracker`` refuses a root module called
    once per micro-batch. The device-wide peak needs none of them; what is left of the module
    tracker is telling backward from forward, for the categories."""

    parents = frozenset({"Global"})

    @property
    def is_bw(self) -> bool:
        return torch._C._current_autograd_node() is not None

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModuleHooks:
        return self

    def __exit__(self, *exc) -> None:
        pass


@functools.cache
def _step_mem_tracker() -> type:
    """:class:`StepMemTracker`, defined on first use: importing ``MemTracker`` loads torch's
    distributed tools, inductor and dynamo (seconds), which ``plan`` and every other command that
    measures nothing should not wait for."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        """``MemTracker``'s accounting (every live storage of a device counted once, freed when its
        last reference goes, storage resizes followed, optimizer state by the optimizer's hooks)
        without its module hooks."""

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = _NoModuleHooks()

    return StepMemTracker


def __getattr__(name: str) -> Any:
    if name == "StepMemTracker":
        return _step_mem_tracker()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# MemTracker's categories -> ours (parameters and buffers, optimizer state, what forward allocated,
# what backward allocated: gradients and temporaries)
_CATEGORIES = {"Parameter": "parameters", "Buffer": "parameters", "Optstate": "optimizer",
               "Activation": "activations", "Gradient": "gradients", "Temp": "gradients",
               "Other": "optimizer"}  # the only "other" tensors given are fp32 master weights


def measured_peak(run_step: Callable[[], Any], stage: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  device: str | torch.device = "cpu", extra: Iterable[torch.Tensor] = (),
                  held: Iterable[torch.Tensor] = ()) -> MemoryBreakdown:
    """Peak memory of one real step (``run_step``: gradients and the optimizer update) of a model
    whose optimizer state already exists. CUDA: the allocator's peak over the step; CPU: the
    largest total of live tensor storages on the device, by ``MemTracker``, which sees only what
    exists before the step if it is the stage's, the optimizer's state, in ``extra`` (fp32 master
    weights: the optimizer's parameters, not the stage's) or in ``held`` (what the step keeps
    between steps and no module owns: a pipeline's receive buffers, counted as activations; the
    allocator sees them by itself)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        torch.cuda.synchronize(device)
        # allocated: what the step's tensors needed (the figure the budget and the cost model speak
        # of); reserved: what the device had to hold for them, fragmentation included
        return MemoryBreakdown(total=torch.cuda.max_memory_allocated(device),
                               reserved=torch.cuda.max_memory_reserved(device))
    held = _distinct_storages(held)
    tracker = _step_mem_tracker()()
    tracker.track_external(stage, optimizer, *extra, *held)
    with tracker:
        run_step()
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    out = MemoryBreakdown(total=snapshot.get("Total", 0))
    for kind, nbytes in snapshot.items():
        category = _CATEGORIES.get(getattr(kind, "value", str(kind)))
        if category:
            setattr(out, category, getattr(out, category) + nbytes)
    # MemTracker files the held tensors under "other", with the master weights; alive all step,
    # they are in the peak whatever its moment: moved to the activations they were received as
    moved = sum(t.untyped_storage().nbytes() for t in held)
    out.optimizer -= moved
    out.activations += moved
    return out


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage (views of one buffer count once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr() or id(t.untyped_storage()), t)
    return list(seen.values())
