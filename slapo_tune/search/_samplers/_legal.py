"""The sampler a study asks, around a strategy: each knob's value kept legal given the earlier knobs."""

from __future__ import annotations

from typing import Any

import numpy as np
import optuna
from optuna import Study
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial

from ...space import Space
from ._base import PerKnob


class LegalDomains(PerKnob):
    """The sampler a study asks, around a strategy. Each knob is one Optuna parameter whose
    distribution is every value the knob takes anywhere in the space (:meth:`Space.domain`), while
    the values legal at a trial depend on its earlier knobs (``pp`` must divide ``world / tp``). A
    value the strategy proposes outside them is drawn again: Optuna's samplers draw at random, so
    redrawing keeps their preferences among the legal values (uniform ones for ``random``); after
    ``REDRAWS`` draws a legal value is taken at random. The ordered strategies propose legal
    points, which pass at once. Sampling is per knob (Optuna's independent sampling: TPE's default)."""

    REDRAWS = 32

    def __init__(self, strategy: optuna.samplers.BaseSampler, space: Space, seed: int = 0) -> None:
        self.strategy, self.space = strategy, space
        self._rng = np.random.RandomState(seed)

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        legal = self.space.legal_given(param_name, trial.params)
        for _ in range(self.REDRAWS):
            value = self.strategy.sample_independent(study, trial, param_name, param_distribution)
            if value in legal:
                return value
        return legal[self._rng.randint(len(legal))]

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self.strategy.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state, values) -> None:
        self.strategy.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.strategy.reseed_rng()
        self._rng.seed()
