"""The strategies as Optuna samplers (built by :func:`._strategies.make_strategy`).

``tpe`` and ``random`` are Optuna's own samplers, choosing knob by knob through
:meth:`Space.suggest`; out-of-memory and pruned points reach them as infeasible (a positive
``memory`` constraint, set with ``Trial.set_constraint``, which TPE reads).

``grid``, ``model`` and ``frontier`` choose whole points, in an order of their own, from what the
study knows: an :class:`OrderedSampler` works out its next point once per trial, from the study's
told trials and the points of its running ones, and answers each knob Optuna asks for with that
point's value.

Every strategy's sampler answers :meth:`is_exhausted` (as Optuna's ``GridSampler`` does), so the
driver stops when a strategy has nothing left without asking which kind it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import optuna
from optuna import Study
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial

from ..plan import Plan, TrialStatus
from ..problem import Problem
from ..space import Point, point_key
from ._known import Known, KnownReader


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


class OrderedSampler(optuna.samplers.BaseSampler):
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

    # ---------------------------------------------------------------- Optuna's sampler interface
    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if self._asked is None or self._asked[0] != trial.number:  # the trial's first knob: choose its point
            self._asked = (trial.number, self._next_of(study))
        point = self._asked[1]
        if point is None:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        return point[param_name.split("|")[0]]  # "pp|tp=2": knob pp, qualified (Space.param_name)


class Grid(OrderedSampler):
    """Every legal point, in the space's order."""


class ModelRanked(OrderedSampler):
    """Best predicted throughput first (the cost model's ranking; pruned points never appear)."""

    def __init__(self, problem: Problem, seed: int = 0, rank: Callable[[Point], float] | None = None,
                 known: KnownReader | None = None) -> None:
        super().__init__(problem, seed, known)
        self.rank = rank
        self._order: list[Point] | None = None

    def ordering(self) -> Iterable[Point]:
        if self._order is None:  # ranking every point costs a cost-model call each: once
            self._order = sorted(self.space.enumerate(), key=lambda p: -self.rank(p))
        return self._order


class Frontier(OrderedSampler):
    """Slapo's walk along the out-of-memory frontier: for each setting of the other knobs, the
    largest micro-batch first and the least checkpointing that fits it. A point is skipped when a
    known result settles it: a smaller-or-equal micro-batch with more-or-equal checkpointing ran
    out of memory (so this point, needing at least as much, cannot fit either), or the same
    micro-batch already fits with less checkpointing (so it can only be slower)."""

    def __init__(self, problem: Problem, seed: int = 0, known: KnownReader | None = None) -> None:
        super().__init__(problem, seed, known)
        self._walk: list[list[tuple[str, Point, Plan]]] | None = None  # groups, each in walking order
        self._where: dict[str, tuple[int, Plan]] = {}  # point key -> (its group's index, its plan)

    @staticmethod
    def _others(plan: Plan) -> Plan:
        """The plan's other knobs (its group): micro-batch and checkpointing blanked."""
        return replace(plan, micro_batch=0, ckpt_ratio=0.0)

    def _groups(self) -> list[list[tuple[str, Point, Plan]]]:
        if self._walk is None:  # the space is fixed: group and sort it once
            groups: dict[Plan, list[tuple[str, Point, Plan]]] = {}
            for point in self.space.enumerate():
                plan = Plan.of(point, self.problem.workload)
                groups.setdefault(self._others(plan), []).append((point_key(point), point, plan))
            self._walk = [sorted(members, key=lambda m: (-m[2].micro_batch, m[2].ckpt_ratio))
                          for members in groups.values()]
            self._where = {key: (i, plan) for i, members in enumerate(self._walk) for key, _, plan in members}
        return self._walk

    def next_point(self, known: Known) -> Point | None:
        walk = self._groups()
        outcomes: dict[int, list[tuple[int, float, TrialStatus]]] = {}
        for key, status in known.status.items():
            if key in self._where:
                group, plan = self._where[key]
                outcomes.setdefault(group, []).append((plan.micro_batch, plan.ckpt_ratio, status))
        for group, members in enumerate(walk):
            seen = outcomes.get(group, [])
            for key, point, plan in members:
                if key in known:
                    continue
                mb, ck = plan.micro_batch, plan.ckpt_ratio
                if any(s.infeasible and m <= mb and c >= ck for m, c, s in seen):
                    continue
                if any(s is TrialStatus.OK and m == mb and c < ck for m, c, s in seen):
                    continue
                return point
        return None
