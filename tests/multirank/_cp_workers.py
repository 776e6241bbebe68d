"""Rank functions for the context-parallelism tests (run in spawned processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

SEQ = 24  # 2 x cp divides it at cp 2, 3 and 4


class _Attn(torch.nn.Module):  # what the attention function reads off the module
    num_key_value_groups = 2
    is_causal = True


class _FlashCalls(TorchDispatchMode):
    """Records the query-key pairs of each fused CPU flash-attention forward call (a causal call on
    its square block computes the lower triangle) and whether any call was given a mask."""

    def __init__(self):
        super().__init__()
        self.pairs, self.masked = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            q_len, k_len = args[0].shape[2], args[1].shape[2]
            causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
            assert not causal or q_len == k_len
            self.pairs += q_len * (q_len + 1) // 2 if causal else q_len * k_len
            self.masked |= kwargs.get("attn_mask") is not None
        return func(*args, **kwargs)


def run_attention(ctx, kernel, dropout=0.0):
    """The cp attention function on this rank's chunk of q, k, v (K/V heads half the query heads)
    against causal SDPA of the whole sequence (same seed on every rank): output and q/k/v gradients
    (without dropout), the longest sequence among the tensors autograd saved for the backward, and
    the query-key pairs the fused kernels computed (per batch row and head: each call does all)."""
    import torch.distributed as dist
    from transformers import AttentionInterface

    from slapo_tune.parallel._context_parallel import CP_ATTENTION, chunk_positions, context, register

    register()
    fn = AttentionInterface()[CP_ATTENTION[kernel]]
    torch.manual_seed(0)
    b, h, s, d = 2, 4, SEQ, 4  # head_dim below a rank's tokens: saved shapes tell the sequence
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64) for n in (h, h // 2, h // 2))
    dout = torch.randn(b, s, h, d, dtype=torch.float64)
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(2, dim=1) for t in whole[1:])
    ref = F.scaled_dot_product_attention(whole[0], kk, vv, is_causal=True).transpose(1, 2)
    (ref * dout).sum().backward()
    size, rank = ctx.world_size, ctx.rank
    rows = chunk_positions(s, rank, size)  # two chunks: an early and a late one
    local = [t[:, :, rows].clone().requires_grad_(True) for t in (q, k, v)]
    module = _Attn().train(dropout > 0)
    saved = []
    calls = _FlashCalls()
    with context(dist.group.WORLD, rank, size), calls, \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out, _ = fn(module, *local, None, scaling=d ** -0.5, dropout=dropout)
    (out * dout[:, rows]).sum().backward()
    # [batch, heads, ...]: the longer of the last two dims (keys transposed for a matmul, scores)
    result = {"saved_seq": max(max(shape[2:]) for shape in saved if len(shape) == 4),
              "pairs": calls.pairs, "masked": calls.masked}
    if dropout == 0:
        result["errors"] = {"out": (out - ref[:, rows]).abs().max().item(),
                            **{f"grad_{n}": (a.grad - w.grad[:, :, rows]).abs().max().item()
                               for n, a, w in zip("qkv", local, whole, strict=True)}}
    return result


def _bind(op, args, kwargs) -> dict:
    """``args`` and ``kwargs`` bound to the names of ``op``'s real schema, each checked against its
    declared type (positional ones where the schema has them, every argument without a default given)."""
    schema = op.default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), (schema.name, len(args))
    bound = {a.name: value for a, value in zip(positional, args)}
    assert not set(kwargs) - {a.name for a in schema.arguments if a.kwarg_only}, (schema.name, kwargs)
    bound.update(kwargs)
    kinds = {"Tensor": torch.Tensor, "float": float, "bool": bool, "int": int, "Optional[float]": (float, type(None))}
    for a in schema.arguments:
        assert a.name in bound or a.has_default_value(), (schema.name, a.name)
        if a.name in bound:
            assert isinstance(bound[a.name], kinds[str(a.type)]), (schema.name, a.name, type(bound[a.name]))
    return bound


def run_cuda_kernels_on_cpu(ctx):
    """The CUDA flash path's calls, made on CPU tensors: torch's CUDA flash-attention ops replaced
    by stand-ins that bind every call to the real ops' schemas and compute with the CPU kernels
    (the state the forward returns must come back to the backward unchanged). Output and gradients
    against causal SDPA of the whole sequence, as :func:`run_attention`."""
    from slapo_tune.parallel import _context_parallel as cp

    forward_op = torch.ops.aten._scaled_dot_product_flash_attention
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_backward
    issued = {}

    def forward(*args, **kwargs):
        b = _bind(forward_op, args, kwargs)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            b["query"], b["key"], b["value"], b["dropout_p"], b["is_causal"], scale=b.get("scale"))
        state = (torch.zeros(1), torch.zeros(1), b["query"].shape[2], b["key"].shape[2], torch.zeros(2), torch.zeros(1))
        issued[id(state[0])] = state
        return (out, lse, *state, torch.empty(0))

    def backward(*args, **kwargs):
        b = _bind(backward_op, args, kwargs)
        state = issued[id(b["cum_seq_q"])]
        assert (b["cum_seq_k"], b["max_q"], b["max_k"], b["philox_seed"], b["philox_offset"]) == state[1:]
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            b["grad_out"], b["query"], b["key"], b["value"], b["out"], b["logsumexp"], b["dropout_p"],
            b["is_causal"], scale=b.get("scale"))

    # (this spawned rank's own torch: nothing else sees the stand-ins)
    torch.ops.aten._scaled_dot_product_flash_attention = forward
    torch.ops.aten._scaled_dot_product_flash_attention_backward = backward
    cp._flash_kernels = lambda query: cp._CudaFlash()
    result = run_attention(ctx, "sdpa")
    result["calls"] = len(issued)
    return result
