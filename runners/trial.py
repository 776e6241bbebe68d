"""What a trial is: its spec, what each rank measures, and the result the driver gets back.

A trial trains one schedule point for a few steps on ``world_size`` ranks through
:meth:`slapo_tune.session.Session.measure`: warm-up steps (not measured), one memory step (never
timed; measured by :func:`slapo_tune.memory.measured_peak`, a tool the cost model's predictions do
not use; a point over the budget stops there), then the measured steps, each re-measured when the
rank waited for a core, so outside load on a shared machine shows up as a flag instead of a wrong
number.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from slapo_tune.launch import OOM_TYPES, peak_rss_bytes, usable_cores
from slapo_tune.plan import TrialStatus
from slapo_tune.problem import ProblemSpec
from slapo_tune.session import WAIT_LIMIT, Session

SPREAD_LIMIT = 0.25  # (p75 - p25) / median above which a trial's timing is flagged


@dataclass
class TrialSpec:
    """One trial: a problem (model, template, workload, device, memory budget), the knobs of a
    schedule point, and how long to train it.

    ``knobs`` may be partial: the template completes them with defaults (and refuses illegal
    ones: status ``invalid``).
    """

    problem: ProblemSpec
    knobs: dict[str, Any]
    warmup_steps: int = 1
    measured_steps: int = 3
    time_limit: float = 300.0
    seed: int = 0
    name: str = "trial"
    # 0: a trial of the search; k > 0: the k-th round of measuring a finished trial's point again
    # (the tuner's confirmation before crowning), run exactly as a trial
    confirm_round: int = 0

    @property
    def world_size(self) -> int:
        return self.problem.world_size

    @property
    def device(self) -> str:
        return self.problem.device

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrialResult:
    """What a trial measured (or why it has no measurement)."""

    status: TrialStatus
    knobs: dict[str, Any]
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_times: list[float] = field(default_factory=list)  # measured steps, slowest rank per step
    step_p25: float | None = None
    step_p75: float | None = None
    spread: float | None = None  # (p75 - p25) / median step time
    peak_memory: list[int] = field(default_factory=list)  # tensor-level peak per rank (bytes)
    # CUDA: the caching allocator's peak reserved bytes per rank (what the device had to hold:
    # the allocated peak plus fragmentation); 0 on CPU, which has no caching allocator
    peak_reserved: list[int] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)  # process peak RSS per rank (bytes)
    losses: list[float] = field(default_factory=list)  # rank 0's view of the last stage's losses
    wait_fraction: float | None = None  # worst run-queue wait / step time of the kept steps
    rank_cores: list[list[int]] = field(default_factory=list)  # the cores each rank could run on
    # where each rank ran: ``HOST:DEVICE`` (local), ``ADDRESS/NODE:DEVICE`` (Ray: a node's address,
    # the first 8 hex digits of its id, ``cpu`` or ``gpuN`` by the node's GPU ids)
    nodes: list[str] = field(default_factory=list)
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


# ---------------------------------------------------------------------------- per-rank measurement
def trial_rank(ctx, spec: TrialSpec, point: dict[str, Any]) -> dict[str, Any]:
    """Rank function of a trial (run under :func:`slapo_tune.launch.launch` or a Ray rank actor)."""
    import torch

    started = time.time()
    budget = spec.problem.memory_budget
    if torch.device(ctx.device).type == "cuda" and budget:
        # the allocator refuses to reserve beyond the budget: a point that needs more raises
        # torch.OutOfMemoryError on the rank that hit it (a trial status ``oom``), as on a device of
        # that size, instead of running on in the memory the budget leaves to the reserve
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), ctx.device)
    problem = spec.problem.resolve()
    torch.manual_seed(spec.seed)
    session = Session(problem, problem.plan(point), seed=spec.seed, device=ctx.device)
    measured = session.measure(session.synthetic_batch(), warmup_steps=spec.warmup_steps,
                               timed_steps=spec.measured_steps, tracked_steps=1, memory_budget=budget)
    bad = [x for x in measured.losses if not math.isfinite(x)]
    if bad:
        raise FloatingPointError(f"non-finite loss {bad[0]} on rank {ctx.rank}")
    return {"rank": ctx.rank, "stage": session.stage.info.index, "is_last": session.stage.info.is_last,
            "times": measured.times, "waits": measured.waits, "remeasured": measured.remeasured,
            "peak": measured.peak.total, "reserved": measured.peak.reserved, "rss": peak_rss_bytes(),
            "losses": measured.losses, "started": started, "finished": time.time(), "cores": usable_cores(),
            "node": f"{socket.gethostname()}:{_device_name(ctx.device)}"}


def _device_name(device) -> str:
    """``cpu``, or ``gpuN`` by the GPU's index on its host (a local rank sees its own GPU alone, as
    ``cuda:0``: its CUDA_VISIBLE_DEVICES names it)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = device.index or 0
    return f"gpu{visible[index] if index < len(visible) else index}"


# ---------------------------------------------------------------------------- driver side
def step_figures(steps: list[float]) -> tuple[float, float, float, float]:
    """(median, p25, p75, spread) of step times, the spread being (p75 - p25) / median."""
    median = statistics.median(steps)
    if len(steps) >= 2:
        q = statistics.quantiles(steps, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = median
    return median, p25, p75, (p75 - p25) / median if median else 0.0


def summarize(spec: TrialSpec, point: dict[str, Any], per_rank: list[dict[str, Any]], wall: float,
              runner: str) -> TrialResult:
    """Combine the ranks' reports: a step lasts as long as its slowest rank."""
    steps = [max(r["times"][i] for r in per_rank) for i in range(spec.measured_steps)]
    median, p25, p75, spread = step_figures(steps)
    wait = max(max(r["waits"]) for r in per_rank)
    warnings = []
    if spread > SPREAD_LIMIT:
        warnings.append(f"step times spread {spread:.0%} around the median: measurement unreliable")
    if wait > WAIT_LIMIT:
        warnings.append(f"threads waited {wait:.0%} of a step for a core: the machine was busy")
    remeasured = max(r["remeasured"] for r in per_rank)  # the ranks re-measure together
    if remeasured:
        warnings.append(f"{remeasured} step(s) re-measured after waiting for a core")
    last = next(r for r in per_rank if r["is_last"])
    return TrialResult(
        status=TrialStatus.OK, knobs=point, samples_per_s=spec.problem.global_batch / median,
        tokens_per_s=spec.problem.global_batch * spec.problem.seq_len / median, step_times=steps, step_p25=p25, step_p75=p75,
        spread=spread, peak_memory=[r["peak"] for r in per_rank], peak_reserved=[r["reserved"] for r in per_rank],
        peak_rss=[r["rss"] for r in per_rank],
        losses=last["losses"], wait_fraction=wait, rank_cores=[r["cores"] for r in per_rank],
        nodes=[r.get("node", "") for r in per_rank],
        warnings=warnings, wall_seconds=wall,
        train_seconds=max(r["finished"] for r in per_rank) - min(r["started"] for r in per_rank), runner=runner,
    )


def failure(spec: TrialSpec, point: dict[str, Any], status: TrialStatus, message: str, wall: float, runner: str, *,
            rank: int | None = None, exc_type: str = "", details: str = "") -> TrialResult:
    """A trial without measurements: status, the one-line reason, and where it happened."""
    if status == TrialStatus.CRASH and exc_type in OOM_TYPES:
        status = TrialStatus.OOM
    tail = "\n".join(details.strip().splitlines()[-6:]) if details else ""
    return TrialResult(status=TrialStatus(status), knobs=point, error=message.splitlines()[0] if message else str(status),
                       error_type=exc_type, error_rank=rank, error_tail=tail, wall_seconds=wall, runner=runner)


def resolve(spec: TrialSpec) -> tuple[TrialSpec, dict[str, Any]]:
    """``spec`` with its problem's defaults filled in, and the complete, legal point for its knobs;
    raises UsageError when they are not legal."""
    problem = spec.problem.resolve()
    return replace(spec, problem=problem.spec), problem.plan(spec.knobs).knobs()
