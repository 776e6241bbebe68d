"""What a trial is: its spec, what each rank measures, and the result the driver gets back.

A trial trains one schedule point for a few steps on ``world_size`` ranks: warm-up steps (not
measured), one memory step (tracking every tensor slows a step several-fold, so it is never
timed; measured by :func:`slapo_tune.cost_model.measure.measured_peak`, a tool the cost model's
predictions do not use), then the measured steps. Each measured step records how long the rank's
threads waited for a core; a step that waited more than :data:`WAIT_LIMIT` of its time is
measured again (once per step), so outside load on a shared machine shows up as a flag instead of
a wrong number.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("ok", "oom", "timeout", "crash", "invalid")
WAIT_LIMIT = 0.05  # run-queue wait / step time above which a step is re-measured
SPREAD_LIMIT = 0.25  # (p75 - p25) / median above which a trial's timing is flagged


@dataclass
class TrialSpec:
    """One trial: a model, a schedule point and the workload to time it on.

    ``knobs`` may be partial: the template completes them with defaults (and refuses illegal
    ones: status ``invalid``). ``memory_budget`` is bytes per rank (None: unlimited).
    """

    model: str
    knobs: dict[str, Any]
    world_size: int
    global_batch: int
    seq_len: int = 128
    dtype: str = "fp32"
    memory_budget: int | None = None
    template: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = 1
    measured_steps: int = 3
    time_limit: float = 300.0
    device: str = "cpu"
    seed: int = 0
    name: str = "trial"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrialResult:
    """What a trial measured (or why it has no measurement)."""

    status: str
    knobs: dict[str, Any]
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_times: list[float] = field(default_factory=list)  # measured steps, slowest rank per step
    step_p25: float | None = None
    step_p75: float | None = None
    spread: float | None = None  # (p75 - p25) / median step time
    peak_memory: list[int] = field(default_factory=list)  # tensor-level peak per rank (bytes)
    peak_rss: list[int] = field(default_factory=list)  # process peak RSS per rank (bytes)
    losses: list[float] = field(default_factory=list)  # rank 0's view of the last stage's losses
    wait_fraction: float | None = None  # worst run-queue wait / step time of the kept steps
    rank_cores: list[list[int]] = field(default_factory=list)  # the cores each rank could run on
    warnings: list[str] = field(default_factory=list)
    error: str = ""  # one line: what failed
    error_type: str = ""
    error_rank: int | None = None
    error_tail: str = ""  # last lines of the failing rank's traceback
    wall_seconds: float = 0.0  # the whole trial as the driver saw it
    train_seconds: float = 0.0  # from the first rank's model build to the last rank's return
    runner: str = ""

    @property
    def overhead_seconds(self) -> float:
        """Starting ranks, rendezvous and teardown: the trial's cost beyond training itself."""
        return max(0.0, self.wall_seconds - self.train_seconds)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "overhead_seconds": self.overhead_seconds}


class MemoryBudgetExceeded(RuntimeError):
    """A rank's measured peak is above the trial's memory budget (the CPU stand-in for CUDA OOM)."""


# ---------------------------------------------------------------------------- per-rank measurement
def run_queue_wait() -> float:
    """Seconds this process's threads have spent runnable but waiting for a core, so far."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except FileNotFoundError:  # not Linux: no figure, never a flag
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux: ``VmHWM``, the high-water mark of the process's
    own memory map; ``ru_maxrss`` would do elsewhere, but on Linux it survives ``exec`` and a rank
    spawned by a large launcher reports the launcher's peak (seen: two trials, one leaking 128 MiB
    per rank, both reporting the test runner's 665 MiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trial_rank(ctx, spec: TrialSpec, point: dict[str, Any]) -> dict[str, Any]:
    """Rank function of a trial (run under :func:`slapo_tune.launch.launch` or a Ray rank actor)."""
    import torch
    import torch.distributed as dist

    from search_spaces import load_template, template_for
    from slapo_tune.cost_model.measure import measured_peak
    from slapo_tune.data import synthetic_batch
    from slapo_tune.launch import usable_cores
    from slapo_tune.realize import ModelSpec, realize
    from slapo_tune.runtime import default_optimizer
    from slapo_tune.template import Workload

    started = time.time()
    cuda = ctx.device.startswith("cuda")
    if cuda and spec.memory_budget:
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec.memory_budget / total), ctx.device)
    model_spec = ModelSpec(spec.model, dict(spec.model_overrides))
    template = load_template(spec.template) if spec.template else template_for(model_spec.config())
    workload = Workload(spec.world_size, spec.global_batch, spec.seq_len, spec.dtype)
    torch.manual_seed(spec.seed)
    run = realize(model_spec, template, point, workload, seed=spec.seed, device=ctx.device)
    optimizer = default_optimizer(run.stage.parameters())
    batch = synthetic_batch(run.stage.model.config.vocab_size, spec.global_batch, spec.seq_len, spec.seed)
    losses: list[float] = []

    def step() -> None:
        loss = run.step.run(batch)  # under autocast for 16-bit dtypes
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if loss is not None:
            losses.append(float(loss))

    for _ in range(spec.warmup_steps):
        step()
    # memory: one dedicated step, before any timing (an infeasible point stops here)
    peak = measured_peak(step, run.stage, optimizer, ctx.device).total
    if spec.memory_budget:  # every rank decides on the worst rank's peak, so all stop together
        worst = torch.tensor([peak], dtype=torch.long, device=ctx.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if int(worst.item()) > spec.memory_budget:
            raise MemoryBudgetExceeded(f"peak {int(worst.item())} bytes > budget {spec.memory_budget} bytes "
                                       f"(this rank: {peak})")

    times, waits, remeasured = [], [], 0
    while len(times) < spec.measured_steps:
        dist.barrier()
        w0, t0 = run_queue_wait(), time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        elapsed, waited = time.perf_counter() - t0, run_queue_wait() - w0
        if waited > WAIT_LIMIT * elapsed and remeasured < spec.measured_steps:
            remeasured += 1  # the machine was busy: this step says little about the schedule
            continue
        times.append(elapsed)
        waits.append(waited / elapsed if elapsed else 0.0)
    bad = [x for x in losses if not math.isfinite(x)]
    if bad:
        raise FloatingPointError(f"non-finite loss {bad[0]} on rank {ctx.rank}")
    return {"rank": ctx.rank, "stage": run.stage.info.index, "is_last": run.stage.info.is_last,
            "times": times, "waits": waits, "remeasured": remeasured, "peak": peak,
            "rss": peak_rss_bytes(), "losses": losses, "started": started, "finished": time.time(),
            "cores": usable_cores()}


# ---------------------------------------------------------------------------- driver side
def summarize(spec: TrialSpec, point: dict[str, Any], per_rank: list[dict[str, Any]], wall: float,
              runner: str) -> TrialResult:
    """Combine the ranks' reports: a step lasts as long as its slowest rank."""
    steps = [max(r["times"][i] for r in per_rank) for i in range(spec.measured_steps)]
    median = statistics.median(steps)
    if len(steps) >= 2:
        q = statistics.quantiles(steps, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = median
    spread = (p75 - p25) / median if median else 0.0
    wait = max(max(r["waits"]) for r in per_rank)
    warnings = []
    if spread > SPREAD_LIMIT:
        warnings.append(f"step times spread {spread:.0%} around the median: measurement unreliable")
    if wait > WAIT_LIMIT:
        warnings.append(f"threads waited {wait:.0%} of a step for a core: the machine was busy")
    remeasured = sum(r["remeasured"] for r in per_rank)
    if remeasured:
        warnings.append(f"{remeasured} step(s) re-measured after waiting for a core")
    last = next(r for r in per_rank if r["is_last"])
    return TrialResult(
        status="ok", knobs=point, samples_per_s=spec.global_batch / median,
        tokens_per_s=spec.global_batch * spec.seq_len / median, step_times=steps, step_p25=p25, step_p75=p75,
        spread=spread, peak_memory=[r["peak"] for r in per_rank], peak_rss=[r["rss"] for r in per_rank],
        losses=last["losses"], wait_fraction=wait, rank_cores=[r["cores"] for r in per_rank],
        warnings=warnings, wall_seconds=wall,
        train_seconds=max(r["finished"] for r in per_rank) - min(r["started"] for r in per_rank), runner=runner,
    )


OOM_TYPES = ("MemoryBudgetExceeded", "OutOfMemoryError")


def failure(spec: TrialSpec, point: dict[str, Any], status: str, message: str, wall: float, runner: str, *,
            rank: int | None = None, exc_type: str = "", details: str = "") -> TrialResult:
    """A trial without measurements: status, the one-line reason, and where it happened."""
    if status == "crash" and exc_type in OOM_TYPES:
        status = "oom"
    tail = "\n".join(details.strip().splitlines()[-6:]) if details else ""
    return TrialResult(status=status, knobs=point, error=message.splitlines()[0] if message else status,
                       error_type=exc_type, error_rank=rank, error_tail=tail, wall_seconds=wall, runner=runner)


def resolve_point(spec: TrialSpec) -> dict[str, Any]:
    """The complete, legal point for ``spec``'s knobs; raises UsageError when they are not legal."""
    from search_spaces import load_template, template_for
    from slapo_tune.realize import ModelSpec
    from slapo_tune.space import coerce
    from slapo_tune.template import ModelInfo, Workload

    config = ModelSpec(spec.model, dict(spec.model_overrides)).config()
    template = load_template(spec.template) if spec.template else template_for(config)
    space = template.space(ModelInfo.from_config(config), Workload(spec.world_size, spec.global_batch, spec.seq_len,
                                                                    spec.dtype))
    return space.complete(coerce(space, dict(spec.knobs)))
