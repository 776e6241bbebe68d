"""The shape-only forward the generic template reads a model by: the order its linear layers run
in, and how each one's output is first cut along its features (a fused projection). Imports torch:
:mod:`search_spaces.generic` loads it when it plans a model, not when it builds a space."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from slapo_tune.parallel._comm import communication_disabled
from slapo_tune.schedule._pipeline import _recorded_calls


class _FirstUses(TorchFunctionMode):
    """Records the first operation applied to each watched tensor (a linear layer's output)."""

    def __init__(self):
        super().__init__()
        self.watched: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (layer path, the tensor: kept alive)
        self.first: dict[str, tuple[Callable, tuple, dict]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads_attribute = getattr(func, "__name__", "") == "__get__"  # .shape, .dtype: not a use
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.watched and not reads_attribute:
            path = self.watched.pop(id(args[0]))[0]
            self.first.setdefault(path, (func, args, kwargs))
        return func(*args, **kwargs)


@dataclass(frozen=True)
class FeatureCut:
    """How a projection's output is first cut along its features (a fused projection)."""

    how: str
    parts: int | None  # equal parts relative to the tensor's own width (chunk): shardable part by part


def _cuts_features(use: tuple[Callable, tuple, dict]) -> FeatureCut | None:
    """How a first use cuts a projection's output along its features (None if it does not)."""
    func, args, kwargs = use
    out = args[0]
    name = getattr(func, "__name__", "")
    if name == "__getitem__" and isinstance(args[1], tuple) and args[1] and isinstance(args[1][-1], slice):
        index = args[1]
        if (Ellipsis in index or len(index) == out.dim()) and index[-1] != slice(None):
            return FeatureCut("slices at fixed offsets", None)
    if name in ("chunk", "split", "tensor_split", "narrow", "split_with_sizes", "unbind"):
        dim_at = 1 if name == "unbind" else 2
        dim = kwargs.get("dim", args[dim_at] if len(args) > dim_at else 0)
        if isinstance(dim, int) and dim % out.dim() == out.dim() - 1:
            # chunk(n) cuts wherever the tensor's own width says: a shard is cut into its own parts
            parts = kwargs.get("chunks", args[1] if len(args) > 1 else None) if name == "chunk" else None
            return FeatureCut(f"cuts with {name}()", parts if isinstance(parts, int) else None)
    return None


def shape_walk(model: nn.Module, prefix: str) -> tuple[list[str], dict[str, FeatureCut]]:
    """One shape-only forward: the nn.Linear layers under ``prefix`` in the order they run, and for
    each whose output's first use cuts its features into parts (a fused projection: Q|K|V,
    gate|up), how it does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    linears = {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear) and p.startswith(prefix + ".")}
    uses = _FirstUses()
    handles = [m.register_forward_hook(lambda mod, args, out, p=p: uses.watched.__setitem__(id(out), (p, out)))
               for p, m in linears.items()]
    try:
        with _recorded_calls(model) as calls, communication_disabled(), torch.no_grad(), \
                FakeTensorMode(allow_non_fake_inputs=True), uses:
            device = next(model.parameters()).device
            model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device))
    finally:
        for h in handles:
            h.remove()
    order = sorted((p for p in linears if p in calls), key=lambda p: calls[p].order)
    return order, {p: cut for p, use in uses.first.items() if (cut := _cuts_features(use))}
