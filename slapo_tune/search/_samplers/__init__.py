"""The strategies as Optuna samplers (built by :func:`._strategies.make_strategy`).

``tpe`` and ``random`` are Optuna's own samplers, choosing knob by knob through
:meth:`Space.suggest`; out-of-memory and pruned points reach them as infeasible (a positive
constraint, which TPE reads). The study asks every strategy through :class:`LegalDomains`, which
keeps each knob's value legal given the earlier knobs.

``grid``, ``model``, ``frontier`` and ``guided`` choose whole points, in an order of their own, from what the
study knows: an :class:`OrderedSampler` works out its next point once per trial, from the study's
told trials and the points of its running ones, and answers each knob Optuna asks for with that
point's value.

Every strategy's sampler answers :meth:`is_exhausted` (as Optuna's ``GridSampler`` does), so the
driver stops when a strategy has nothing left without asking which kind it has.
"""

from ._base import FittingPoints, PerKnob, Predict
from ._free import TPE, RandomSearch
from ._frontier import Frontier, beyond_the_frontier, frontier_group
from ._guided import SPREADS, Guided, log_expected_improvement, recomputes_less
from ._legal import LegalDomains
from ._ordered import Grid, ModelRanked, OrderedSampler

__all__ = ["SPREADS", "TPE", "FittingPoints", "Frontier", "Grid", "Guided", "LegalDomains", "ModelRanked", "OrderedSampler",
           "PerKnob", "Predict", "RandomSearch", "beyond_the_frontier", "frontier_group", "log_expected_improvement",
           "recomputes_less"]
