"""What the samplers share: answering knob by knob, and the cost model's predictions they read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna
from optuna import Study
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial

from ...cost_model import Predictions
from ...cost_model.ranking import Fitting
from ...space import Point

# the cost model's predictions of a list of points, evaluated together (CostModel.predictions)
Predict = Callable[[list[Point]], Predictions]
# the points of the space the analytic verdict lets through, with their predictions as with the
# whole space (cost_model.ranking.fitting_points: a large model's space, without listing its
# millions of points)
FittingPoints = Callable[[], Fitting]


class PerKnob(optuna.samplers.BaseSampler):
    """A sampler that answers knob by knob (``sample_independent``) and samples nothing jointly."""

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}
