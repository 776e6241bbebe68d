"""The local launcher: results by rank, failures named by rank, nothing left behind."""

import multiprocessing.forkserver
import os
import time

import pytest

from slapo_tune.launch import RankFailure, launch

import _launch_workers as w


def test_results_come_back_by_rank(no_leftover_children):
    results = launch(w.echo, 2, args=("x",), timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 3.0 and r["value"] == "x" and r["world"] == 2 for r in results)
    assert all(r["pid"] != os.getpid() for r in results)
    assert all(r["threads"] == max(1, os.cpu_count() // 2) for r in results)


def test_cpu_ranks_fork_from_a_warm_server_with_the_launchers_environment(monkeypatch, no_leftover_children):
    """gloo ranks fork from a server that imported torch once (no 3-9 s re-import per rank), yet
    see the launcher's environment as it is at each launch, not as it was when the server started."""
    launch(w.echo, 2, args=("x",), timeout=120)
    monkeypatch.setenv("SLAPO_TEST_MARK", "set after the server started")
    results = launch(w.echo, 2, args=("x",), timeout=120)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert server is not None and all(r["parent"] == server != os.getpid() for r in results)
    assert all(r["mark"] == "set after the server started" for r in results)


def test_a_raising_rank_is_named_and_the_others_are_killed(no_leftover_children):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(w.raise_on_rank_one, 2, timeout=120)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "rank 1 raised ValueError: bad knob on rank 1" in str(info.value)
    assert "Traceback" in info.value.details
    assert time.monotonic() - t0 < 50  # rank 0 (sleeping 60 s) was killed, not waited for


def test_a_hanging_rank_times_out(no_leftover_children):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(w.hang, 2, timeout=8)
    assert info.value.kind == "timeout"
    assert time.monotonic() - t0 < 8 + 10


def test_a_killed_rank_is_a_crash(no_leftover_children):
    with pytest.raises(RankFailure) as info:
        launch(w.sigkill_rank_zero, 2, timeout=120)
    assert info.value.rank == 0 and "signal 9" in str(info.value)
    assert launch(w.echo, 2, args=(1,), timeout=120)[1]["sum"] == 3.0  # the next run is normal


def test_verify_refuses_different_inputs_per_rank(no_leftover_children):
    messages = launch(w.different_inputs, 2, timeout=120)
    assert all("the ranks were given different inputs" in m for m in messages)
