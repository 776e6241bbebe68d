"""Ready modules for schedules (Slapo's ``slapo.op``): replacements a schedule swaps in with
``replace``, shaped so the usual primitives apply to them by name.

* :class:`FusedMLP`: ``fc_in`` -> activation -> ``fc_out`` -> dropout. ``fc_in`` shards column-wise,
  ``fc_out`` row-wise; ``decompose`` on ``fc_in`` then ``find(bias_then(mlp.act))`` fuses the bias
  with the activation.
* :class:`Attention`: fused QKV projection, :class:`AttentionCore` over
  ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where the device has them),
  output projection. The head count follows the projection's width, so a tensor-parallel schedule
  shards ``qkv`` (``num_fused=3``) and ``out_proj`` and changes no attribute; the core takes the
  packed ``[batch, seq, 3, heads, head_dim]`` tensor, so one ``all_to_all`` sync on each side turns it
  into sequence-parallel attention (DeepSpeed-Ulysses).
* :class:`Print`: prints values at run time and passes a tensor through; stays a call in a traced
  graph, so it can debug what a graph computes.
* :class:`LinearWithSyncFunc`: a linear layer calling ``sync_fn`` on its output before the bias, as
  a row-parallel layer must (the bias added once, not once per rank).

:func:`all_reduce` and :func:`all_to_all` are the differentiable collectives for ``sync_fn`` and
for schedules written with functions.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from . import _comm
from .errors import ScheduleError

# activation name (Hugging Face's config spelling) -> module
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
}


def all_reduce(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum partial results over ``group`` (forward); gradients pass through (backward)."""
    return _comm.reduce_fwd(x, group)


def all_to_all(x: torch.Tensor, split_axis: int, join_axis: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Re-partition ``x`` (this rank's slice along ``join_axis``) into this rank's slice along
    ``split_axis``; backward is the reverse re-partition."""
    return _comm.all_to_all(x, split_axis, join_axis, group)


class FusedMLP(nn.Module):
    """A transformer MLP: ``dropout(fc_out(act(fc_in(x))))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ScheduleError(f"FusedMLP: unknown activation {activation!r}; known: {', '.join(ACTIVATIONS)}")
        self.fc_in = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.act = ACTIVATIONS[activation]()
        self.fc_out = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(hidden_states))))


class AttentionCore(nn.Module):
    """Scaled dot-product attention of a packed ``[batch, seq, 3, heads, head_dim]`` tensor;
    returns ``[batch, seq, heads, head_dim]``. ``mask``: boolean (True = attend) or additive,
    broadcastable to ``[batch, heads, seq, seq]``."""

    slapo_leaf = True  # a traced graph keeps it as one call (syncs on it keep working)

    def __init__(self, causal: bool = True, dropout: float = 0.0, scale: float | None = None):
        super().__init__()
        self.causal, self.dropout, self.scale = causal, dropout, scale

    def forward(self, qkv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))  # [batch, heads, seq, head_dim]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask is None, scale=self.scale)
        return out.transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention: ``qkv`` (one linear layer, ``[q | k | v]``), :class:`AttentionCore`,
    ``out_proj``, residual dropout. A ``mask`` is passed to the core (causal masking is built in)."""

    def __init__(self, hidden_size: int, num_heads: int, attn_dropout: float = 0.0, resid_dropout: float = 0.0,
                 bias: bool = True, causal: bool = True, device=None, dtype=None):
        super().__init__()
        if hidden_size % num_heads:
            raise ScheduleError(f"Attention: hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bias, device=device, dtype=dtype)
        self.core = AttentionCore(causal, attn_dropout, 1.0 / math.sqrt(self.head_dim))
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(resid_dropout)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        qkv = self.qkv(hidden_states)
        # the local head count: a sharded qkv holds whole heads of each of q, k and v
        qkv = qkv.view(batch, seq, 3, qkv.shape[-1] // (3 * self.head_dim), self.head_dim)
        out = self.core(qkv, mask)
        return self.dropout(self.out_proj(out.reshape(*out.shape[:2], -1)))


class Print(nn.Module):
    """``forward(tensor, *values)`` prints ``values`` and returns ``tensor``. Write the values
    lazily (``self.print(x, "x =", x)``, not an f-string): in a traced graph the call runs with
    the real tensors."""

    slapo_leaf = True

    def __init__(self, file=None):
        super().__init__()
        self.file = file

    def forward(self, tensor: torch.Tensor, *values, sep: str = " ", end: str = "\n") -> torch.Tensor:
        print(*values, sep=sep, end=end, file=self.file or sys.stdout, flush=True)
        return tensor


class LinearWithSyncFunc(nn.Module):
    """``sync_fn(x @ weight.T) + bias``: a linear layer whose output is synchronised before the bias
    is added. Slice ``weight`` along its input features (``shard("weight", 1)``) and pass
    ``sync_fn=functools.partial(op.all_reduce, group=...)`` for a row-parallel layer."""

    slapo_leaf = True  # the sync inside must not be traced away

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.in_features, self.out_features, self.sync_fn = in_features, out_features, sync_fn
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.Linear.reset_parameters(self)  # nn.Linear's initialisation, from the weight's own shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.sync_fn is not None:
            out = self.sync_fn(out)
        return out if self.bias is None else out + self.bias


__all__ = ["FusedMLP", "Attention", "AttentionCore", "Print", "LinearWithSyncFunc", "all_reduce", "all_to_all",
           "ACTIVATIONS"]
