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

* :class:`FusedRMSNorm` and :class:`SwiGLUMLP`: Hugging Face's Llama RMSNorm and gated SiLU MLP
  computing the same values while keeping for backward only what Transformer Engine's and
  Megatron's fused kernels keep (:func:`rms_norm`, :func:`swiglu`); the llama template swaps them in
  under ``fuse=on``.

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

from .errors import ScheduleError
from .parallel import _comm

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


class _RMSNorm(torch.autograd.Function):
    """``weight * (x / rms(x))`` as Hugging Face's ``LlamaRMSNorm`` computes it (in fp32, the
    normalised value cast back to ``x``'s dtype before the weight multiplies it), keeping for
    backward only ``x`` and the per-token ``rstd``: autograd over the plain formula keeps an fp32
    copy of ``x`` and the normalised tensor as well (4 more bytes per element of a bf16 ``x``), and
    backward recomputes the normalised tensor from the two instead."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        xf = x.to(torch.float32)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            normed = (xf * rstd).to(x.dtype)
            # the product's gradient in its own (promoted) dtype, summed over the broadcast token axes
            grad_weight = (grad * normed).sum_to_size(weight.shape).to(weight.dtype)
        # the gradient reaching the normalised tensor is rounded to its dtype, as autograd's cast does
        g = (grad * weight).to(x.dtype).to(torch.float32)
        # d/dx of x * rstd(x) with rstd = (mean(x^2) + eps)^-1/2: g * rstd - x * rstd^3 * mean(g * x)
        grad_rstd = (g * xf).sum(-1, keepdim=True)
        grad_x = g * rstd + xf * (grad_rstd * (-0.5) * rstd.pow(3) * (2.0 / x.shape[-1]))
        return grad_x.to(x.dtype), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of ``x`` (last axis), keeping only ``x`` and ``rstd`` for backward."""
    return _RMSNorm.apply(x, weight, eps)


class FusedRMSNorm(nn.Module):
    """Hugging Face's Llama/Mistral/Qwen2 RMSNorm (``weight``, ``variance_epsilon``) through
    :func:`rms_norm`: same outputs and gradients, less memory kept (``from_module`` adopts a
    norm's own ``weight`` parameter, so materialisation and every schedule state see the same
    tensor; "RMSNorm" in the class name lets Hugging Face's initialiser treat it as a norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    @classmethod
    def from_module(cls, norm: nn.Module) -> FusedRMSNorm:
        weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
            raise ScheduleError(f"FusedRMSNorm.from_module(): {type(norm).__name__} is not a Llama-style RMSNorm "
                                "(a 1-D weight and a float variance_epsilon)")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.weight, fused.variance_epsilon = weight, eps
        return fused

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of a fused ``[gate | up]`` projection output, keeping only that input:
    autograd over the plain formula keeps ``silu(gate)`` too (the product's other factor); backward
    recomputes it. (The product itself is what the down projection saves.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate_width: int) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.gate_width = gate_width
        gate, up = x.split([gate_width, x.shape[-1] - gate_width], dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        gate, up = x.split([ctx.gate_width, x.shape[-1] - ctx.gate_width], dim=-1)
        # the same operations autograd runs for F.silu(gate) * up, so the same values
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return torch.cat([grad_gate, grad * F.silu(gate)], dim=-1), None


def swiglu(x: torch.Tensor, gate_width: int) -> torch.Tensor:
    """``silu(x[..., :gate_width]) * x[..., gate_width:]``, keeping only ``x`` for backward."""
    return _SwiGLU.apply(x, gate_width)


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate) * up)`` over one fused ``gate_up_proj`` (a layer with ``split_sizes``
    ``[gate, up]``, as :func:`~slapo_tune.fuse_linears` makes; a column-parallel shard keeps both
    halves of its slice, with ``split_sizes`` divided), through :func:`swiglu`: Hugging Face's
    Llama MLP after ``fuse=on``'s projection fusion, with less memory kept."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        sizes = getattr(gate_up_proj, "split_sizes", None)
        if sizes is None or len(sizes) != 2:
            raise ScheduleError("SwiGLUMLP: gate_up_proj must be one projection fused from two, [gate | up] "
                                "(split_sizes of two parts)")
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x), self.gate_up_proj.split_sizes[0]))


__all__ = ["FusedMLP", "Attention", "AttentionCore", "Print", "LinearWithSyncFunc", "all_reduce", "all_to_all",
           "ACTIVATIONS", "FusedRMSNorm", "SwiGLUMLP", "rms_norm", "swiglu"]
