"""One rank's run of one plan: the single path from a problem and a plan to training steps.

A :class:`Session` builds the model on the meta device, schedules it with the problem's template,
keeps this rank's pipeline stage, materialises it, and owns everything a step needs: the device,
the precision (:mod:`slapo_tune.precision`), the optimizer, the
:class:`~slapo_tune.runtime.TrainStep` (micro-batching, pipeline, gradient synchronisation), step
timing, the measured peak memory and checkpoints. Trials, the cost model's measurements and exact
mode, ``verify`` and ``slapo-tune train`` all run their steps through it, so a schedule trains
exactly as it was measured.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint
from .data import synthetic_batch
from .launch import run_queue_wait
from .memory import MemoryBreakdown, measured_peak
from .plan import Plan
from .problem import Problem
from .runtime import TrainStep, default_optimizer
from .schedule._build import build
from .topology import Topology, init_topology

WAIT_LIMIT = 0.05  # run-queue wait / step time above which a timed step is measured again


class MemoryBudgetExceeded(RuntimeError):
    """A rank's measured peak is above the memory budget (the CPU stand-in for CUDA OOM)."""


@dataclass
class Measurement:
    """What :meth:`Session.measure` saw on this rank."""

    peak: MemoryBreakdown  # the smallest peak of the tracked steps
    times: list[float] = field(default_factory=list)  # the kept timed steps, seconds
    waits: list[float] = field(default_factory=list)  # run-queue wait / step time of each kept step
    remeasured: int = 0  # timed steps thrown away because the rank waited for a core
    losses: list[float] = field(default_factory=list)  # every step's loss (warm-up, memory, timed)


class Session:
    """This rank's stage of ``plan`` for ``problem``, ready to train. All ranks of the world create
    it together (it creates the process groups unless ``topology`` is given).

    ``model`` is an already built instance of the problem's model whose real weights are kept
    (sliced where sharded); by default the model is built on the meta device and initialised from
    ``seed``. ``lr`` is the optimizer's learning rate (the optimizer is
    :func:`~slapo_tune.runtime.default_optimizer` everywhere).
    """

    def __init__(self, problem: Problem, plan: Plan, *, device: str | torch.device | None = None, seed: int = 0,
                 model: torch.nn.Module | None = None, topology: Topology | None = None, lr: float | None = None):
        self.problem, self.plan, self.seed = problem, plan, seed
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.topology = topology or init_topology(pp=plan.pp, tp=plan.tp, cp=plan.cp, device_type=self.device.type)
        if model is None:
            model = problem.model.build("meta")
        schedule = problem.template.schedule(model, plan, self.topology)
        precision = problem.workload.precision
        self.stage = build(schedule, topology=self.topology, zero=plan.zero, seed=seed, device=device,
                           precision=precision)
        self.step = TrainStep(self.stage, n_microbatches=plan.accumulation, schedule=plan.pipeline_schedule,
                              precision=precision)
        self.optimizer = default_optimizer(self.trained_parameters().values(),
                                           **({} if lr is None else {"lr": lr}))

    def trained_parameters(self) -> dict[str, torch.Tensor]:
        """The tensors the optimizer steps, by the stage's parameter names: the parameters themselves,
        or their fp32 master copies (``bf16`` precision on replicated parameters)."""
        return {name: self.step.stepped_tensor(p) for name, p in self.stage.named_parameters()}

    @property
    def accumulation(self) -> int:
        return self.plan.accumulation

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def synthetic_batch(self, seed: int | None = None) -> dict[str, torch.Tensor]:
        """A global batch of the problem's shape (the same on every rank for the same seed)."""
        w = self.problem.workload
        return synthetic_batch(self.stage.model.config.vocab_size, w.global_batch, w.seq_len,
                               self.seed if seed is None else seed)

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One optimizer step on the global batch; returns the mean loss as a one-element tensor
        (no host synchronisation)."""
        loss = self.step.run(batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage.master is not None:
            self.stage.master.publish()
        return loss

    def micro_batches(self, batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of a global batch, for a loop of your own that calls the model
        (``stage(**micro_batch)``; see :meth:`slapo_tune.runtime.TrainStep.micro_batches`)."""
        return self.step.micro_batches(batch)

    def timed_step(self, batch: Mapping[str, torch.Tensor]) -> tuple[float, float, float]:
        """One step started together on every rank: (loss, seconds, seconds this rank's threads
        waited for a core)."""
        dist.barrier()
        waited, started = run_queue_wait(), time.perf_counter()
        loss = float(self.train_step(batch))  # reading the loss waits for the step to finish
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return loss, time.perf_counter() - started, run_queue_wait() - waited

    def peak_memory(self, batch: Mapping[str, torch.Tensor]) -> tuple[MemoryBreakdown, float]:
        """(peak, loss) of one step measured by :func:`slapo_tune.memory.measured_peak`; call after
        a first step (it creates the optimizer state)."""
        losses: list[torch.Tensor] = []
        peak = measured_peak(lambda: losses.append(self.train_step(batch)), self.stage, self.optimizer,
                             self.device, extra=self.step.masters(),
                             held=self.step.held_buffers())
        return peak, float(losses[0])

    def measure(self, batch: Mapping[str, torch.Tensor], *, warmup_steps: int = 1, timed_steps: int = 3,
                tracked_steps: int = 1, memory_budget: int | None = None) -> Measurement:
        """Warm-up steps (not measured), then memory on dedicated steps (tracking every tensor slows
        a step several-fold, so they are never timed), then the timed steps.

        Memory comes first so that a point over ``memory_budget`` stops before any timing: every
        rank compares the worst rank's peak and raises :class:`MemoryBudgetExceeded` together. When
        a real step's buffers go depends a little on gloo's threads (they drop a collective's buffer
        a moment after it returns), so the smallest peak of ``tracked_steps`` steps is kept. A timed
        step during which the rank waited for a core more than :data:`WAIT_LIMIT` of it is measured
        again, on every rank (at most ``timed_steps`` times in all).
        """
        losses = [float(self.train_step(batch)) for _ in range(warmup_steps)]
        peaks = []
        for _ in range(tracked_steps):
            peak, loss = self.peak_memory(batch)
            peaks.append(peak)
            losses.append(loss)
        result = Measurement(min(peaks, key=lambda b: b.total) if peaks else MemoryBreakdown(total=0))
        if memory_budget:
            worst = torch.tensor([result.peak.total], dtype=torch.long, device=self.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if int(worst.item()) > memory_budget:
                raise MemoryBudgetExceeded(f"peak {int(worst.item())} bytes > budget {memory_budget} bytes "
                                           f"(this rank: {result.peak.total})")
        while len(result.times) < timed_steps:
            loss, seconds, waited = self.timed_step(batch)
            losses.append(loss)
            # every rank must run the same steps (each one's collectives wait for the others), so a
            # step is measured again on all ranks when any of them waited
            busy = torch.tensor([int(waited > WAIT_LIMIT * seconds)], device=self.device)
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)
            if busy.item() and result.remeasured < timed_steps:
                result.remeasured += 1  # the machine was busy: this step says little about the schedule
                continue
            result.times.append(seconds)
            result.waits.append(waited / seconds if seconds else 0.0)
        result.losses = losses
        return result

    # ------------------------------------------------------------------ checkpoints
    def save(self, root: str | Path, step: int, meta: dict[str, Any], keep: int = 2) -> Path:
        """This rank's shard of a checkpoint (every rank calls it; see :mod:`slapo_tune.checkpoint`)."""
        return checkpoint.save_checkpoint(root, step, self.trained_parameters(), self.optimizer, dist.get_rank(),
                                          meta, keep)

    def restore(self, folder: Path) -> dict[str, Any]:
        """Load this rank's shard of a checkpoint in place; returns the checkpoint's metadata."""
        meta = checkpoint.load_checkpoint(folder, self.trained_parameters(), self.optimizer, dist.get_rank())
        if self.stage.master is not None:
            self.stage.master.publish()
        return meta
