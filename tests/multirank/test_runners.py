"""Trial runners: ok, oom, invalid, crash, hang and SIGKILL trials; nothing left behind, and the
next trial runs normally after each failure."""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
import time

import pytest

from runners import CorePool, LocalRunner, TrialSpec, run_trial
from runners.local import rank_cores
from slapo_tune.problem import ProblemSpec

PROBLEM_FIELDS = {f.name for f in dataclasses.fields(ProblemSpec)}


def _spec(**kw) -> TrialSpec:
    base = dict(model="gpt2-tiny", knobs={"tp": 2, "micro_batch": 2}, world_size=2, global_batch=8, seq_len=32,
                measured_steps=2, time_limit=120, name="test")
    fields = {**base, **kw}  # the problem's and the trial's, apart
    problem = ProblemSpec(**{k: v for k, v in fields.items() if k in PROBLEM_FIELDS})
    return TrialSpec(problem, **{k: v for k, v in fields.items() if k not in PROBLEM_FIELDS})


def _assert_ok(result) -> None:
    assert result.status == "ok", (result.error, result.error_tail)
    assert result.samples_per_s > 0 and result.tokens_per_s == pytest.approx(result.samples_per_s * 32)
    assert len(result.peak_memory) == 2 and min(result.peak_memory) > 0
    assert min(result.peak_rss) > max(result.peak_memory)  # RSS includes the interpreter and torch
    assert result.losses and all(math.isfinite(x) for x in result.losses)
    assert result.train_seconds > 0 and result.overhead_seconds > 0


def test_ok_trial_reports_throughput_memory_and_spread(no_leftover_children):
    result = run_trial(_spec(measured_steps=3))
    _assert_ok(result)
    assert len(result.step_times) == 3 and result.step_p25 <= result.step_p75
    assert result.spread == pytest.approx((result.step_p75 - result.step_p25) / sorted(result.step_times)[1])
    assert result.knobs["tp"] == 2 and result.knobs["dp"] == 1  # completed by the template
    assert result.nodes == [f"{socket.gethostname()}:cpu"] * 2  # where each rank ran
    # the two ranks were pinned to cores of their own when there are enough of them
    if len({c for cores in result.rank_cores for c in cores}) >= 2:
        assert not set(result.rank_cores[0]) & set(result.rank_cores[1])


def test_budget_below_need_is_oom(no_leftover_children):
    result = run_trial(_spec(memory_budget=1_000_000))
    assert result.status == "oom" and "budget 1000000" in result.error
    assert result.error_type == "MemoryBudgetExceeded" and result.error_rank in (0, 1)
    assert not result.step_times and result.samples_per_s is None


def test_illegal_knobs_are_invalid_without_launching(no_leftover_children):
    t0 = time.perf_counter()
    result = run_trial(_spec(knobs={"tp": 3}))
    assert result.status == "invalid" and "tp=3 is not legal" in result.error
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("fault,status,limit,message", [
    ("Raises", "crash", 120, "rank 1 raised RuntimeError: injected failure in block 0"),
    # (a trial reaches its fault within 2 s on an idle machine: the limit leaves it 5x that)
    ("Hangs", "timeout", 10, "timed out after 10 s"),
    ("KilledMidStep", "crash", 120, "rank 1 died (signal 9)"),
])
def test_failing_rank_is_reported_and_the_next_trial_runs(fault, status, limit, message, no_leftover_children):
    runner = LocalRunner()
    t0 = time.perf_counter()
    result = runner.run(_spec(knobs={"tp": 1, "micro_batch": 2}, template=f"_fault_templates:{fault}",
                              time_limit=limit))
    assert result.status == status and message in result.error, (result.error, result.error_tail)
    assert time.perf_counter() - t0 < limit + 10
    if fault == "Raises":
        assert result.error_rank == 1 and result.error_type == "RuntimeError"
        assert "injected failure" in result.error_tail
    _assert_ok(runner.run(_spec(measured_steps=1)))


def test_core_pool_never_shares_a_core():
    pool = CorePool([0, 1, 2, 3])
    first = pool.acquire(2)
    second = pool.acquire(2)
    assert not set(first) & set(second)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(2)))
    waiter.start()
    waiter.join(timeout=0.3)
    assert waiter.is_alive() and not got  # waits instead of sharing
    pool.release(first)
    waiter.join(timeout=5)
    assert got and set(got[0]) == set(first)


@pytest.mark.parametrize("cores,world,expected", [
    ([0, 1, 2, 3], 2, [[0, 1], [2, 3]]),
    ([4, 5], 2, [[4], [5]]),
    ([0, 1], 4, [[0], [1], [0], [1]]),
])
def test_rank_cores(cores, world, expected):
    assert rank_cores(cores, world) == expected
