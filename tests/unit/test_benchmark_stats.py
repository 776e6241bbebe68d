"""The statistics benchmarks report: runs that miss a target count, variant order is shuffled."""

from __future__ import annotations

import pytest

from benchmarks._stats import censored, round_orders


def test_a_run_that_missed_counts_as_worse_than_every_run_that_reached():
    # over the successes only, the median would be 2: three of five runs never got there
    assert censored([1, 2, None, 3, None]) == {"median": 3, "p25": 2, "p75": None, "reached": 0.6}
    assert censored([1, 2, None, None, None])["median"] is None  # most runs missed: "not reached"
    assert censored([4, 1, 3, 2]) == {"median": pytest.approx(2.5), "p25": pytest.approx(1.75),
                                      "p75": pytest.approx(3.25), "reached": 1.0}


def test_variants_run_in_a_shuffled_order_that_every_rank_draws_alike():
    names = ["tuned", "out of the box", "made to fit"]
    orders = round_orders(names, 12)
    assert orders == round_orders(names, 12)  # the same on every rank of a launch
    assert all(sorted(order) == sorted(names) for order in orders)
    assert {order[0] for order in orders} == set(names)  # none always first
