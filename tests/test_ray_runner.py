"""The Ray runner: a world-4 trial spans the two nodes of a local cluster, its rank actors show in
the state API by name while it runs and are gone (with their placement group) after; a rank
killed mid-step is a crash, and the next trial runs."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from runners import TrialSpec
from slapo_tune.problem import ProblemSpec

PROBLEM_FIELDS = {f.name for f in dataclasses.fields(ProblemSpec)}

ray = pytest.importorskip("ray")


def _spec(**kw) -> TrialSpec:
    base = dict(model="gpt2-tiny", knobs={"tp": 2, "micro_batch": 2}, world_size=4, global_batch=8, seq_len=32,
                measured_steps=2, time_limit=240)
    fields = {**base, **kw}  # the problem's and the trial's, apart
    problem = ProblemSpec(**{k: v for k, v in fields.items() if k in PROBLEM_FIELDS})
    return TrialSpec(problem, **{k: v for k, v in fields.items() if k not in PROBLEM_FIELDS})


def test_world4_trial_spans_both_nodes_and_is_visible_by_name(ray_cluster):
    from ray.util.state import list_actors, list_placement_groups

    from runners.ray_runner import RayRunner

    runner = RayRunner()
    spec = _spec(name="trial-7")
    out = {}
    worker = threading.Thread(target=lambda: out.update(result=runner.run(spec)))
    worker.start()
    seen: set[str] = set()
    while worker.is_alive() and len(seen) < 4:
        seen |= {a.name for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.name.startswith("trial-7 ")}
        time.sleep(0.5)
    worker.join(timeout=spec.time_limit + 30)
    result = out["result"]
    assert result.status == "ok", (result.error, result.error_tail)
    assert result.runner == "ray" and len(result.peak_memory) == 4 and result.samples_per_s > 0
    assert len(set(runner.last_nodes)) == 2  # the ranks landed on both nodes
    assert seen == {f"trial-7 tp=2 pp=1 dp=2 zero=0 mb=2 ckpt=0.0 sched=1f1b attn=sdpa fuse=off rank {r}"
                    for r in range(4)}
    # afterwards: no live actor of the trial, its placement group removed, resources free again
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        alive = [a.name for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.name.startswith("trial-7 ")]
        groups = [g.state for g in list_placement_groups() if g.name == "trial-7"]
        if not alive and all(s == "REMOVED" for s in groups) and ray.available_resources().get("CPU") == 4:
            break
        time.sleep(0.5)
    assert not alive and groups and all(s == "REMOVED" for s in groups)
    assert ray.available_resources().get("CPU") == 4


def test_rank_killed_on_ray_is_a_crash_and_the_next_trial_runs(ray_cluster):
    from runners.ray_runner import RayRunner

    runner = RayRunner()
    result = runner.run(_spec(world_size=2, knobs={"tp": 1}, template="_fault_templates:KilledMidStep",
                              name="trial-killed"))
    assert result.status == "crash" and result.error.startswith("rank 1 died"), result.error
    raised = runner.run(_spec(world_size=2, knobs={"tp": 1}, template="_fault_templates:Raises", name="trial-raises"))
    assert raised.status == "crash" and raised.error_rank == 1 and "injected failure" in raised.error
    after = runner.run(_spec(world_size=2, name="trial-after", measured_steps=1))
    assert after.status == "ok", (after.error, after.error_tail)


def test_a_trial_the_cluster_cannot_place_is_a_placement_timeout(ray_cluster):
    """8 bundles of a whole CPU on a cluster of 4: the cluster's failure, not the schedule's."""
    from runners.ray_runner import RayRunner

    runner = RayRunner(cpus_per_rank=1.0, placement_timeout=1.0)
    result = runner.run(_spec(world_size=8, knobs={"tp": 2}, name="trial-unplaceable"))
    assert result.status == "placement_timeout" and "cannot place 8 bundles" in result.error, result.error
    assert result.status.infrastructure and not result.status.infeasible
