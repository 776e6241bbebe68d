"""Strategies that choose whole points in an order of their own: the base (:class:`OrderedSampler`),
``grid`` (the space's order) and ``model`` (the cost model's ranking)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np
import optuna
from optuna import Study
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial

from ...problem import Problem
from ...space import Point, point_key
from .._known import Known, KnownReader
from ._base import FittingPoints, PerKnob, Predict


class OrderedSampler(PerKnob):
    """Proposes the first point of :meth:`ordering` that is neither told nor running (subclasses
    may instead override :meth:`next_point`)."""

    def __init__(self, problem: Problem, seed: int = 0, known: KnownReader | None = None) -> None:
        self.problem, self.space = problem, problem.space
        self._known = known or KnownReader()  # the driver passes its own: one cache of the study
        self._next: tuple[Any, Point | None] | None = None  # (what it was worked out from, the point)
        self._asked: tuple[int, Point | None] | None = None  # (trial number, the point it is given)
        # asked while nothing is left (the driver checks is_exhausted first): any legal value,
        # as Optuna's GridSampler samples again once its grid is exhausted
        self._fallback = optuna.samplers.RandomSampler(seed=seed)

    def ordering(self) -> Iterable[Point]:
        return self.space.enumerate()

    def next_point(self, known: Known) -> Point | None:
        """The next point to try, or None when nothing is left."""
        return next((p for p in self.ordering() if point_key(p) not in known), None)

    def is_exhausted(self, study: Study) -> bool:
        return self._next_of(study) is None

    def _next_of(self, study: Study) -> Point | None:
        known = self._known(study)
        # the driver asks "exhausted?" and then samples the same point: work it out once
        version = (known.read, frozenset(known.running))
        if self._next is None or self._next[0] != version:
            self._next = (version, self.next_point(known))
        return self._next[1]

    # ---------------------------------------------------------------- Optuna's sampler interface (per knob)
    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if self._asked is None or self._asked[0] != trial.number:  # the trial's first knob: choose its point
            self._asked = (trial.number, self._next_of(study))
        point = self._asked[1]
        if point is None:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        return point[param_name]


class Grid(OrderedSampler):
    """Every legal point, in the space's order."""


class ModelRanked(OrderedSampler):
    """Best predicted throughput first (the cost model's ranking; pruned points never appear)."""

    def __init__(self, problem: Problem, seed: int = 0, predict: Predict | None = None,
                 known: KnownReader | None = None, fitting: FittingPoints | None = None) -> None:
        super().__init__(problem, seed, known)
        self.predict, self.fitting = predict, fitting
        self._order: list[Point] | None = None
        self._ranked: set[str] = set()  # the keys of the points of _order

    def ordering(self) -> Iterable[Point]:
        """The points predicted to run (that fit), fastest first (ties in the space's order), then
        the others in the space's order, as a stable sort of the whole space by its predicted
        throughputs orders them (0 where a point cannot fit). Where the points that may fit are
        given (``fitting``), only those are ranked (a large model's space is not listed and
        predicted) and the others follow, walked only once every ranked point is known."""
        if self._order is None:  # predicted once; ties in the space's order
            if self.fitting is not None:
                found = self.fitting()
                points, throughputs = found.points, found.predictions.throughputs
            else:
                points = list(self.space.enumerate())
                throughputs = self.predict(points).throughputs
            self._order = [points[i] for i in np.argsort(-throughputs, kind="stable").tolist() if throughputs[i] > 0]
            self._ranked = {point_key(p) for p in self._order}
        return itertools.chain(self._order, (p for p in self.space.enumerate() if point_key(p) not in self._ranked))
