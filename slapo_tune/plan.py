"""A schedule point as one typed, validated, frozen object, and the statuses a point can end in.

A :class:`Plan` is what a template's point *means*: the layout (``tp``, ``pp``, ``dp``, ``zero``),
the micro-batch size and the accumulation count that follows from it, and the other knobs.
Plans are made in one place, :meth:`Plan.of` (through :meth:`slapo_tune.problem.Problem.plan`),
which is also the one place a micro-batch size becomes an accumulation count. A plan reads like
the knob mapping it came from (``plan["tp"]``, ``dict(plan)``), so plain dicts are needed only
where points cross into Optuna or a file.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError
from .precision import Precision, precision


@dataclass(frozen=True)
class Workload:
    """What is trained: world size, the fixed global batch, the sequence length and the precision
    (a name in :data:`slapo_tune.precision.PRECISIONS`)."""

    world_size: int
    global_batch: int
    seq_len: int = 128
    precision: str = "fp32"

    @property
    def mode(self) -> Precision:
        """The precision's dtypes and rules (the one place its name becomes them)."""
        return precision(self.precision)


def accumulation(workload: Workload, dp: int, micro_batch: int) -> int:
    """Micro-batches per optimizer step on each data-parallel replica: the one place a micro-batch
    size becomes an accumulation count (the global batch is held fixed:
    ``global_batch = dp x micro_batch x accumulation``)."""
    return workload.global_batch // (dp * micro_batch)


# The knobs every template offers, in the order templates apply them, with the short names shown
# where space is tight (Ray actor names, plots). A template's own knobs follow them.
KNOBS = ("tp", "pp", "cp", "sp", "dp", "zero", "micro_batch", "ckpt_ratio", "ckpt_policy", "pipeline_schedule", "vpp",
         "loss_parallel", "attn", "fuse")
# the schedule users start from without a tuner (Slapo's baselines, what DeepSpeed/Megatron users
# run): pure data parallelism, full activation checkpointing, micro-batch 1; other knobs at their first legal value
OUT_OF_THE_BOX = {"tp": 1, "pp": 1, "ckpt_ratio": 1.0, "micro_batch": 1}
# where a knob does nothing its space offers one value (template.space): shown as "-" there
IDLE_WHERE = {"pipeline_schedule": ("pp", 1), "vpp": ("pp", 1), "zero": ("dp", 1), "sp": ("tp", 1),
              "loss_parallel": ("tp", 1), "ckpt_policy": ("ckpt_ratio", 0.0)}
SHORT_NAMES = {"micro_batch": "mb", "ckpt_ratio": "ckpt", "ckpt_policy": "ckpt_by", "pipeline_schedule": "sched"}
# Knobs added after schedules were first written: a point without them (an older schedule file, a
# recorded grid) means what it always meant.
KNOB_DEFAULTS = {"cp": 1, "sp": "off", "loss_parallel": "off", "ckpt_policy": "full", "vpp": 1}


def knob_value(point: Mapping[str, Any], name: str) -> Any:
    """``point[name]``, or what a point without that knob means (:data:`KNOB_DEFAULTS`)."""
    return point[name] if name in point else KNOB_DEFAULTS[name]


def short_name(point: Mapping[str, Any]) -> str:
    """``tp=2 pp=1 dp=2 zero=0 mb=4 ckpt=0.5 ...``: a point in one readable line (Ray actor names,
    plots); the knobs added since names were first given show only when they are not off."""
    return " ".join(f"{SHORT_NAMES.get(k, k)}={v}" for k, v in point.items()
                    if k not in KNOB_DEFAULTS or v != KNOB_DEFAULTS[k])


def is_idle(point: Mapping[str, Any], knob: str) -> bool:
    """Whether ``knob`` does nothing at ``point`` (:data:`IDLE_WHERE`: the pipeline schedule at ``pp=1``)."""
    return knob in IDLE_WHERE and point.get(IDLE_WHERE[knob][0]) == IDLE_WHERE[knob][1]


def readable(point: Mapping[str, Any], shown: Sequence[str] | None = None) -> str:
    """``tp=2 pp=1 mb=4``: the knobs of ``point`` in ``shown`` (all when None; the CLI and the
    report pass those the space varies), less those that do nothing there (:func:`is_idle`)."""
    return " ".join(f"{SHORT_NAMES.get(k, k)}={v}" for k, v in point.items()
                    if (shown is None or k in shown) and not is_idle(point, k))


@dataclass(frozen=True, eq=False)  # equal as mappings: a plan equals its knob dict
class Plan(Mapping[str, Any]):
    """A complete, legal schedule point for one workload (see the module docstring)."""

    tp: int
    pp: int
    cp: int  # context-parallel degree: each sequence split over cp ranks (attention all-gathers K, V)
    sp: str  # sequence parallelism over the tensor-parallel group: "off" or "on"
    loss_parallel: str  # the LM head's logits stay sharded over the vocabulary, loss across the tp group
    dp: int
    zero: int
    micro_batch: int
    accumulation: int  # micro-batches per optimizer step on each data-parallel replica
    ckpt_ratio: float
    ckpt_policy: str  # what a checkpointed block recomputes: "full" or "selective"
    pipeline_schedule: str
    vpp: int  # virtual pipeline stages per rank (interleaved schedule when > 1)
    attn: str
    fuse: str
    extra: Mapping[str, Any] = field(default_factory=dict)  # a template's own knobs, in its order

    @classmethod
    def of(cls, point: Mapping[str, Any], workload: Workload) -> Plan:
        """The plan of a complete point (legality is the space's business: see
        :meth:`slapo_tune.problem.Problem.plan`); checks that the batch sizes multiply up."""
        point = {**KNOB_DEFAULTS, **point}
        missing = [k for k in KNOBS if k not in point]
        if missing:
            raise UsageError(f"a schedule point needs the knobs {', '.join(missing)}")
        dp, micro_batch = point["dp"], point["micro_batch"]
        per_step = dp * micro_batch
        if per_step < 1 or workload.global_batch % per_step:
            raise UsageError(f"global batch {workload.global_batch} is not divisible by dp x micro_batch = "
                             f"{dp} x {micro_batch}")
        if point["tp"] * point["cp"] * point["pp"] * dp != workload.world_size:
            cp = f" x cp={point['cp']}" if point["cp"] > 1 else ""
            raise UsageError(f"tp x pp x dp = {point['tp']} x {point['pp']} x {dp}{cp} is not the world size "
                             f"{workload.world_size}")
        extra = {k: v for k, v in point.items() if k not in KNOBS}
        return cls(**{k: point[k] for k in KNOBS}, accumulation=accumulation(workload, dp, micro_batch), extra=extra)

    # --------------------------------------------------------------- the knob mapping
    def __getitem__(self, name: str) -> Any:
        if name in KNOBS:
            return getattr(self, name)
        return self.extra[name]

    def __iter__(self) -> Iterator[str]:
        yield from KNOBS
        yield from self.extra

    def __len__(self) -> int:
        return len(KNOBS) + len(self.extra)

    def __hash__(self) -> int:  # Mapping sets __hash__ to None; a plan is a value
        return hash(tuple(self.items()))

    def knobs(self) -> dict[str, Any]:
        """The knob values as a plain dict, in knob order (for Optuna and files)."""
        return dict(self.items())

    @property
    def short(self) -> str:
        """``tp=2 pp=1 dp=2 zero=0 mb=4 ckpt=0.5 ...``: a readable one-line name."""
        return short_name(self)

    @property
    def local_batch(self) -> int:
        """Samples per optimizer step on one data-parallel replica."""
        return self.micro_batch * self.accumulation


class TrialStatus(str, enum.Enum):
    """How a point's trial ended (stored in the study as its value, so it stays a ``str``)."""

    OK = "ok"  # measured
    OOM = "oom"  # measured above the memory budget (or the allocator ran out)
    TIMEOUT = "timeout"  # killed at the trial's time limit
    CRASH = "crash"  # a rank failed: the schedule itself (its error, or its process died)
    INVALID = "invalid"  # the knobs are not a legal point
    PRUNED = "pruned"  # the cost model says it cannot fit: never launched
    DUPLICATE = "duplicate"  # asked again: answered from the study, never launched
    INTERRUPTED = "interrupted"  # in flight when the driver was killed: queued again
    # infrastructure failures: the cluster failed, not the schedule, so nothing was learnt about the
    # point; the point is queued again once (see ``infrastructure``)
    LOST = "lost"  # a node or a rank actor went away mid-trial (node died, preempted, unreachable)
    PLACEMENT_TIMEOUT = "placement_timeout"  # the cluster could not place the trial's ranks in time

    def __str__(self) -> str:
        return self.value

    @property
    def launched(self) -> bool:
        """A runner ran it to an outcome of the schedule's own (whatever came of it): a trial of the
        budget spent. An infrastructure failure is not one."""
        return self in (TrialStatus.OK, TrialStatus.OOM, TrialStatus.CRASH, TrialStatus.TIMEOUT)

    @property
    def infrastructure(self) -> bool:
        """The cluster failed (not the schedule): retried once, later in the study or on resume;
        neither infeasible nor a crash of the point."""
        return self in (TrialStatus.LOST, TrialStatus.PLACEMENT_TIMEOUT)

    @property
    def failed(self) -> bool:
        """Launched, and nothing was learnt about the point's memory or speed."""
        return self in (TrialStatus.CRASH, TrialStatus.TIMEOUT)

    @property
    def infeasible(self) -> bool:
        """Does not fit the memory budget (measured or predicted)."""
        return self in (TrialStatus.OOM, TrialStatus.PRUNED)
