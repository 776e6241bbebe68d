"""Measured ground truth: step times and the peak memory of real training steps, per rank.

Memory is measured by tools the predictions never use, so that a fault in the prediction's own
tracker (:mod:`._tracker`, which exact mode runs on fake tensors) cannot hide in its tests: on
CUDA the caching allocator's ``max_memory_allocated``; on CPU torch's own
``torch.distributed._tools.mem_tracker.MemTracker`` (every live tensor storage on the device).

Time is taken on ordinary steps, memory on dedicated steps (tracking every tensor slows a step
several-fold), after a warm-up step that creates the optimizer state. When a real step's buffers
go depends a little on gloo's threads: they drop their reference to a collective's buffer a moment
after the collective returns, so a peak may hold one such buffer (at most one micro-batch's hidden
state) that the next step's does not. The smallest peak of the tracked steps is the figure kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from ..data import synthetic_batch
from ..runtime import default_optimizer
from ..template import Workload
from ._tracker import MemoryBreakdown


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


class StepMemTracker(MemTracker):
    """``MemTracker``'s accounting (every live storage of a device counted once, freed when its
    last reference goes, storage resizes followed, optimizer state by the optimizer's hooks)
    without its module hooks."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModuleHooks()


# MemTracker's categories -> ours (parameters and buffers, optimizer state, what forward allocated,
# what backward allocated: gradients and temporaries)
_CATEGORIES = {"Parameter": "parameters", "Buffer": "parameters", "Optstate": "optimizer",
               "Activation": "activations", "Gradient": "gradients", "Temp": "gradients"}


def measured_peak(run_step: Callable[[], Any], stage: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  device: str | torch.device = "cpu") -> MemoryBreakdown:
    """Peak memory of one real step (``run_step``: gradients and the optimizer update) of a model
    whose optimizer state already exists. CUDA: the allocator's peak over the step; CPU: the
    largest total of live tensor storages on the device, by ``MemTracker``."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        torch.cuda.synchronize(device)
        return MemoryBreakdown(total=torch.cuda.max_memory_allocated(device))
    tracker = StepMemTracker()
    tracker.track_external(stage, optimizer)
    with tracker:
        run_step()
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    out = MemoryBreakdown(total=snapshot.get("Total", 0))
    for kind, nbytes in snapshot.items():
        category = _CATEGORIES.get(getattr(kind, "value", str(kind)))
        if category:
            setattr(out, category, getattr(out, category) + nbytes)
    return out


def measure_point_rank(ctx, spec, template_name: str, point: Mapping[str, Any], workload: Workload,
                       timed_steps: int = 3, warmup_steps: int = 1, seed: int = 0,
                       tracked_steps: int = 2) -> dict[str, Any]:
    """Rank function: warm-up, timed steps (each with its optimizer update), then memory steps."""
    from search_spaces import load_template

    from ..realize import realize

    torch.manual_seed(seed)
    run = realize(spec, load_template(template_name), point, workload, seed=seed, device=ctx.device)
    optimizer = default_optimizer(run.stage.parameters())
    batch = synthetic_batch(run.stage.model.config.vocab_size, workload.global_batch, workload.seq_len, seed)

    def step() -> float:
        loss = run.step(batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    losses, times = [], []
    for i in range(warmup_steps + timed_steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        if i >= warmup_steps:
            times.append(time.perf_counter() - t0)
    result = {"rank": ctx.rank, "stage": run.stage.info.index, "step_times": times, "losses": losses}
    if tracked_steps:
        peaks = [measured_peak(step, run.stage, optimizer, ctx.device) for _ in range(tracked_steps)]
        result.update(min(peaks, key=lambda b: b.total).as_dict())
    return result


def measure_points_rank(ctx, spec, template_name: str, points: list[Mapping[str, Any]], workload: Workload,
                        timed_steps: int = 3, tracked_steps: int = 2) -> list[dict[str, Any]]:
    """Many points in one launch (ranks start once)."""
    out = []
    for point in points:
        out.append(measure_point_rank(ctx, spec, template_name, point, workload, timed_steps,
                                      tracked_steps=tracked_steps))
        dist.barrier()
    return out
