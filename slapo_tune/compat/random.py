"""Slapo's ``slapo.random``: seeds per parallel rank and Megatron's RNG-state tracker.

:func:`set_random_seed` seeds Python, NumPy and torch with one seed per pipeline and data-parallel
rank (the same on every rank of a tensor-parallel group, so replicated dropout masks agree), and,
given a ``tp_rank``, seeds the tracker's ``"model-parallel-rng"`` state with a seed of its own
per tensor-parallel rank. ``with get_cuda_rng_tracker().fork():`` runs its body on that state (a
partitioned activation's dropout: each rank drops different elements) and then puts the default
state back where it was.

Slapo's tracker holds CUDA generator states. This one holds the states of the generator dropout
draws from: CUDA's where CUDA is available, else the CPU's (so the same schedules run on
CPU/gloo). :func:`tracker_aware` lets activation checkpointing replay the tracker's states too.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator

import numpy as np
import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's: any positive offset keeps the tp streams apart from the default one


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    """Seed the generator the tracker forks (torch.manual_seed seeds CUDA's as well)."""
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states, each seeded once; :meth:`fork` runs a block on one of them."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state mapping (the states themselves are never changed in place)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; the current state is left as it was."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state")
        if name in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        previous = _get_state()
        _manual_seed(seed)
        self.states_[name] = _get_state()
        _set_state(previous)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on state ``name`` (which advances), then restore the state it left."""
        if name not in self.states_:
            raise RuntimeError(f"RNG tracker: state {name!r} was never added; call set_random_seed(..., tp_rank=)")
        previous = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(previous)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (Slapo's name; see the module docstring for the generator it forks)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int, always_enable_tp_seed: bool = False) -> int:
    """Seed the default generator with ``seed`` (with the tensor-parallel seed instead if
    ``always_enable_tp_seed``: every dropout then differs across the tp group, as sequence
    parallelism needs) and the tracker's model-parallel state with ``seed + 2718 + tp_rank``;
    returns the latter."""
    tp_seed = seed + _TP_SEED_OFFSET + tp_rank
    _TRACKER.reset()
    _manual_seed(tp_seed if always_enable_tp_seed else seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, tp_seed)
    return tp_seed


def is_random_seed_set() -> bool:
    """Whether :func:`set_random_seed` gave the tracker its states."""
    return bool(_TRACKER.states_)


def set_random_seed(seed: int = 2013, dp_rank: int | None = None, pp_rank: int | None = None,
                    tp_rank: int | None = None, always_enable_tp_seed: bool = False) -> int:
    """Seed Python, NumPy and torch with ``seed + 100 * pp_rank + 10 * dp_rank`` (each pipeline
    stage and data-parallel replica draws its own numbers, a tensor-parallel group the same) and,
    given ``tp_rank``, the tracker (:func:`model_parallel_cuda_manual_seed`). Returns the seed."""
    if pp_rank is not None:
        seed += 100 * pp_rank
    if dp_rank is not None:
        seed += 10 * dp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if tp_rank is not None:
        model_parallel_cuda_manual_seed(seed, tp_rank, always_enable_tp_seed)
    return seed


def tracker_aware(function: Callable) -> Callable:
    """``function`` for activation checkpointing: every call after the first (a recomputation)
    runs with the tracker's states as they were at the first call, and leaves them as it found
    them, so dropout under ``fork()`` draws the same masks again. torch's checkpoint replays the
    default generators itself."""
    forward_states: dict[str, torch.Tensor] | None = None

    @functools.wraps(function)
    def run(*args, **kwargs):
        nonlocal forward_states
        if forward_states is None:
            forward_states = _TRACKER.get_states()
            return function(*args, **kwargs)
        current = _TRACKER.get_states()
        _TRACKER.set_states(forward_states)
        try:
            return function(*args, **kwargs)
        finally:
            _TRACKER.set_states(current)

    return run


__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker", "get_cuda_rng_tracker", "is_random_seed_set",
           "model_parallel_cuda_manual_seed", "set_random_seed", "tracker_aware"]
