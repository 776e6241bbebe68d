"""Search strategies: which point to try next.

Two kinds. *Sampled* strategies (``tpe``, ``random``) let an Optuna sampler choose, knob by knob,
through :meth:`Space.suggest`; out-of-memory and pruned points reach the sampler as infeasible
(Optuna constraints). *Ordered* strategies (``grid``, ``model``, ``frontier``) choose the point
themselves from what is known so far; the driver enqueues it so Optuna still records it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from ..errors import UsageError
from ..space import Point, Space, point_key

STRATEGIES = ("tpe", "grid", "random", "frontier", "model")
INFEASIBLE = ("oom", "pruned")


class Strategy:
    name = "strategy"

    def __init__(self, space: Space, seed: int = 0, rank: Callable[[Point], float] | None = None):
        self.space, self.seed, self.rank = space, seed, rank

    def sampler(self, multi_objective: bool):
        """The Optuna sampler of a sampled strategy; ordered strategies enqueue their points."""
        import optuna

        return optuna.samplers.RandomSampler(seed=self.seed)

    def propose(self, known: Mapping[str, str]) -> Point | None:
        """Next point to try (``known``: point key -> status), or None to let the sampler choose."""
        return None


class TPE(Strategy):
    name = "tpe"

    def sampler(self, multi_objective: bool):
        import optuna

        # infeasible trials carry a positive "memory" constraint (Trial.set_constraint), which TPE reads
        return optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=5)


class RandomSearch(Strategy):
    name = "random"


class Grid(Strategy):
    """Every legal point, in the space's order."""

    name = "grid"

    def propose(self, known):
        return next((p for p in self.space.enumerate() if point_key(p) not in known), None)


class ModelRanked(Strategy):
    """Best predicted throughput first (the cost model's ranking; pruned points never appear)."""

    name = "model"

    def __init__(self, space, seed=0, rank=None):
        super().__init__(space, seed, rank)
        if rank is None:
            raise UsageError("the 'model' strategy needs the cost model")
        self._order: list[Point] | None = None

    def propose(self, known):
        if self._order is None:
            self._order = sorted(self.space.enumerate(), key=lambda p: -self.rank(p))
        return next((p for p in self._order if point_key(p) not in known), None)


class Frontier(Strategy):
    """Slapo's walk along the out-of-memory frontier: for each setting of the other knobs, the
    largest micro-batch first and the least checkpointing that fits it. A point is skipped when a
    known result settles it: a smaller-or-equal micro-batch with more-or-equal checkpointing ran
    out of memory (so this point, needing at least as much, cannot fit either), or the same micro-batch already fits with less
    checkpointing (so it can only be slower)."""

    name = "frontier"
    SIZE, CKPT = "micro_batch", "ckpt_ratio"

    def _group(self, p: Point) -> str:
        return point_key({k: v for k, v in p.items() if k not in (self.SIZE, self.CKPT)})

    def propose(self, known):
        outcomes: dict[str, list[tuple[int, float, str]]] = {}
        points = list(self.space.enumerate())
        by_key = {point_key(p): p for p in points}
        for key, status in known.items():
            p = by_key.get(key)
            if p is not None:
                outcomes.setdefault(self._group(p), []).append((p[self.SIZE], p[self.CKPT], status))
        groups: dict[str, list[Point]] = {}
        for p in points:
            groups.setdefault(self._group(p), []).append(p)
        for group, members in groups.items():
            seen = outcomes.get(group, [])
            for p in sorted(members, key=lambda q: (-q[self.SIZE], q[self.CKPT])):
                if point_key(p) in known:
                    continue
                mb, ck = p[self.SIZE], p[self.CKPT]
                if any(s in INFEASIBLE and m <= mb and c >= ck for m, c, s in seen):
                    continue
                if any(s == "ok" and m == mb and c < ck for m, c, s in seen):
                    continue
                return p
        return None


_BY_NAME = {cls.name: cls for cls in (TPE, RandomSearch, Grid, ModelRanked, Frontier)}


def make_strategy(name: str, space: Space, seed: int = 0, rank: Callable[[Point], float] | None = None) -> Strategy:
    if name not in _BY_NAME:
        raise UsageError(f"unknown strategy '{name}' (choose from {', '.join(STRATEGIES)})")
    return _BY_NAME[name](space, seed, rank)


def random_unknown(space: Space, known: Mapping[str, str], seed: int) -> Point | None:
    """A random point not tried yet (when a sampler keeps proposing known ones)."""
    left = [p for p in space.enumerate() if point_key(p) not in known]
    return random.Random(seed + len(known)).choice(left) if left else None
