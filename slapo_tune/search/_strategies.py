"""Search strategies: which point to try next. Each is an Optuna sampler (see ``_samplers``, one
module per strategy, which imports Optuna: it is loaded only when a tuner is built, not by the
CLI's argument parsing)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..errors import UsageError
from ..space import Point, Space, point_key
from ._known import Known, KnownReader

if TYPE_CHECKING:
    from optuna import Study
    from optuna.samplers import BaseSampler

    from ..cost_model import Predictions
    from ..cost_model.ranking import Fitting
    from ..problem import Problem

STRATEGIES = ("guided", "tpe", "grid", "random", "frontier", "model")
DEFAULT_STRATEGY = "guided"


class Strategy(Protocol):
    """What the driver needs of a strategy besides Optuna's sampler interface."""

    def is_exhausted(self, study: Study) -> bool:
        """True when the strategy has no point left to propose."""


def make_strategy(name: str, problem: Problem, seed: int = 0,
                  predict: Callable[[list[Point]], Predictions] | None = None,
                  known: KnownReader | None = None,
                  fitting: Callable[[], Fitting] | None = None) -> BaseSampler:
    """The Optuna sampler of strategy ``name``, a :class:`Strategy` too (``predict``: the cost
    model's predictions of a list of points, evaluated together (:meth:`CostModel.predictions`):
    the ``model`` strategy orders by their throughputs, ``guided`` starts from them and reads their
    peaks; ``fitting``: the points of the space the analytic verdict lets through, with their
    predictions (``cost_model.ranking.fitting_points``), which those two then rank instead of
    predicting the whole space; ``known``: the reader of the study the caller already keeps, which the ordered
    strategies then share)."""
    # optuna-free: every --help imports this module (the tune command imports the tuner); _samplers imports optuna
    from . import _samplers

    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy '{name}' (choose from {', '.join(STRATEGIES)})")
    if name == "tpe":
        return _samplers.TPE(seed)
    if name == "random":
        return _samplers.RandomSearch(seed)
    if name in ("model", "guided"):
        if predict is None:
            raise UsageError(f"the '{name}' strategy needs the cost model")
        if name == "guided":
            return _samplers.Guided(problem, seed, predict, known, fitting)
        return _samplers.ModelRanked(problem, seed, predict, known, fitting)
    return {"grid": _samplers.Grid, "frontier": _samplers.Frontier}[name](problem, seed, known)


# a space of at most this many points is listed (uniform over the points left, a second or less);
# a larger one is walked, at most RANDOM_WALKS times, before it is listed (see random_unknown)
LISTED_POINTS = 100_000
RANDOM_WALKS = 64


def random_unknown(space: Space, known: Known, seed: int) -> Point | None:
    """A random point not tried yet (when a sampler keeps proposing known ones). A space of at most
    :data:`LISTED_POINTS` points (:meth:`Space.count`, which lists none) is listed and a point
    left drawn uniformly. A larger one (a large model's: millions of points, whose listing and
    keying took 10 s per call, several times a search) is walked down its knobs, each value drawn
    among those that keep the point completable (:meth:`Space.legal_values`), up to
    :data:`RANDOM_WALKS` times; only if every walk meets a tried point is it listed."""
    tried = known.status.keys() | known.running.keys()
    rng = random.Random(seed + len(tried))
    if space.count() > LISTED_POINTS:
        for _ in range(RANDOM_WALKS):
            point: Point = {}
            for knob in space.knobs:
                point[knob.name] = rng.choice(space.legal_values(knob.name, point))
            if point_key(point) not in tried:
                return point
    left = [p for p in space.enumerate() if point_key(p) not in tried]
    return rng.choice(left) if left else None
