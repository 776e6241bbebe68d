"""The driver's escape when a sampler keeps proposing tried points (``search._strategies.random_unknown``):
a legal point not tried yet, found without listing a large space."""

from __future__ import annotations

import random

import pytest

from slapo_tune.plan import TrialStatus
from slapo_tune.problem import ProblemSpec
from slapo_tune.search import _strategies
from slapo_tune.search._known import Known
from slapo_tune.search._strategies import random_unknown
from slapo_tune.space import point_key


def _known(tried) -> Known:
    return Known(status={point_key(p): TrialStatus.OK for p in tried}, values={}, running={}, read=len(tried))


def test_a_large_space_gives_a_legal_untried_point_without_being_listed(monkeypatch):
    """Llama-7B on 64 ranks (millions of points): every draw is a legal point not among those tried,
    and the space is never listed (a listing took 10 s per call)."""
    space = ProblemSpec("llama-7b", 64, precision="bf16", device="cuda").resolve().space
    tried = [space.complete({})]
    listing = type(space).enumerate

    def enumerate_completions(self, prefix=None):  # a prefix's first completion is fine, the whole space is not
        if not prefix:
            pytest.fail("the space was listed")
        return listing(self, prefix)

    monkeypatch.setattr(type(space), "enumerate", enumerate_completions)
    drawn = [random_unknown(space, _known(tried), seed) for seed in range(5)]
    assert all(space.is_legal(p) and point_key(p) not in {point_key(t) for t in tried} for p in drawn)
    assert len({point_key(p) for p in drawn}) > 1  # random: the seeds draw different points


@pytest.mark.parametrize("walked", [False, True])
def test_the_last_untried_point_is_found_and_none_once_all_are_tried(monkeypatch, walked):
    """A small space (listed; and walked first, as a large one is): with every point but one tried
    the one left is found, with every point tried there is none."""
    if walked:
        monkeypatch.setattr(_strategies, "LISTED_POINTS", 0)
    space = ProblemSpec("gpt2-tiny", 1, global_batch=4, seq_len=32).resolve().space
    points = list(space.enumerate())
    assert len(points) > 8
    last = points[len(points) // 2]
    assert random_unknown(space, _known([p for p in points if p != last]), seed=0) == last
    assert random_unknown(space, _known(points), seed=0) is None


def test_a_small_space_draws_uniformly_among_the_points_left_as_recorded_searches_were_seeded():
    """At most LISTED_POINTS points: the draw is the seeded uniform choice among the points left in
    the space's order (the recorded grids' searches replay seed for seed)."""
    space = ProblemSpec("gpt2-tiny", 2, global_batch=8, seq_len=32).resolve().space
    points = list(space.enumerate())
    assert len(points) <= _strategies.LISTED_POINTS
    for seed in range(4):
        tried = points[seed:seed + 5]
        left = [p for p in points if p not in tried]
        assert random_unknown(space, _known(tried), seed) == random.Random(seed + len(tried)).choice(left)
