"""Data parallelism: replicated (ZeRO level 0) or sharded over the data-parallel ranks (levels 1-3).

Level 0 replicates the model; the runtime averages the gradients once per step, after gradient
accumulation, instead of wrapping the model in ``DistributedDataParallel``: no module paths change
and it composes with pipeline stages and tensor parallelism unchanged.

Levels 1-3 are FSDP2 (``fully_shard``) over the data-parallel mesh dimension, which accepts the
tensor-parallel local parameters as plain tensors and shards them over dp. At every level the
parameters, gradients and optimizer state are sharded *between* steps (FSDP2 keeps only shards);
the levels differ in what is whole during a step, as ZeRO's stages do:

* **1** (optimizer state): one unit per block, kept gathered from forward through backward
  (``reshard_after_forward=False``); the runtime turns gradient sync and resharding after backward
  off for all but the step's last micro-batch. Every parameter stays whole during the step and so
  does every gradient, fp32 once accumulated, until the last micro-batch's backward
  reduce-scatters them block by block: ZeRO-1's memory, with one all-gather and one
  reduce-scatter per block per step. Units per block rather than one for the stage because FSDP
  upcasts a unit's gradients to its reduce dtype in the unit's post-backward: a block's bf16
  gradients go as soon as its backward ends (Megatron's fp32 ``main_grad`` accumulation), instead
  of every bf16 gradient of the stage living until the whole backward ends.
* **2** (and gradients): one unit per block, kept gathered from forward through backward
  (``reshard_after_forward=False``); each block's gradients are reduce-scattered as soon as its
  backward ends, every micro-batch, so no whole gradient of the model is ever alive.
* **3** (and parameters): one unit per block, resharded after forward and gathered again for
  backward: only the running block (and the next, prefetched) is whole.

``ZeroRedundancyOptimizer`` is not used for level 1: it shards whole parameters unevenly, steps
replicated parameters (so bf16 training would keep every fp32 master weight on every rank) and
broadcasts each updated parameter; FSDP2 gives ZeRO-1's memory with one collective each way per
block, shares the state-dict and mixed-precision path of levels 2 and 3, and lets the pipeline
schedule handle every level alike. Under pipelining (pp > 1), torch's schedule turns gradient sync
and resharding after backward off until the step's last backward at every level (see
docs/cost-model.md): gradients and parameters of the stage stay whole until then.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from .._partition import GRADIENT_BUCKET_BYTES as _BUCKET_BYTES
from ._comm import group_size

ZERO_STAGES = (0, 1, 2, 3)


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
            # freed before the next bucket is concatenated: one bucket at a time, not two
            del flat
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


def shard_data_parallel(stage: nn.Module, blocks: Iterable[nn.Module], mesh, level: int = 3,
                        mp_policy=None) -> None:
    """Shard ``stage`` over the data-parallel ``mesh`` at ZeRO ``level`` 1, 2 or 3 (FSDP2; see the
    module docstring). ``blocks`` are the stage's repeated blocks (their own units at every level);
    the stage root takes what is left (embeddings, norms, head). ``mp_policy``: FSDP2's
    ``MixedPrecisionPolicy`` (None: compute in the parameters' dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if level not in ZERO_STAGES[1:]:
        raise ValueError(f"sharded data parallelism has levels 1, 2, 3; got {level}")
    options = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    for block in blocks:
        if any(True for _ in block.parameters()):
            fully_shard(block, reshard_after_forward=level == 3, **options)
    # the root (embeddings, final norm, head) stays gathered from forward to backward at every level:
    # backward starts with the head, so resharding it after forward would only gather it again
    fully_shard(stage, reshard_after_forward=False, **options)
