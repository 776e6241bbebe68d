"""Rank functions for the context-parallelism tests (run in spawned processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _Attn(torch.nn.Module):  # what the attention function reads off the module
    num_key_value_groups = 2
    is_causal = True


def run_attention(ctx, kernel):
    """The cp attention function on this rank's chunk of q, k, v (K/V heads half the query heads)
    against causal SDPA of the whole sequence (same seed on every rank): output and q/k/v gradients."""
    import torch.distributed as dist
    from transformers import AttentionInterface

    from slapo_tune.parallel._context_parallel import CP_ATTENTION, chunk_positions, context, register

    register()
    fn = AttentionInterface()[CP_ATTENTION[kernel]]
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 12, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64) for n in (h, h // 2, h // 2))
    dout = torch.randn(b, s, h, d, dtype=torch.float64)
    whole = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(2, dim=1) for t in whole[1:])
    ref = F.scaled_dot_product_attention(whole[0], kk, vv, is_causal=True).transpose(1, 2)
    (ref * dout).sum().backward()
    size, rank = ctx.world_size, ctx.rank
    rows = chunk_positions(s, rank, size)  # two chunks: an early and a late one
    local = [t[:, :, rows].clone().requires_grad_(True) for t in (q, k, v)]
    module = _Attn().eval()
    with context(dist.group.WORLD, rank, size):
        out, _ = fn(module, *local, None, scaling=d ** -0.5)
    (out * dout[:, rows]).sum().backward()
    return {"out": (out - ref[:, rows]).abs().max().item(),
            **{f"grad_{n}": (a.grad - w.grad[:, :, rows]).abs().max().item()
               for n, a, w in zip("qkv", local, whole, strict=True)}}
