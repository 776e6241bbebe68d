"""``tpe`` and ``random``: Optuna's own samplers, choosing knob by knob through :meth:`Space.suggest`;
out-of-memory and pruned points reach them as infeasible (a positive constraint, which TPE reads)."""

from __future__ import annotations

import optuna
from optuna import Study


class _ChoosesFreely:
    """Optuna's own samplers never run out by themselves: when every point is known they keep
    proposing known ones, and the driver's fallback (a random unknown point) finds none left."""

    def is_exhausted(self, study: Study) -> bool:
        return False


class TPE(_ChoosesFreely, optuna.samplers.TPESampler):
    """Optuna's TPE, modelling after five random trials (Optuna's default is ten)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed=seed, n_startup_trials=5)


class RandomSearch(_ChoosesFreely, optuna.samplers.RandomSampler):
    """Optuna's random sampler."""
