"""Data parallelism: replicated (gradients averaged after backward) or sharded (ZeRO-3 via FSDP2).

Replication is a gradient all-reduce the runtime calls once per step, after gradient
accumulation, instead of a ``DistributedDataParallel`` wrapper: no module paths change and it
composes with pipeline stages and tensor parallelism unchanged. Sharding uses FSDP2
``fully_shard`` over the data-parallel mesh dimension, per block and then at the stage root; FSDP2
accepts the tensor-parallel local parameters as plain tensors and shards them over dp.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ._comm import group_size

ZERO_STAGES = (0, 3)
_BUCKET_BYTES = 32 * 2**20


def average_gradients(params: Iterable[torch.Tensor], group: ProcessGroup | None) -> None:
    """Average the gradients of ``params`` over ``group`` in buckets (all ranks, same order)."""
    size = group_size(group)
    if size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    nbytes = 0
    for g in grads + [None]:
        if g is not None:
            bucket.append(g)
            nbytes += g.numel() * g.element_size()
        if bucket and (g is None or nbytes >= _BUCKET_BYTES):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            flat /= size
            offset = 0
            for b in bucket:
                b.copy_(flat[offset: offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, nbytes = [], 0


def largest_module_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The repeated block list of a model: its ModuleList holding the most parameters."""
    best = None
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            n = sum(p.numel() for p in m.parameters())
            if n and (best is None or n > best[0]):
                best = (n, path, m)
    return None if best is None else (best[1], best[2])


def shard_data_parallel(stage: nn.Module, blocks: Iterable[nn.Module], mesh) -> None:
    """ZeRO-3: shard parameters, gradients and optimizer state over the dp mesh (FSDP2).

    Each block is its own unit (its parameters are gathered only while it runs), then the stage
    root takes what is left (embeddings, norms, head).
    """
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(stage, mesh=mesh)
