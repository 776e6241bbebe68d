"""The Ray runner on a two-node local cluster with token authentication: a world-4 trial spans
both nodes (and says so), its rank actors show in the state API by name while it runs and are
gone (with their placement group) after; a rank killed mid-step is a crash, and the next trial
runs; attaching without the token is one line; a tuner submitted as a Ray Job is read back with
``slapo-tune export``; a node killed mid-trial is one lost trial, and the next is placed on what
is left. Also, without a cluster: the rendezvous interface, ``--keep-dashboard``, runtime envs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

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
    assert len(result.nodes) == 4 and len({place.split(":")[0] for place in result.nodes}) == 2  # both nodes
    nodes = {n["NodeID"][:8] for n in ray.nodes() if n["Alive"]}
    assert {place.split("/")[1].split(":")[0] for place in result.nodes} == nodes
    assert all(place.endswith(":cpu") for place in result.nodes)
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


def test_attaching_without_the_token_is_one_line_and_rays_messages_go_to_the_log(ray_cluster, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token here
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "slapo_tune", "tune", "--ray-address", ray_cluster.address,
                           "--out", str(out), "--trials", "1"], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (f"slapo-tune: error: the Ray cluster at {ray_cluster.address} uses token authentication: "
                        "set RAY_AUTH_MODE=token and copy the cluster's token (on the head: ray get-auth-token) to "
                        "~/.ray/auth_token here, or name its file in RAY_AUTH_TOKEN_PATH (see docs/ray-clusters.md)")
    assert "InvalidAuthToken" in (out / "ray.log").read_text()  # Ray's own lines: kept, off the console


def test_a_ray_job_tunes_into_shared_storage_and_export_reads_it_back(ray_cluster, tmp_path, capsys):
    """The tuner submitted as a Ray Job (token auth, the dashboard on the loopback), its study in a
    journal on the shared filesystem; the submitter rebuilds the outputs with one command. Its
    world-4 trials span both nodes, which trials.csv records."""
    import pandas as pd
    from ray.job_submission import JobStatus, JobSubmissionClient

    from slapo_tune.cli import main

    journal = tmp_path / "shared" / "study.journal"
    client = JobSubmissionClient(f"http://{ray_cluster.webui_url}")
    entrypoint = (f"{sys.executable} -m slapo_tune tune --ray-address auto --world-size 4 --trials 1 --confirm 0 "
                  f"--measured-steps 1 --trial-timeout 3m --storage {journal} --study job-study "
                  f"--out {tmp_path / 'job-out'} --runtime-env package --quiet")
    job = client.submit_job(entrypoint=entrypoint)
    deadline = time.monotonic() + 400
    while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.monotonic() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(1)
    assert client.get_job_status(job) == JobStatus.SUCCEEDED, client.get_job_logs(job)[-3000:]

    back = tmp_path / "back"
    assert main(["export", "--storage", str(journal), "--study", "job-study", "--out", str(back)]) == 0
    rows = pd.read_csv(back / "trials.csv")
    launched = rows[rows.status == "ok"]
    assert len(launched) >= 1, rows
    spans = [{place.split(":")[0] for place in nodes.split()} for nodes in launched.nodes]
    assert all(len(places) == 2 for places in spans), launched.nodes.tolist()
    assert (back / "best_schedule.json").is_file() and (back / "report.html").is_file()
    # the same table as the job's own folder holds, rebuilt from the study alone
    pd.testing.assert_frame_equal(rows, pd.read_csv(tmp_path / "job-out" / "trials.csv"))
    capsys.readouterr()
    assert main(["show", "--storage", str(journal), "--study", "job-study"]) == 0
    shown = capsys.readouterr().out
    assert "best (*): trial" in shown and f"{len(rows)} trial(s)" in shown, shown


def test_a_node_lost_mid_trial_is_one_lost_trial_and_the_next_fits_what_is_left(ray_cluster, tmp_path, capfd,
                                                                                 monkeypatch):
    """The worker node's raylet is killed while a world-4 trial runs on both nodes: that trial is
    ``lost``; the next world-4 trial is sized from the head's 2 CPUs (not the 4 the cluster had)
    and runs; Ray's dump of the dead raylet's log reaches the log once and the console never.
    The cluster gets a fresh second node afterwards."""
    import ray._private.worker as ray_worker
    from ray.util.state import list_actors

    from runners.ray_cluster import _free_port, route_ray_messages
    from runners.ray_runner import RayRunner

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored after
    log = tmp_path / "ray.log"
    route_ray_messages(log)  # as the tuner's connect does
    victim = next(iter(ray_cluster.worker_nodes))
    head_node = next(n["NodeID"][:8] for n in ray.nodes() if n["Alive"] and n["NodeID"] != victim.node_id)
    runner = RayRunner()
    # steps enough to outlast the wait below on any machine (about 0.05 s each): the kill lands mid-trial
    spec = _spec(name="trial-lost", measured_steps=2000)
    out = {}
    worker = threading.Thread(target=lambda: out.update(result=runner.run(spec)))
    worker.start()
    try:
        while worker.is_alive() and len([a for a in list_actors(filters=[("state", "=", "ALIVE")])
                                         if a.name.startswith("trial-lost ")]) < 4:
            time.sleep(0.5)
        time.sleep(3)  # the ranks are in their steps
        victim.all_processes["raylet"][0].process.kill()
        worker.join(timeout=spec.time_limit + 90)
        lost = out["result"]
        assert lost.status == "lost", (lost.status, lost.error)
        assert {place.split("/")[1].split(":")[0] for place in lost.nodes} == {head_node, victim.node_id[:8]}

        after = runner.run(_spec(name="trial-after-loss", measured_steps=1))
        assert after.status == "ok", (after.status, after.error)
        assert {place.split("/")[1].split(":")[0] for place in after.nodes} == {head_node}
        console = capfd.readouterr()  # (Ray's messages on the dead raylet came within a second of its death)
        assert "Raylet is terminated" not in console.out + console.err
        assert log.read_text().count("Raylet is terminated") == 1, log.read_text()
    finally:
        ray_cluster.remove_node(victim, allow_graceful=False)
        ray_cluster.add_node(num_cpus=2, dashboard_agent_listen_port=_free_port())
        ray_cluster.wait_for_nodes()


def test_after_a_lost_node_the_next_trial_is_sized_from_the_nodes_alive(monkeypatch):
    """Ray's total still counts the dead node (4 CPUs): the runner waits until Ray declares the
    node dead, then sizes a world-4 trial from the 2 CPUs alive (half a CPU a rank, not 1)."""
    from runners.ray_runner import RayRunner

    nodes = [{"NodeID": "head", "Alive": True, "Resources": {"CPU": 2.0}},
             {"NodeID": "lost", "Alive": True, "Resources": {"CPU": 2.0}}]
    asked = []

    def listed():
        asked.append(1)
        if len(asked) == 3:  # declared dead on the third look
            nodes[1]["Alive"] = False
        return [dict(n) for n in nodes]

    monkeypatch.setattr(ray, "nodes", listed)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    runner = RayRunner.__new__(RayRunner)  # no cluster: only its sizing
    runner.cpus_per_rank, runner.concurrency = None, 1
    runner._await_dead({"head", "lost"})
    assert len(asked) == 3
    assert runner._bundle(_spec()) == {"CPU": 0.5}


def test_the_rendezvous_interface_is_the_one_holding_the_node_address():
    from runners.ray_runner import choose_interface, rendezvous_interface

    interfaces = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5", "fe80::1"], "ib0": ["192.168.7.5"]}
    assert rendezvous_interface("192.168.7.5", interfaces) == "ib0"
    assert rendezvous_interface("10.9.9.9", interfaces) is None
    environ: dict[str, str] = {}
    assert choose_interface("10.0.0.5", environ, interfaces) == "eth0"
    assert environ == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    environ = {"NCCL_SOCKET_IFNAME": "ib0"}  # one the user (or --net-if) named wins, for both
    assert choose_interface("10.0.0.5", environ, interfaces) == "ib0"
    assert environ == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    environ = {}
    assert choose_interface("10.9.9.9", environ, interfaces) is None and environ == {}


def test_the_store_listens_on_the_interface_the_user_named_else_at_the_node_address():
    """Rank 0's store binds one address (a TCPStore given a host would listen on every interface):
    the node's Ray address, or, with --net-if (or either variable) naming an interface, that
    interface's: the node's address if it holds it, else its IPv4 address, else a global IPv6 one."""
    from runners.ray_runner import store_address

    interfaces = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5", "fe80::1%eth0"],
                  "ib0": ["fe80::2%ib0", "fd00::7", "192.168.7.5"], "ib1": ["fe80::3%ib1"], "ib2": ["fd00::9"]}
    assert store_address("127.0.0.1", {}, interfaces) == "127.0.0.1"  # a local head: the loopback
    assert store_address("10.0.0.5", {}, interfaces) == "10.0.0.5"
    assert store_address("10.0.0.5", {"GLOO_SOCKET_IFNAME": "eth0"}, interfaces) == "10.0.0.5"
    assert store_address("10.0.0.5", {"NCCL_SOCKET_IFNAME": "ib0"}, interfaces) == "192.168.7.5"
    assert store_address("10.0.0.5", {"GLOO_SOCKET_IFNAME": "ib2"}, interfaces) == "fd00::9"
    assert store_address("127.0.0.1", {"GLOO_SOCKET_IFNAME": "lo"}, interfaces) == "127.0.0.1"
    # no usable address there (only link-local, or no such interface): the node's; gloo then names the interface
    assert store_address("10.0.0.5", {"GLOO_SOCKET_IFNAME": "ib1"}, interfaces) == "10.0.0.5"
    assert store_address("10.0.0.5", {"GLOO_SOCKET_IFNAME": "nosuch"}, interfaces) == "10.0.0.5"
    # --net-if: both variables in the runtime environment of the driver's job, beside what it held
    from runners.ray_cluster import with_interface

    assert with_interface({"env_vars": {"A": "1"}, "pip": ["x"]}, "ib0") == {
        "env_vars": {"A": "1", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}, "pip": ["x"]}
    assert with_interface(None, None) is None


def test_keep_dashboard_leaves_the_head_up_and_prints_the_command_that_stops_it(tmp_path):
    from runners.ray_cluster import Cluster

    temp, head_file = tmp_path / "slapo-ray-1", tmp_path / ".ray_head.json"
    temp.mkdir()
    head_file.write_text("{}")
    head = subprocess.Popen(["sleep", "300"], start_new_session=True)  # stands in for `ray start --block`
    try:
        line = Cluster(None, "local-ray", "127.0.0.1:1", "http://127.0.0.1:2", head.pid, head_file, temp).stop(
            keep_head=True)
        assert head.poll() is None and head_file.is_file() and temp.is_dir()
        assert line.startswith("the Ray head stays up (dashboard http://127.0.0.1:2); stop it with: kill -TERM")
        command = line.split("stop it with: ", 1)[1]
        reaper = threading.Thread(target=head.wait)  # as init reaps a head whose tuner has exited
        reaper.start()
        subprocess.run(["sh", "-c", command], check=True, timeout=30)
        reaper.join(timeout=10)
        assert head.poll() is not None and not temp.exists()
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()


def test_runtime_env_ships_the_package_or_a_wheel(tmp_path):
    from runners.ray_cluster import runtime_env_of
    from slapo_tune.errors import UsageError

    shipped = runtime_env_of("package")["py_modules"]
    assert [Path(p).name for p in shipped] == ["slapo_tune", "runners", "search_spaces"]
    assert all((Path(p) / "__init__.py").is_file() for p in shipped)
    wheel = tmp_path / "slapo_tune-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert runtime_env_of(str(wheel)) == {"py_modules": [str(wheel)]}
    assert runtime_env_of('{"pip": ["x"]}') == {"pip": ["x"]} and runtime_env_of(None) is None
    with pytest.raises(UsageError, match="expected package, a .whl file or a JSON object"):
        runtime_env_of("[1]")


def test_a_local_head_sees_none_of_what_its_caller_withholds(tmp_path, monkeypatch):
    """start_head hands the head this process's environment (and Ray's settings of a local head)
    but the variables named ``withheld``: the tune command withholds the study's storage URL."""
    import shutil
    from types import SimpleNamespace

    from runners import ray_cluster

    started = []
    monkeypatch.setattr(ray_cluster.subprocess, "Popen", lambda cmd, env, **_: started.append(env) or SimpleNamespace(pid=1))
    monkeypatch.setenv("SECRET_URL", "postgresql://u:pw@h/db")
    monkeypatch.setenv("KEPT", "1")
    _, _, _, temp = ray_cluster.start_head(tmp_path, 1, withheld=("SECRET_URL",))
    shutil.rmtree(temp)
    (env,) = started
    assert "SECRET_URL" not in env and env["KEPT"] == "1" and env.items() >= ray_cluster.LOCAL_HEAD_ENV.items()
