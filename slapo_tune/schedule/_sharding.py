"""Per-module-type sharding rules.

A rule knows how a module type stores its parameters, so ``shard("weight", axis)`` can fix the
module's size attributes (never touching the other dimension), choose the forward that stays
correct with a smaller weight, and infer the *layout* of the module's input and output:

* ``partition(axis)``: each rank holds a slice along ``axis`` (needs an all-gather to be whole);
* ``partial``: each rank holds a summand (needs an all-reduce);
* ``replicated``: every rank holds the whole tensor.

Knowing the layout turns a wrong ``sync`` into an early error instead of wrong numbers.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ..errors import ShardingError
from ..parallel._comm import all_gather_tensor


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 stores Linear-like weights transposed, as [in, out]).

    Checked without importing transformers: if it is not imported, no module can be one.
    """
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D)


@dataclass(frozen=True)
class Layout:
    """How a tensor is distributed over a tensor-parallel group."""

    kind: str  # "replicated" | "partition" | "partial"
    axis: int | None = None

    def __str__(self) -> str:
        return f"partition(axis={self.axis})" if self.kind == "partition" else self.kind


REPLICATED = Layout("replicated")
PARTIAL = Layout("partial")


def partition(axis: int) -> Layout:
    return Layout("partition", axis)


@dataclass
class ShardSpec:
    """Which slice of a full parameter this rank holds.

    ``num_fused`` > 1 means the sharded axis concatenates that many blocks (a fused QKV projection
    holds [q; k; v]), of equal sizes or of the sizes in ``blocks``; each block is split separately
    so every rank keeps whole heads of each block.
    """

    axis: int
    full_shape: tuple[int, ...]
    size: int
    rank: int
    num_fused: int = 1
    group: ProcessGroup | None = field(default=None, compare=False, repr=False)
    blocks: tuple[int, ...] = ()

    def _split(self, t: torch.Tensor, axis: int, per_rank: bool = False) -> tuple[torch.Tensor, ...]:
        if not self.blocks:
            return t.chunk(self.num_fused, dim=axis)
        sizes = [b // self.size for b in self.blocks] if per_rank else list(self.blocks)
        return t.split(sizes, dim=axis)

    def __deepcopy__(self, memo):
        clone = copy.copy(self)  # process groups cannot be copied, and need not be
        memo[id(self)] = clone
        return clone

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.axis] //= self.size
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor ``full``."""
        blocks = self._split(full, self.axis)
        mine = [b.chunk(self.size, dim=self.axis)[self.rank] for b in blocks]
        if len(mine) > 1:
            return torch.cat(mine, dim=self.axis)
        # a chunk is a view: copied, so that the full tensor's storage is freed, not kept alive
        return mine[0].clone(memory_format=torch.contiguous_format)

    def assemble(self, local: torch.Tensor) -> torch.Tensor:
        """Rebuild the full tensor from every rank's shard (a collective over the group)."""
        return self.interleave(all_gather_tensor(local, self.axis, self.group))

    def interleave(self, gathered: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """Reorder rank-major gathered chunks ([q0 k0 v0 | q1 k1 v1]) into block order ([q0 q1 | k0 k1 | ...]).

        ``axis`` defaults to the sharded axis; pass another for an activation computed from the shard.
        """
        if self.num_fused == 1:
            return gathered
        axis = self.axis if axis is None else axis
        per_rank = [self._split(p, axis, per_rank=True) for p in gathered.chunk(self.size, dim=axis)]
        return torch.cat([per_rank[r][b] for b in range(self.num_fused) for r in range(self.size)], dim=axis)


@dataclass
class ShardEffect:
    """What sharding one parameter does to its module."""

    attrs: dict[str, int] = field(default_factory=dict)  # size attributes to overwrite
    input_layout: Layout | None = None
    output_layout: Layout | None = None
    compute: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    defers_bias: bool = False


class ShardRule:
    """Sharding semantics of one module type. Subclasses describe where each dimension lives."""

    module_types: tuple[type, ...] = ()
    # parameter -> axis that holds the module's *output* features (None: the parameter has none)
    out_axis: dict[str, int] = {}
    in_axis: dict[str, int] = {}

    def matches(self, module: nn.Module) -> bool:
        return isinstance(module, self.module_types)

    def effect(self, module: nn.Module, name: str, axis: int, size: int, shards: dict[str, ShardSpec]) -> ShardEffect:
        raise NotImplementedError

    def check_consistent(self, module: nn.Module, shards: dict[str, ShardSpec]) -> str | None:
        """A reason why the module's shards cannot compute correctly together, or None."""
        return None


def _bias_consistency(module: nn.Module, shards: dict[str, ShardSpec], out_axis: int) -> str | None:
    weight, bias = shards.get("weight"), shards.get("bias")
    has_bias = getattr(module, "bias", None) is not None
    weight_on_out = weight is not None and weight.axis == out_axis
    if has_bias and weight_on_out and bias is None:
        return "its weight is sharded along the output features but its bias is not: shard('bias', 0) as well"
    if bias is not None and not weight_on_out:
        return "its bias is sharded but its weight is not sharded along the output features"
    if bias is not None and weight is not None and bias.num_fused != weight.num_fused:
        return f"weight and bias were sharded with different num_fused ({weight.num_fused} vs {bias.num_fused})"
    return None


class LinearRule(ShardRule):
    """``nn.Linear``: weight [out, in], bias [out]."""

    module_types = (nn.Linear,)
    out_axis = {"weight": 0, "bias": 0}
    in_axis = {"weight": 1}
    out_attr, in_attr = "out_features", "in_features"

    def effect(self, module, name, axis, size, shards):
        full = _full_shape(module, name, shards)
        if name == "weight" and axis == self.in_axis["weight"]:
            eff = ShardEffect(
                attrs={self.in_attr: full[axis] // size},
                input_layout=partition(-1),
                output_layout=PARTIAL,
            )
            if getattr(module, "bias", None) is not None:
                eff.compute, eff.defers_bias = self.bias_free_forward, True
            return eff
        if axis == self.out_axis.get(name):
            attrs = {self.out_attr: full[axis] // size} if name == "weight" else {}
            split = getattr(module, "split_sizes", None)
            if split is not None:  # a FusedLinear: its slices shrink with it
                weight = shards.get("weight") if name != "weight" else None
                full_split = list(weight.blocks) if weight is not None else list(split)
                if list(shards[name].blocks) != full_split:
                    raise ShardingError(
                        f"shard {type(module).__name__}.{name} block by block: pass num_fused={full_split}"
                    )
                if name == "weight":
                    attrs["split_sizes"] = [b // size for b in split]
            return ShardEffect(attrs=attrs, input_layout=REPLICATED, output_layout=partition(-1))
        raise ShardingError(f"cannot shard {type(module).__name__}.{name} along axis {axis}")

    @staticmethod
    def bias_free_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, module.weight)

    def check_consistent(self, module, shards):
        return _bias_consistency(module, shards, self.out_axis["weight"])


class Conv1DRule(LinearRule):
    """Hugging Face ``Conv1D`` (GPT-2): weight stored transposed as [in, out], bias [out]."""

    def matches(self, module: nn.Module) -> bool:
        return is_conv1d(module)
    out_axis = {"weight": 1, "bias": 0}
    in_axis = {"weight": 0}
    out_attr, in_attr = "nf", "nx"

    @staticmethod
    def bias_free_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = torch.mm(x.reshape(-1, x.size(-1)), module.weight)
        return out.view(*x.shape[:-1], module.weight.shape[1])


class EmbeddingRule(ShardRule):
    """``nn.Embedding``: weight [num_embeddings, embedding_dim].

    Axis 0 is vocabulary parallelism: ids outside this rank's range are looked up as row 0 and
    their rows zeroed, so the ranks' outputs are summands of the full lookup (``partial``).
    """

    module_types = (nn.Embedding,)
    out_axis = {"weight": 1}

    def effect(self, module, name, axis, size, shards):
        full = _full_shape(module, name, shards)
        if name != "weight" or axis not in (0, 1):
            raise ShardingError(f"cannot shard {type(module).__name__}.{name} along axis {axis}")
        if axis == 1:
            return ShardEffect(attrs={"embedding_dim": full[1] // size}, output_layout=partition(-1))
        return ShardEffect(
            attrs={"num_embeddings": full[0] // size},
            input_layout=REPLICATED,
            output_layout=PARTIAL,
            compute=_vocab_parallel_embedding,
        )


def _vocab_parallel_embedding(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    spec: ShardSpec = module._slapo.shards["weight"]
    rows = spec.local_shape[0]
    start = spec.rank * rows
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    pad = module.padding_idx
    # The padding row receives no gradient on the rank that owns it, exactly as unsharded.
    local_pad = pad - start if pad is not None and start <= pad < start + rows else None
    out = F.embedding(local, module.weight, local_pad, module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class GenericRule(ShardRule):
    """Any other module: the parameter is sliced, nothing about its output is inferred."""

    def matches(self, module: nn.Module) -> bool:
        return True

    def effect(self, module, name, axis, size, shards):
        return ShardEffect()


RULES: list[ShardRule] = [Conv1DRule(), LinearRule(), EmbeddingRule()]
_GENERIC = GenericRule()


def rule_for(module: nn.Module) -> ShardRule:
    """The most specific sharding rule for ``module``'s type."""
    for rule in RULES:
        if rule.matches(module):
            return rule
    return _GENERIC


def _full_shape(module: nn.Module, name: str, shards: dict[str, ShardSpec]) -> tuple[int, ...]:
    spec = shards.get(name)
    return spec.full_shape if spec is not None else tuple(getattr(module, name).shape)
