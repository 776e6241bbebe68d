"""Training data: seeded synthetic token batches (the default), or tokens from a local file."""

from __future__ import annotations

import torch

from .errors import UsageError


def synthetic_batch(vocab_size: int, global_batch: int, seq_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A global batch of random token ids (the same on every rank for a given seed)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (global_batch, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


SYNTHETIC = "synthetic"
_STRIDES = (1, 2, 3, 5, 7)


class TrainingData:
    """The batch of every training step, a pure function of (source, seed, step).

    Any step's batch can be produced without the ones before it, so a resumed job sees exactly the
    batches an uninterrupted one would have. ``synthetic``: learnable sequences (each row counts
    from a random token with a random small stride, modulo the vocabulary), so the loss falls. A
    ``.npy`` file: a 1-D array of token ids. Any other file: text, one token per byte (a byte-level
    tokenizer; needs a vocabulary of at least 256). Windows start at seeded random offsets.
    """

    def __init__(self, source: str, vocab_size: int, global_batch: int, seq_len: int, seed: int = 0):
        self.source, self.vocab_size = source, vocab_size
        self.global_batch, self.seq_len, self.seed = global_batch, seq_len, seed
        self.tokens = None if source == SYNTHETIC else _load_tokens(source, vocab_size, seq_len)

    def _generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + step)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        g = self._generator(step)
        b, s = self.global_batch, self.seq_len
        if self.tokens is None:
            start = torch.randint(0, self.vocab_size, (b, 1), generator=g)
            stride = torch.tensor(_STRIDES)[torch.randint(0, len(_STRIDES), (b, 1), generator=g)]
            ids = (start + stride * torch.arange(s)) % self.vocab_size
        else:
            offsets = torch.randint(0, len(self.tokens) - s + 1, (b,), generator=g)
            ids = torch.stack([self.tokens[o:o + s] for o in offsets.tolist()])
        return {"input_ids": ids, "labels": ids.clone()}


def _load_tokens(path: str, vocab_size: int, seq_len: int) -> torch.Tensor:
    from pathlib import Path

    import numpy as np

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"data file {path} does not exist (or pass --data synthetic)")
    if file.suffix == ".npy":
        try:
            array = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UsageError(f"data file {path} is not a readable .npy array: {exc}") from None
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise UsageError(f"data file {path}: expected a 1-D integer array of token ids, got "
                             f"{array.ndim}-D {array.dtype}")
        tokens = torch.from_numpy(array.astype(np.int64))
    else:
        if vocab_size < 256:
            raise UsageError(f"data file {path}: text is tokenized one byte per token, which needs a vocabulary "
                             f"of at least 256 (the model has {vocab_size}); pass token ids as a .npy file")
        tokens = torch.frombuffer(bytearray(file.read_bytes()), dtype=torch.uint8).long()
    if len(tokens) < seq_len:
        raise UsageError(f"data file {path} has {len(tokens)} tokens, fewer than one sequence ({seq_len})")
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise UsageError(f"data file {path} has token ids outside the vocabulary [0, {vocab_size})")
    return tokens
