"""``frontier``: Slapo's walk along the out-of-memory frontier."""

from __future__ import annotations

from collections.abc import Iterable

from ...plan import TrialStatus
from ...problem import Problem
from ...space import Point, point_key
from .._known import Known, KnownReader
from ._ordered import OrderedSampler


def frontier_group(point: Point) -> tuple:
    """A point's frontier group: its knobs other than its micro-batch size and checkpointing (the
    values alone: the points of one space have the same knobs, in one order)."""
    return tuple(v for k, v in point.items() if k not in ("micro_batch", "ckpt_ratio"))


def beyond_the_frontier(micro_batch: int, ckpt_ratio: float, seen: Iterable[tuple[int, float, TrialStatus]]) -> bool:
    """A known result of the same group says a point cannot fit: a smaller-or-equal micro-batch
    with more-or-equal checkpointing ran out of memory (or was pruned), so this point, needing at
    least as much memory, cannot fit either."""
    return any(s.infeasible and m <= micro_batch and c >= ckpt_ratio for m, c, s in seen)


class Frontier(OrderedSampler):
    """Slapo's walk along the out-of-memory frontier: for each setting of the other knobs, the
    largest micro-batch first and the least checkpointing that fits it. A point is skipped when a
    known result settles it: it is beyond the frontier (:func:`beyond_the_frontier`), or the same
    micro-batch already fits with less checkpointing (so it can only be slower)."""

    def __init__(self, problem: Problem, seed: int = 0, known: KnownReader | None = None) -> None:
        super().__init__(problem, seed, known)
        self._walk: list[list[tuple[str, Point]]] | None = None  # groups, each in walking order
        self._where: dict[str, tuple[int, int, float]] = {}  # point key -> (its group's index, mb, ckpt)

    def _groups(self) -> list[list[tuple[str, Point]]]:
        if self._walk is None:  # the space is fixed: group and sort it once
            groups: dict[tuple, list[tuple[str, Point]]] = {}
            for point in self.space.enumerate():
                groups.setdefault(frontier_group(point), []).append((point_key(point), point))
            self._walk = [sorted(members, key=lambda m: (-m[1]["micro_batch"], m[1]["ckpt_ratio"]))
                          for members in groups.values()]
            self._where = {key: (i, point["micro_batch"], point["ckpt_ratio"])
                           for i, members in enumerate(self._walk) for key, point in members}
        return self._walk

    def next_point(self, known: Known) -> Point | None:
        walk = self._groups()
        outcomes: dict[int, list[tuple[int, float, TrialStatus]]] = {}
        for key, status in known.status.items():
            if key in self._where:
                group, mb, ck = self._where[key]
                outcomes.setdefault(group, []).append((mb, ck, status))
        for group, members in enumerate(walk):
            seen = outcomes.get(group, [])
            for key, point in members:
                if key in known:
                    continue
                mb, ck = point["micro_batch"], point["ckpt_ratio"]
                if beyond_the_frontier(mb, ck, seen):
                    continue
                if any(s is TrialStatus.OK and m == mb and c < ck for m, c, s in seen):
                    continue
                return point
        return None
