"""Apply one parallelization technique at a time, from plans keyed by module path.

Each ``apply_*`` function uses only the public primitives of :class:`~slapo_tune.Schedule`; a
template says *what* (the plan for its model family) and these functions say *how*. The order
matters and is fixed by the caller: tensor parallelism first (it changes parameter shapes), then
activation checkpointing (it wraps the sharded forward), then pipeline cuts and data parallelism.

Plan keys are paths relative to the node the plan is applied to; ``*`` matches one path component
(``"h.*.attn.c_attn"``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ._schedule import Schedule
from ._sharding import rule_for
from .errors import ScheduleError


@dataclass(frozen=True)
class Colwise:
    """Shard the output features (weight and bias). The input gradient is partial, so it is
    all-reduced in backward; set ``reduce_input_grad=False`` when a parent reduces it once for
    several projections of the same input (Q, K and V). ``gather_output`` all-gathers the
    partitioned output (an LM head)."""

    num_fused: int = 1
    gather_output: bool = False
    reduce_input_grad: bool = True


@dataclass(frozen=True)
class ReduceInputGrad:
    """All-reduce the gradient of a module's input once, for all column-parallel layers inside it."""


@dataclass(frozen=True)
class Rowwise:
    """Shard the input features; the partial output is all-reduced, then the bias is added."""


@dataclass(frozen=True)
class VocabParallel:
    """Shard an embedding's vocabulary; the masked partial lookups are all-reduced."""


@dataclass(frozen=True)
class DivideAttr:
    """Divide plain attributes (head counts, split sizes) by the tensor-parallel size."""

    names: tuple[str, ...]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", names)


Style = Colwise | Rowwise | VocabParallel | DivideAttr | ReduceInputGrad


def glob_to_regex(pattern: str) -> str:
    """Plan-key glob (``*`` = one path component) as a regular expression."""
    return ".".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))


def select(sch: Schedule, pattern: str) -> list[Schedule]:
    """Nodes under ``sch`` matching a plan key; a key that matches nothing is an error."""
    nodes = sch.find(glob_to_regex(pattern)) if "*" in pattern else [sch[pattern]]
    if not nodes:
        raise ScheduleError(f"plan key '{pattern}' matches no module under '{sch.path or 'the model'}'")
    return nodes


def _output_axis(node: Schedule, param: str) -> int:
    rule = rule_for(node.mod)
    axis = rule.out_axis.get(param)
    if axis is None:
        raise ScheduleError(f"'{node.path}': {type(node.mod).__name__}.{param} has no output-feature axis")
    return axis


def _apply_style(node: Schedule, style: Style) -> None:
    if isinstance(style, Colwise):
        # a horizontally fused layer (QKV) is split block by block, whatever its style says
        num_fused = getattr(node.mod, "split_sizes", None) or style.num_fused
        for param in ("weight", "bias"):
            if getattr(node.mod, param, None) is not None and not node.is_sharded(param):
                node.shard(param, _output_axis(node, param), num_fused=num_fused)
        if style.reduce_input_grad:
            node.sync("bwd_post", "all_reduce")
        if style.gather_output:
            node.sync("fwd_post", "all_gather", axis=-1)
    elif isinstance(style, Rowwise):
        node.shard("weight", rule_for(node.mod).in_axis.get("weight", 1))
        node.sync("fwd_post", "all_reduce")
    elif isinstance(style, VocabParallel):
        if not node.is_sharded("weight"):
            node.shard("weight", 0)
        node.sync("fwd_post", "all_reduce")
    elif isinstance(style, ReduceInputGrad):
        node.sync("bwd_post", "all_reduce")
    elif isinstance(style, DivideAttr):
        for name in style.names:
            value = getattr(node.mod, name)
            if value % node.world_size:
                raise ScheduleError(f"'{node.path}'.{name} = {value} is not divisible by tp={node.world_size}")
            node.set_attr(name, value // node.world_size)
    else:
        raise ScheduleError(f"unknown tensor-parallel style {style!r}")


def apply_tensor_parallel(sch: Schedule, plan: Mapping[str, Style | Sequence[Style]]) -> None:
    """Megatron-style tensor parallelism over ``sch.group`` from a ``{path: style}`` plan.

    Does nothing when the group has one rank, so the same template serves tp=1 at no cost.
    Parameters tied to one already sharded (GPT-2's LM head and token embedding) are not sharded
    again: the styles only add their communication.
    """
    if sch.world_size == 1:
        return
    for pattern, styles in plan.items():
        styles = styles if isinstance(styles, Sequence) else (styles,)
        for node in select(sch, pattern):
            for style in styles:
                _apply_style(node, style)


def checkpointed_indices(num_layers: int, ratio: float, policy: str = "uniform") -> list[int]:
    """Which of ``num_layers`` blocks to checkpoint for a ``ratio`` in [0, 1].

    ``round(ratio * num_layers)`` blocks are chosen. ``"first"`` takes the first k (they hold
    activations longest under pipelining); ``"uniform"`` spreads them evenly, so every pipeline
    stage saves about the same memory.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ScheduleError(f"checkpoint ratio must be in [0, 1], got {ratio}")
    k = int(math.floor(ratio * num_layers + 0.5))
    if policy == "first":
        return list(range(k))
    if policy != "uniform":
        raise ScheduleError(f"checkpoint policy must be 'uniform' or 'first', got {policy!r}")
    if k == 0:
        return []
    return sorted({int(i * num_layers / k) for i in range(k)})


def apply_checkpointing(blocks: Sequence[Schedule], ratio: float, policy: str = "uniform") -> list[int]:
    """Checkpoint a ``ratio`` of the repeated ``blocks``; returns the indices checkpointed."""
    chosen = checkpointed_indices(len(blocks), ratio, policy)
    for i in chosen:
        blocks[i].checkpoint()
    return chosen


def stage_boundaries(num_layers: int, pp: int) -> list[int]:
    """Indices of the blocks after which to cut ``pp`` stages of (nearly) equal block counts
    (earlier stages take the remainder)."""
    if pp < 1 or pp > num_layers:
        raise ScheduleError(f"cannot cut {num_layers} blocks into {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    cuts, end = [], 0
    for s in range(pp - 1):
        end += base + (1 if s < extra else 0)
        cuts.append(end - 1)
    return cuts


def apply_pipeline_cuts(blocks: Sequence[Schedule], pp: int) -> list[int]:
    """Cut the repeated ``blocks`` into ``pp`` stages of (nearly) equal size; returns the cut indices."""
    cuts = stage_boundaries(len(blocks), pp)
    for i in cuts:
        blocks[i].cut_pipeline_stage()
    return cuts
