"""The tuner: a driver-side Optuna search (ask/tell) over a template's space, pruned by the cost
model, with trials on a runner (local processes or a Ray cluster), resumable from its storage."""

from ._driver import TuneConfig, Tuner
from ._strategies import DEFAULT_STRATEGY, STRATEGIES, make_strategy

__all__ = ["DEFAULT_STRATEGY", "STRATEGIES", "TuneConfig", "Tuner", "make_strategy"]
