"""Drivers on one shared study (sqlite, a journal, a real PostgreSQL server): started together as
processes of their own, over a recorded grid replayed (no training runs), they launch no point
twice. Apart from the replayed strategies of tests/unit/test_search.py because it starts processes
and a database server."""

from __future__ import annotations

import pytest

from benchmarks.search_strategies import load_grid
from slapo_tune.space import point_key


@pytest.mark.parametrize("storage,strategy", [("sqlite", "guided"), ("journal", "tpe"), ("postgresql", "guided")])
def test_two_drivers_on_one_study_launch_no_point_twice(tmp_path, request, storage, strategy):
    """Two drivers started together on one study, with one seed: a point is launched by the
    driver whose trial named it first (each waits for the other's earlier trials to name theirs),
    so no point runs twice; both report the whole study's best. PostgreSQL: a new database of the
    session's real server (both drivers create its tables at once)."""
    import multiprocessing

    from _search_workers import drive

    if storage == "postgresql":
        url = request.getfixturevalue("postgres").create_database("two_drivers")
    else:
        url = f"sqlite:///{tmp_path / 'study.db'}" if storage == "sqlite" else f"journal:{tmp_path / 'study.journal'}"
    context = multiprocessing.get_context("spawn")
    queue, barrier = context.Queue(), context.Barrier(2)
    drivers = [context.Process(target=drive, args=(url, str(tmp_path / f"out{i}"), strategy, 0, 8, queue, barrier))
               for i in range(2)]
    try:
        for d in drivers:
            d.start()
        reports = [queue.get(timeout=300) for _ in drivers]
        assert not [r for r in reports if r[0] == "failed"], [r[1] for r in reports if r[0] == "failed"]
        for d in drivers:
            d.join(timeout=60)
    finally:
        for d in drivers:  # ended by PID, whatever happened
            if d.is_alive():
                d.kill()
                d.join()
    launched = [point_key(p) for points, _ in reports for p in points]
    assert all(points for points, _ in reports)  # both drivers ran trials
    assert len(launched) == len(set(launched)), launched
    # each crowns the study's best when it ends (the other's trials too): the last, the best of all
    results, _ = load_grid()
    speed = {point_key(r.knobs): r.samples_per_s or 0.0 for r in results}
    own = [max(speed[point_key(p)] for p in points) for points, _ in reports]
    assert all(best >= mine for (_, best), mine in zip(reports, own)) and max(b for _, b in reports) == max(own)
