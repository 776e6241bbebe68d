"""Schedule templates: turn a point of a search space into a schedule, in a fixed order.

A template for a model family says only what differs between families (where the blocks are,
the tensor-parallel plan, which sibling layers fuse, which sizes tensor parallelism must divide);
this base class owns the knobs every template offers and the order of application:

1. attention kernel (``attn``), 2. fusion (``fuse``; before sharding, so fused layers shard
block by block), 3. tensor parallelism (``tp``), 4. activation checkpointing (``ckpt_ratio``,
spread uniformly over the blocks), 5. pipeline cuts (``pp``, equal block counts). ``build`` then
adds data parallelism (``dp``, ``zero``), and the runtime runs ``micro_batch`` x accumulation.

The global batch is held fixed: ``global_batch = dp * micro_batch * accumulation``
(:func:`slapo_tune.plan.accumulation`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ._graph import fuse_linears
from ._schedule import Schedule, create_schedule
from .errors import ScheduleError
from .parallelize import apply_checkpointing, apply_pipeline_cuts, apply_tensor_parallel, glob_to_regex
from .plan import Workload, accumulation
from .space import Knob, Point, Space, divisors

CKPT_RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)
CKPT_POLICY = "uniform"


@dataclass(frozen=True)
class ModelInfo:
    """The sizes of a model that decide which knob values are legal (from its config)."""

    family: str
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    intermediate: int
    supports_sdpa: bool = True

    @classmethod
    def from_config(cls, config) -> ModelInfo:
        from .models import model_family

        hidden = config.hidden_size
        inter = (getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
                 or getattr(config, "n_inner", None) or 4 * hidden)
        heads = config.num_attention_heads
        return cls(
            family=model_family(config),
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            hidden=hidden,
            vocab=config.vocab_size,
            intermediate=inter,
        )


def _distinct_ratios(layers: int) -> list[float]:
    seen, out = set(), []
    for r in CKPT_RATIOS:
        k = math.floor(r * layers + 0.5)
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


class Template:
    """Base class of schedule templates. Subclasses set the class attributes or override hooks."""

    name = "base"
    version = "1"
    families: tuple[str, ...] = ()
    blocks: str = ""  # path of the repeated block list
    tp_plan: Mapping[str, Any] = {}
    # {parent glob: ((sibling linear names), fused name)}: horizontal fusion for ``fuse=on``
    fusion_groups: Mapping[str, tuple[tuple[str, ...], str]] = {}

    # ---------------------------------------------------------- what differs
    def blocks_path(self, model: nn.Module) -> str:
        return self.blocks

    def plan(self, model: nn.Module, fused: bool = False) -> dict[str, Any]:
        """The tensor-parallel plan; with ``fused`` the fusion groups' layers are replaced by the
        fused layer (same style as the first one)."""
        plan = dict(self.tp_plan)
        if fused:
            for parent, (names, fused_name) in self.fusion_groups.items():
                styles = [plan.pop(f"{parent}.{n}") for n in names if f"{parent}.{n}" in plan]
                if styles:
                    plan[f"{parent}.{fused_name}"] = styles[0]
        return plan

    def tp_divides(self, info: ModelInfo) -> tuple[int, ...]:
        """Sizes that tensor parallelism must divide (heads, KV heads, vocabulary, MLP width)."""
        return (info.heads, info.kv_heads, info.vocab, info.intermediate)

    @property
    def has_fusion(self) -> bool:
        return bool(self.fusion_groups)

    def fuse(self, sch: Schedule, model: nn.Module) -> None:
        """Fuse sibling projections horizontally (``fuse=on``)."""
        for parent, (names, fused_name) in self.fusion_groups.items():
            for node in sch.find(glob_to_regex(parent)):
                node.replace(fuse_linears, target=[node[n] for n in names], name=fused_name)

    def extra_knobs(self, info: ModelInfo, workload: Workload) -> list[Knob]:
        return []

    # ------------------------------------------------------------ the space
    def space(self, info: ModelInfo, workload: Workload) -> Space:
        world, gb = workload.world_size, workload.global_batch

        def tp_choices(p: Point) -> list[int]:
            return [t for t in divisors(world) if all(d % t == 0 for d in self.tp_divides(info))]

        def pp_choices(p: Point) -> list[int]:
            return [s for s in divisors(world // p["tp"]) if info.layers % s == 0]

        def micro_batch_choices(p: Point) -> list[int]:
            return divisors(gb // p["dp"]) if gb % p["dp"] == 0 else []

        def schedule_choices(p: Point) -> list[str]:
            if p["pp"] == 1:
                return ["1f1b"]  # one stage: both schedules are plain accumulation
            return ["gpipe", "1f1b"] if accumulation(workload, p["dp"], p["micro_batch"]) >= p["pp"] else ["gpipe"]

        knobs = [
            Knob("tp", tp_choices, doc="tensor-parallel degree (divides heads, KV heads, vocab, MLP width)"),
            Knob("pp", pp_choices, ("tp",), doc="pipeline stages (divides the layers and world/tp)"),
            Knob("dp", derive=lambda p: world // (p["tp"] * p["pp"]), doc="data-parallel degree = world/(tp*pp)"),
            Knob("zero", lambda p: [0, 1, 2, 3] if p["dp"] > 1 else [0], ("tp", "pp"),
                 doc="ZeRO level over dp: 0 replicated; 1 optimizer state, 2 also gradients, 3 also "
                     "parameters sharded (FSDP2)"),
            Knob("micro_batch", micro_batch_choices, ("tp", "pp"), doc="micro-batch size (divides global/dp)"),
            Knob("ckpt_ratio", _distinct_ratios(info.layers), kind=float,
                 doc=f"fraction of blocks checkpointed, spread {CKPT_POLICY}ly"),
            Knob("pipeline_schedule", schedule_choices, ("tp", "pp", "micro_batch"), kind=str,
                 doc="gpipe or 1f1b (1f1b needs at least pp micro-batches)"),
            Knob("attn", ["sdpa", "eager"] if info.supports_sdpa else ["eager"], kind=str,
                 doc="attention kernel: sdpa (fused) or eager (materialises the scores)"),
            Knob("fuse", ["off", "on"] if self.has_fusion else ["off"], kind=str,
                 doc="kernel fusion: " + ("fused projections / bias+activation" if self.has_fusion else "none")),
            *self.extra_knobs(info, workload),
        ]
        return Space(knobs, context={"template": self.name, "world_size": world, "global_batch": gb})

    # ------------------------------------------------------- applying points
    def apply(self, sch: Schedule, point: Mapping[str, Any]) -> None:
        """Apply ``point`` to a fresh schedule, in the fixed order (see the module docstring)."""
        model = sch.mod
        set_attention(model, point["attn"])
        fused = point["fuse"] == "on"
        if fused:
            self.fuse(sch, model)
        apply_tensor_parallel(sch, self.plan(model, fused=fused))
        blocks = self.block_nodes(sch)
        apply_checkpointing(blocks, point["ckpt_ratio"], CKPT_POLICY)
        if point["pp"] > 1:
            apply_pipeline_cuts(blocks, point["pp"])

    def block_nodes(self, sch: Schedule) -> list[Schedule]:
        node = sch[self.blocks_path(sch.mod)]
        return [node[name] for name in node.child]

    def schedule(self, model: nn.Module, point: Mapping[str, Any], topology=None) -> Schedule:
        """A schedule of ``model`` for ``point`` over ``topology``'s tensor-parallel group."""
        sch = create_schedule(model, group=None if topology is None else topology.tp_group)
        self.apply(sch, point)
        return sch

    def describe(self) -> str:
        return f"{self.name} v{self.version}"


def set_attention(model: nn.Module, impl: str) -> None:
    """Choose the attention kernel of a Hugging Face model (``eager`` or ``sdpa``)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ScheduleError(f"attn={impl}: {type(model).__name__} has no config to set the attention kernel on")
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # pragma: no cover - older transformers
        config._attn_implementation = impl


def matching_paths(model: nn.Module, pattern: str) -> list[str]:
    """Module paths matching a plan glob (``*`` = one component)."""
    return [p for p, _ in model.named_modules() if p and fnmatch.fnmatchcase(p, pattern)
            and p.count(".") == pattern.count(".")]
