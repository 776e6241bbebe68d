"""Slapo's ``slapo.model_schedule.gpt2`` helpers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...errors import ShardingError
from ...schedule._schedule import state_of
from ..sharding import reduce_forward_output


def gen_embedding_hooks(sch, vocab_size: int) -> tuple[Callable, Callable]:
    """The ``fwd_pre`` and ``fwd_post`` hooks of a word embedding sharded along its vocabulary
    (``sch[path].shard("weight", axis=0)``), for ``sync(mode=..., sync_op_or_fn=hook)``.

    slapo-tune's ``shard`` already makes such an embedding look up only the ids in this rank's
    rows (others give zeros), which Slapo's pre-hook did by shifting and masking the ids; so the
    pre-hook only checks that the embedding it runs on is sharded so, over ``vocab_size`` rows,
    and the post-hook sums the ranks' partial lookups (gradients pass through)."""

    def fwd_pre_hook(module: nn.Module, _inputs) -> None:
        st = state_of(module)
        spec = st.shards.get("weight") if st is not None else None
        if not isinstance(module, nn.Embedding) or spec is None or spec.axis != 0:
            raise ShardingError("gen_embedding_hooks: the hooks go on an nn.Embedding whose weight is sharded "
                                "along the vocabulary (shard('weight', axis=0))")
        if spec.full_shape[0] != vocab_size:
            raise ShardingError(f"gen_embedding_hooks: vocab_size {vocab_size} differs from the embedding's "
                                f"{spec.full_shape[0]} rows")
        return None

    def fwd_post_hook(_module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
        return reduce_forward_output(output, sch.group)

    return fwd_pre_hook, fwd_post_hook


__all__ = ["gen_embedding_hooks"]
