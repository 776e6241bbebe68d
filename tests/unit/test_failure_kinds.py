"""Failures told apart: an infrastructure failure (a node or rank actor lost, a placement that
timed out) is neither a crash of the schedule nor infeasible, spends no trial of the budget and is
retried once, later in the study or on resume; crash and oom are never retried; an out-of-memory
error on any rank names the trial, whatever its peers' errors say. Replayed studies and stand-ins
for Ray: no Ray cluster here (the placement timeout is in test_ray_runner)."""

from __future__ import annotations

import time

import pytest

from benchmarks.search_strategies import load_grid, replay_tuner
from runners.replay import ReplayRunner
from runners.trial import TrialResult, failure
from slapo_tune.launch import RankFailure, first_failure
from slapo_tune.plan import TrialStatus
from slapo_tune.search._known import Known
from slapo_tune.space import point_key


@pytest.fixture(scope="module")
def grid():
    return load_grid()


class _Failing(ReplayRunner):
    """Replays the grid, except that the n-th launch (1-based) ends as ``script`` says."""

    def __init__(self, results, script: dict[int, str]):
        super().__init__(results)
        self.script = script

    def run(self, spec):
        recorded = super().run(spec)
        status = self.script.get(len(self.launched))
        if status is None:
            return recorded
        return TrialResult(status=TrialStatus(status), knobs=self.launched[-1], error=f"injected {status}",
                           runner=self.name)


def _statuses(tuner) -> list[tuple[int, str, str, int | None]]:
    """(number, point key, status, retry_of) of every trial that launched or failed on the cluster."""
    return [(t.number, point_key(t.user_attrs["point"]), t.user_attrs["status"], t.user_attrs.get("retry_of"))
            for t in tuner.study.trials if t.user_attrs.get("status") not in (None, "duplicate", "pruned")]


# ------------------------------------------------------------------ which failure names the trial
def test_oom_on_any_rank_wins_over_the_peer_errors_it_causes():
    """Rank 0's collective fails first with an error no peer-error rule knows (gloo's recv timeout);
    rank 1's out-of-memory error is reported a moment later: the trial is oom."""
    peer = RankFailure("rank 0 raised RuntimeError: [gloo] Timed out waiting 30000ms for recv operation to complete",
                       rank=0, exc_type="RuntimeError")
    oom = RankFailure("rank 1 raised OutOfMemoryError: CUDA out of memory", rank=1, exc_type="OutOfMemoryError")
    oom.when = peer.when + 0.5
    chosen = first_failure([peer, oom])
    assert chosen is oom
    result = failure(None, {}, chosen.kind, str(chosen), 1.0, "local", rank=chosen.rank, exc_type=chosen.exc_type)
    assert result.status is TrialStatus.OOM and result.error_rank == 1
    # without an out-of-memory error the earliest own error still wins over a recognised peer error
    own = RankFailure("rank 1 raised ValueError: bad shape", rank=1, exc_type="ValueError")
    closed = RankFailure("rank 0 raised DistBackendError: Connection closed by peer", rank=0,
                         exc_type="DistBackendError")
    closed.when = own.when - 0.5
    assert first_failure([closed, own]) is own


# ------------------------------------------------------------------ Ray: a lost node is not a crash
def _actor_died(message: str):
    from ray.core.generated.common_pb2 import ActorDiedErrorContext
    from ray.exceptions import ActorDiedError

    return ActorDiedError(ActorDiedErrorContext(error_message=message, actor_id=b"\1" * 16, pid=4242,
                                                node_ip_address="10.0.0.7"))


NODE_DIED = "The actor died because its node has died. Node Id: 5f0a. the node was inferred to be dead due to missed heartbeats"
WORKER_DIED = ("The actor died unexpectedly before finishing this task. Worker unexpectedly exits with a connection "
               "error code 2. End of file. The process was killed by SIGKILL")


def test_a_rank_actor_on_a_dead_node_is_lost_and_one_killed_by_itself_a_crash():
    pytest.importorskip("ray")
    from ray.exceptions import ActorUnavailableError

    from runners.ray_runner import node_lost

    assert node_lost(_actor_died(NODE_DIED))
    assert node_lost(ActorUnavailableError("the actor is unreachable", b"\1" * 16))
    assert not node_lost(_actor_died(WORKER_DIED))


class _FakeRay:
    """``ray.wait``/``ray.get`` over scripted ranks: each answers (a report or an exception)
    ``after`` seconds from the start."""

    def __init__(self, answers: dict[str, tuple[float, object]]):
        self.answers, self.start = answers, time.monotonic()

    def wait(self, pending, num_returns=1, timeout=None):
        end = time.monotonic() + (timeout or 0.0)
        while True:
            ready = [r for r in pending if time.monotonic() - self.start >= self.answers[r][0]]
            if ready or time.monotonic() >= end:
                return ready[:num_returns], [r for r in pending if r not in ready[:num_returns]]
            time.sleep(0.01)

    def get(self, ref):
        answer = self.answers[ref][1]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_a_peer_error_waits_for_ray_to_report_the_lost_node():
    """Rank 0 fails at once with gloo's "connection closed"; Ray reports rank 1's node dead 1.5 s
    later (past the 1 s it waits for a rank's own error): the trial is lost, not a crash."""
    pytest.importorskip("ray")
    from runners.ray_runner import RayRunner

    closed = ("error", "DistBackendError", "Connection closed by peer [10.0.0.7]:4242", "", time.time())
    fake = _FakeRay({"rank0": (0.0, closed), "rank1": (1.5, _actor_died(NODE_DIED))})
    with pytest.raises(RankFailure) as raised:
        RayRunner._collect({"rank0": 0, "rank1": 1}, time.monotonic() + 30, 30, ray=fake)
    assert raised.value.kind == TrialStatus.LOST and raised.value.rank == 1
    assert "its node has died" in str(raised.value)


# ------------------------------------------------------------------ the driver: retried once, budget kept
def test_an_infrastructure_failure_is_retried_once_and_spends_no_trial(grid):
    """Launch 2 is lost with its node and launch 3 is a crash: the lost point runs again (once, as
    a retry naming the lost trial), the crashed one never; the study still launches its 6 trials
    of the budget; the lost trial told Optuna nothing (failed, no constraint)."""
    results, budget = grid
    runner = _Failing(results, {2: "lost", 4: "crash"})
    tuner, _ = replay_tuner("grid", 0, "none", results, budget, trials=6, runner=runner)
    summary = tuner.run()
    rows = _statuses(tuner)
    lost = [r for r in rows if r[2] == "lost"]
    assert len(lost) == 1
    retries = [r for r in rows if r[3] is not None]
    assert [(r[1], r[3]) for r in retries] == [(lost[0][1], lost[0][0])]
    assert retries[0][0] == lost[0][0] + 1  # asked before any new point
    assert retries[0][2] in ("ok", "oom")  # launch 3, as recorded; launch 4 is the crash, not retried
    crashed = [r for r in rows if r[2] == "crash"]
    assert len(crashed) == 1 and [r[1] for r in rows].count(crashed[0][1]) == 1
    assert summary["launched"] == 6 and summary["infrastructure"] == 1 and len(runner.launched) == 7
    keys = [point_key(p) for p in runner.launched]
    assert keys.count(lost[0][1]) == 2 and len(set(keys)) == 6  # the lost point twice, every other once
    trial = tuner.study.trials[lost[0][0]]
    assert trial.state.name == "FAIL" and not trial.constraints


def test_oom_and_crash_are_not_retried(grid):
    results, budget = grid
    runner = _Failing(results, {1: "crash"})
    # frontier: the largest micro-batch first, so the walk meets out-of-memory points early
    tuner, _ = replay_tuner("frontier", 0, "none", results, budget, trials=12, runner=runner)
    tuner.run()
    rows = _statuses(tuner)
    assert any(r[2] == "oom" for r in rows) and any(r[2] == "crash" for r in rows)
    assert not [r for r in rows if r[3] is not None]
    keys = [point_key(p) for p in runner.launched]
    assert len(keys) == len(set(keys)) == 12


def test_a_failing_cluster_stops_the_study_and_the_retry_left_runs_on_resume(grid, tmp_path, monkeypatch):
    """Launch 1 ok; launch 2 lost, and its retry (launch 3) lost again: not retried a third time,
    the point settled as lost; launch 4, a new point, lost too: three in a row, the study stops
    ("infrastructure failing") with that point's retry queued. Resumed on a healthy cluster, the
    queued retry runs first and the twice-lost point is never proposed again."""
    results, budget = grid
    storage = f"journal:{tmp_path / 'study.journal'}"
    first = _Failing(results, {2: "lost", 3: "placement_timeout", 4: "lost"})
    tuner, _ = replay_tuner("grid", 0, "none", results, budget, trials=6, runner=first, storage=storage, study="s")
    summary = tuner.run()
    assert summary["stop"] == "infrastructure failing" and summary["launched"] == 1
    assert summary["infrastructure"] == 3
    twice, once = point_key(first.launched[1]), point_key(first.launched[3])
    assert point_key(first.launched[2]) == twice

    again = ReplayRunner(results)
    resumed, _ = replay_tuner("grid", 0, "none", results, budget, trials=6, runner=again, storage=storage, study="s")
    resumed.open()
    assert resumed.progress.launched == 1 and resumed.progress.infrastructure == 3
    done = resumed.run()
    keys = [point_key(p) for p in again.launched]
    assert keys[0] == once and twice not in keys and len(keys) == 5 == len(set(keys))
    assert done["launched"] == 6
    retry = [r for r in _statuses(resumed) if r[1] == once and r[3] is not None]
    assert len(retry) == 1 and retry[0][2] == "ok"


def test_a_driver_stopped_before_queueing_the_retry_queues_it_on_resume(grid, tmp_path, monkeypatch):
    """The driver told the lost trial and was killed before queueing its retry: the resumed driver
    queues it, once."""
    from slapo_tune.search import Tuner

    def killed(*args):
        raise KeyboardInterrupt

    results, budget = grid
    storage = f"journal:{tmp_path / 'study.journal'}"
    with monkeypatch.context() as patched:
        patched.setattr(Tuner, "_queue_retry", killed)
        tuner, first = replay_tuner("grid", 0, "none", results, budget, trials=3, runner=_Failing(results, {3: "lost"}),
                                    storage=storage, study="s")
        with pytest.raises(KeyboardInterrupt):
            tuner.run()
    lost = point_key(first.launched[2])
    assert len(first.launched) == 3
    again = ReplayRunner(results)
    resumed, _ = replay_tuner("grid", 0, "none", results, budget, trials=4, runner=again, storage=storage, study="s")
    resumed.run()
    assert [point_key(p) for p in again.launched].count(lost) == 1
    assert point_key(again.launched[0]) == lost  # queued: asked before any new point
    for reopened in range(2):  # a retry queued (and run) is not queued again
        replay_tuner("grid", 0, "none", results, budget, trials=4, runner=ReplayRunner(results), storage=storage,
                     study="s")[0].run()
        assert len([t for t in resumed.study.get_trials() if t.user_attrs.get("retry_of") is not None]) == 1, reopened


# ------------------------------------------------------------------ guided: lost is not infeasible
def test_guided_does_not_read_an_infrastructure_failure_as_out_of_memory(grid):
    """The guided strategy sends every point predicted to need as much memory as a measured
    out-of-memory one to the back. A point lost with its node says nothing about memory: guided's
    next choice is the one it makes while that point is merely running."""
    results, budget = grid
    tuner, _ = replay_tuner("guided", 0, "none", results, budget, trials=1)
    guided = tuner.sampler
    top = guided.next_point(Known({}, {}, {}, 0))
    key = point_key(top)

    def after(status: TrialStatus | None):
        if status is None:
            return guided.next_point(Known({}, {}, {key: 0}, 1))
        return guided.next_point(Known({key: status}, {}, {}, 1))

    neutral = after(None)
    assert after(TrialStatus.LOST) == neutral and after(TrialStatus.PLACEMENT_TIMEOUT) == neutral
    assert after(TrialStatus.OOM) != neutral  # (the rule this checks against does move the choice)
