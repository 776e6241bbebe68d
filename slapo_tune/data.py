"""Training data: seeded synthetic token batches (the default), or tokens from a local file."""

from __future__ import annotations

import torch


def synthetic_batch(vocab_size: int, global_batch: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A global batch of random token ids (the same on every rank for a given seed)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (global_batch, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
