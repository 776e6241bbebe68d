"""Schedule templates: turn a point of a search space into a schedule, in a fixed order.

A template for a model family says only what differs between families (where the blocks are,
the tensor-parallel plan, which sibling layers fuse, which sizes tensor parallelism must divide);
this base class owns the knobs every template offers and the order of application:

1. attention kernel (``attn``), 2. fusion (``fuse``; before sharding, so fused layers shard
block by block), 3. tensor parallelism (``tp``), sequence parallelism (``sp``) and the vocabulary-parallel loss
(``loss_parallel``: the LM head keeps its output sharded), 4. activation
checkpointing (``ckpt_ratio`` of the blocks, spread uniformly; ``ckpt_policy`` says what they
recompute), 5. pipeline cuts (``pp * vpp`` stages of block counts that differ by at most one, the
first and last stages the fewer, as Megatron-LM's; rank ``r`` runs stages ``r, r + pp, ...``). ``build`` then adds data parallelism (``dp``, ``zero``), and the runtime runs
``micro_batch`` x accumulation under ``pipeline_schedule`` (interleaved when ``vpp > 1``).

The global batch is held fixed: ``global_batch = dp * micro_batch * accumulation``
(:func:`slapo_tune.plan.accumulation`).
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._partition import CKPT_SPREAD, interleaved_microbatches_ok
from .errors import ScheduleError
from .models import model_family, supports_sdpa
from .plan import Workload, accumulation, knob_value
from .space import Knob, Point, Space, divisors

if TYPE_CHECKING:  # a template's space needs no torch (plan); applying a point imports it
    from torch import nn

    from .schedule._schedule import Schedule

CKPT_RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class TemplateSource:
    """The ``.py`` file a template was loaded from (absolute path) and the SHA-256 of the content
    that ran: a schedule made with it trains only with that same content."""

    path: str
    sha256: str


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
    tp_refusal: str = ""  # why the template cannot shard this model (Template.tp_refusal): tp=1 only

    @classmethod
    def from_config(cls, config) -> ModelInfo:
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
            # a preset's card (no transformers config: the planner's view) is of a family that does
            supports_sdpa=supports_sdpa(config) if hasattr(config, "to_dict") else True,
        )


def _distinct_ratios(layers: int) -> list[float]:
    seen, out = set(), []
    for r in CKPT_RATIOS:
        k = math.floor(r * layers + 0.5)
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


_PLAN_RENAMED = ("Template.plan(model, fused) is renamed tensor_parallel_plan(model, fused): define and call "
                 "that (plan() is removed in the next release)")


class Template:
    """Base class of schedule templates. Subclasses set the class attributes or override hooks."""

    name = "base"
    version = "1"
    families: tuple[str, ...] = ()
    blocks: str = ""  # path of the repeated block list
    tp_plan: Mapping[str, Any] = {}
    # {parent glob: ((sibling linear names), fused name)}: horizontal fusion for ``fuse=on``
    fusion_groups: Mapping[str, tuple[tuple[str, ...], str]] = {}
    # ``fuse=on`` also runs these globs' Llama-style RMSNorms as slapo_tune.op.FusedRMSNorm, and these
    # MLPs ({glob: (fused gate|up projection, down projection)}, a fusion group's result) as
    # SwiGLUMLP where the activation is SiLU: what Transformer Engine's fused kernels compute, keeping
    # what they keep for backward
    fused_norms: tuple[str, ...] = ()
    swiglu_mlps: Mapping[str, tuple[str, str]] = {}
    source: TemplateSource | None = None  # set by the loader of a template from a user's file
    # the model's loss is Hugging Face's causal-LM one (shifted labels): ``loss_parallel`` can replace it
    causal_lm = True

    # ---------------------------------------------------------- what differs
    def blocks_path(self, model: nn.Module) -> str:
        return self.blocks

    def tensor_parallel_plan(self, model: nn.Module, fused: bool = False) -> dict[str, Any]:
        """The tensor-parallel plan ({module path glob: style}); with ``fused`` the fusion groups'
        layers are replaced by the fused layer (same style as the first one)."""
        plan = dict(self.tp_plan)
        if fused:
            for parent, (names, fused_name) in self.fusion_groups.items():
                styles = [plan.pop(f"{parent}.{n}") for n in names if f"{parent}.{n}" in plan]
                if styles:
                    plan[f"{parent}.{fused_name}"] = styles[0]
        return plan

    def plan(self, model: nn.Module, fused: bool = False) -> dict[str, Any]:
        """Deprecated (removed in the next release): the old name of :meth:`tensor_parallel_plan`,
        renamed as "plan" also names :class:`slapo_tune.plan.Plan` and the ``plan`` command."""
        mro = type(self).__mro__
        legacy = [i for i, c in enumerate(mro) if c.__dict__.get("_legacy_plan")]
        if not legacy:
            warnings.warn(_PLAN_RENAMED, DeprecationWarning, stacklevel=2)
        # reached by ``super().plan()`` from an override of the old name: go on with the plan of the
        # classes below the last such override (their ``tensor_parallel_plan`` is that override)
        below = next(c for c in mro[legacy[-1] + 1 if legacy else 0:] if "tensor_parallel_plan" in c.__dict__)
        return below.tensor_parallel_plan(self, model, fused)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # a template written before the rename overrides ``plan``: it stays the template's plan for
        # one release (build applies ``tensor_parallel_plan``)
        if "plan" in cls.__dict__ and "tensor_parallel_plan" not in cls.__dict__:
            warnings.warn(f"template {cls.__qualname__}: {_PLAN_RENAMED}", DeprecationWarning, stacklevel=2)
            cls.tensor_parallel_plan = cls.__dict__["plan"]
            cls._legacy_plan = True

    def tp_refusal(self, config) -> str:
        """Why this template cannot shard the model of ``config`` at all ("" when it can)."""
        return ""

    def tp_divides(self, info: ModelInfo) -> tuple[int, ...]:
        """Sizes that tensor parallelism must divide (heads, KV heads, vocabulary, MLP width)."""
        return (info.heads, info.kv_heads, info.vocab, info.intermediate)

    @property
    def has_fusion(self) -> bool:
        return bool(self.fusion_groups)

    def fuse(self, sch: Schedule, model: nn.Module) -> None:
        """Fuse sibling projections horizontally, then swap in the fused norms and SwiGLU MLPs
        (``fuse=on``)."""
        # torch-free: plan, space and every --help import this module; these import torch
        from .op import FusedRMSNorm, SwiGLUMLP
        from .parallelize import glob_to_regex
        from .schedule._graph import fuse_linears

        for parent, (names, fused_name) in self.fusion_groups.items():
            for node in sch.find(glob_to_regex(parent)):
                node.replace(fuse_linears, target=[node[n] for n in names], name=fused_name)
        for pattern in self.fused_norms:
            for node in sch.find(glob_to_regex(pattern)):
                node.replace(FusedRMSNorm.from_module(node.mod))
        # a gated MLP of another activation (GeGLU) keeps its own forward
        if getattr(getattr(model, "config", None), "hidden_act", None) in ("silu", "swish"):
            for parent, (gate_up, down) in self.swiglu_mlps.items():
                for node in sch.find(glob_to_regex(parent)):
                    node.replace(SwiGLUMLP(node.mod.get_submodule(gate_up), node.mod.get_submodule(down)))

    def extra_knobs(self, info: ModelInfo, workload: Workload) -> list[Knob]:
        return []

    # ------------------------------------------------------------ the space
    def space(self, info: ModelInfo, workload: Workload) -> Space:
        world, gb = workload.world_size, workload.global_batch

        def tp_choices(p: Point) -> list[int]:
            if info.tp_refusal:
                return [1]
            return [t for t in divisors(world) if all(d % t == 0 for d in self.tp_divides(info))]

        def pp_choices(p: Point) -> list[int]:
            # any degree up to the number of blocks: an uneven split gives the first and last
            # stages (embedding, head) the fewer blocks (see stage_block_counts)
            return [s for s in divisors(world // p["tp"]) if s <= info.layers]

        def cp_choices(p: Point) -> list[int]:
            # context parallelism splits each sequence (a causal LM's: its loss is split with it)
            # into 2 x cp chunks, two per rank (the causal load balance, see _context_parallel)
            if not self.causal_lm:
                return [1]
            return [c for c in divisors(world // (p["tp"] * p["pp"])) if c == 1 or workload.seq_len % (2 * c) == 0]

        def micro_batch_choices(p: Point) -> list[int]:
            return divisors(gb // p["dp"]) if gb % p["dp"] == 0 else []

        def schedule_choices(p: Point) -> list[str]:
            if p["pp"] == 1:
                return ["1f1b"]  # one stage: both schedules are plain accumulation
            n = accumulation(workload, p["dp"], p["micro_batch"])
            if n < p["pp"]:
                return ["gpipe"]
            # zero bubble interleaves (vpp > 1: the layers split into 2 * pp stages at least), computes
            # weight gradients after ZeRO-3 resharded the parameters (lost) and runs backward twice
            # over a block, which selective recomputation allows once: neither is offered
            zero_bubble = (interleaved_microbatches_ok(n, p["pp"]) and info.layers % (2 * p["pp"]) == 0
                           and p["zero"] < 3 and p["ckpt_policy"] != "selective")
            return ["gpipe", "1f1b", "zb"] if zero_bubble else ["gpipe", "1f1b"]

        def sp_choices(p: Point) -> list[str]:
            # the tp group shards this rank's part of the sequence (a cp chunk pair under cp)
            local = workload.seq_len // p["cp"]
            return ["off", "on"] if p["tp"] > 1 and local % p["tp"] == 0 else ["off"]

        def loss_parallel_choices(p: Point) -> list[str]:
            # at tp=1: the same loss over the whole vocabulary, computed in place (a fused
            # cross-entropy, as llm-foundry's and Megatron-LM's): one fp32 buffer, no second copy
            return ["off", "on"] if self.causal_lm else ["off"]

        def vpp_choices(p: Point) -> list[int]:
            if p["pp"] == 1 or p["pipeline_schedule"] == "gpipe":
                return [1]
            pp, n = p["pp"], accumulation(workload, p["dp"], p["micro_batch"])
            if not interleaved_microbatches_ok(n, pp):
                return [] if p["pipeline_schedule"] == "zb" else [1]
            # pp * vpp stages of equal chunks: pp * vpp divides the blocks
            equal = divisors(info.layers // pp)[1:] if info.layers % pp == 0 else []
            if p["pipeline_schedule"] == "zb":
                return equal
            # or Megatron-LM's split counting the embedding and the loss as a layer each: pp * vpp
            # divides the blocks + 2, the first and last stages one block short (stage_block_counts
            # cuts them so), each at least one block
            padded = info.layers + 2
            short_ends = [v for v in divisors(padded // pp)[1:] if pp * v <= info.layers] if padded % pp == 0 else []
            return [1, *sorted({*equal, *short_ends})]

        knobs = [
            Knob("tp", tp_choices, doc="tensor-parallel degree (divides heads, KV heads, vocab, MLP width)",
                 limited_by=info.tp_refusal),
            Knob("pp", pp_choices, ("tp",), doc="pipeline stages (divides world/tp, at most the layers; an uneven split gives the "
                     "first and last stages the fewer blocks)"),
            Knob("cp", cp_choices, ("tp", "pp"),
                 doc="context-parallel degree: each sequence split over cp ranks, attention all-gathers keys "
                     "and values (divides world/(tp*pp); 2*cp divides the sequence length; causal LMs)"),
            Knob("sp", sp_choices, ("tp", "cp"), kind=str,
                 doc="sequence parallelism: norms, dropout and residuals on a sequence shard of the tp group "
                     "(needs tp > 1 dividing the sequence length, a rank's share of it under cp)"),
            Knob("dp", derive=lambda p: world // (p["tp"] * p["cp"] * p["pp"]), doc="data-parallel degree = world/(tp*cp*pp)"),
            Knob("zero", lambda p: [0, 1, 2, 3] if p["dp"] > 1 else [0], ("tp", "pp", "cp"),
                 doc="ZeRO level over dp: 0 replicated; 1 optimizer state, 2 also gradients, 3 also "
                     "parameters sharded (FSDP2)"),
            Knob("micro_batch", micro_batch_choices, ("tp", "pp", "cp"), doc="micro-batch size (divides global/dp)"),
            Knob("ckpt_ratio", _distinct_ratios(info.layers), kind=float,
                 doc=f"fraction of blocks checkpointed, spread {CKPT_SPREAD}ly"),
            Knob("ckpt_policy", lambda p: ["full", "selective"] if p["ckpt_ratio"] > 0 else ["full"],
                 ("ckpt_ratio",), kind=str,
                 doc="what a checkpointed block recomputes: full (everything) or selective (keeps matmul "
                     "outputs, recomputes element-wise ops and attention)"),
            Knob("pipeline_schedule", schedule_choices, ("tp", "pp", "zero", "micro_batch", "ckpt_policy"), kind=str,
                 doc="gpipe, 1f1b (at least pp micro-batches) or zb (interleaved zero bubble: vpp > 1, zero <= 2, "
                     "full recomputation only)"),
            Knob("vpp", vpp_choices, ("tp", "pp", "micro_batch", "pipeline_schedule"),
                 doc="virtual stages per pipeline rank: interleaved 1F1B when > 1 (pp * vpp divides the layers, or "
                     "the layers + 2 with the first and last stages one layer short, as Megatron-LM counting the "
                     "embedding and the loss; at least pp micro-batches, a whole number of rounds)"),
            Knob("loss_parallel", loss_parallel_choices, ("tp",), kind=str,
                 doc="fused, vocabulary-parallel loss: the cross-entropy computed in place on the LM head's "
                     "logits, which stay sharded over the tp group when tp > 1 (causal LMs)"),
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
        # torch-free: plan, space and every --help import this module; these import torch
        from .parallel._context_parallel import apply_context_parallel
        from .parallel._vocab_loss import mark_loss_parallel
        from .parallelize import (
            apply_checkpointing,
            apply_pipeline_cuts,
            apply_sequence_parallel,
            apply_tensor_parallel,
            vocab_parallel_head,
        )

        model = sch.mod
        cp = knob_value(point, "cp")
        # context parallelism: the kernel's variant that gathers keys and values over the cp group
        set_attention(model, apply_context_parallel(model, cp, point["attn"]) if cp > 1 else point["attn"])
        fused = point["fuse"] == "on"
        if fused:
            self.fuse(sch, model)
        sequence_parallel = knob_value(point, "sp") == "on"
        plan = self.tensor_parallel_plan(model, fused=fused)
        if knob_value(point, "loss_parallel") == "on":
            if sch.world_size > 1:
                plan = vocab_parallel_head(plan)
            else:  # one rank holds the whole vocabulary: only the loss changes
                mark_loss_parallel(model, 1)
        apply_tensor_parallel(sch, plan, sequence_parallel=sequence_parallel)
        blocks = self.block_nodes(sch)
        if sequence_parallel:
            apply_sequence_parallel(blocks)
        apply_checkpointing(blocks, point["ckpt_ratio"], CKPT_SPREAD, policy=knob_value(point, "ckpt_policy"))
        stages = point["pp"] * knob_value(point, "vpp")
        if stages > 1:
            apply_pipeline_cuts(blocks, stages)

    def block_nodes(self, sch: Schedule) -> list[Schedule]:
        node = sch[self.blocks_path(sch.mod)]
        return [node[name] for name in node.child]

    def schedule(self, model: nn.Module, point: Mapping[str, Any], topology=None) -> Schedule:
        """A schedule of ``model`` for ``point`` over ``topology``'s tensor-parallel group."""
        # torch-free: plan, space and every --help import this module; _schedule imports torch
        from .schedule._schedule import create_schedule

        sch = create_schedule(model, group=None if topology is None else topology.tp_group)
        self.apply(sch, point)
        return sch

    def describe(self) -> str:
        where = f" ({self.source.path}, sha256 {self.source.sha256[:12]})" if self.source else ""
        return f"{self.name} v{self.version}{where}"

    def record(self) -> dict[str, str]:
        """How a schedule file names this template: name and version, and for a template from a
        user's file that file's path and content hash (the file is loaded again to train)."""
        found = {"name": self.name, "version": str(self.version)}
        if self.source is not None:
            found.update(file=self.source.path, sha256=self.source.sha256)
        return found


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
