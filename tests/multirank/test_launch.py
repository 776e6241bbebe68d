"""The local launcher: results by rank, failures named by rank, nothing left behind."""

import ast
import json
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from slapo_tune.launch import RankFailure, launch, loopback_environment, loopback_interface

import _launch_workers as w
from _helpers import is_loopback

RENDEZVOUS_PREFIX = "slapo-rendezvous-"  # the private folder of a launch's rendezvous store


@pytest.fixture
def rendezvous_folders(monkeypatch):
    """The rendezvous folders the launches of a test made (a spy on tempfile.mkdtemp)."""
    made: list[str] = []
    real = tempfile.mkdtemp

    def spy(*args, **kwargs):
        path = real(*args, **kwargs)
        if os.path.basename(path).startswith(RENDEZVOUS_PREFIX):
            made.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", spy)
    return made


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of process ``pid``."""
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


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


def test_a_raising_rank_is_named_and_the_others_are_killed(rendezvous_folders, no_leftover_children):
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(w.raise_on_rank_one, 2, timeout=120)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "rank 1 raised ValueError: bad knob on rank 1" in str(info.value)
    assert "Traceback" in info.value.details
    assert time.monotonic() - t0 < 50  # rank 0 (sleeping 60 s) was killed, not waited for
    assert len(rendezvous_folders) == 1 and not os.path.exists(rendezvous_folders[0])  # removed on failure too


def test_ranks_listen_on_the_loopback_only(tmp_path, rendezvous_folders, no_leftover_children):
    """A real local run opens no socket on a wildcard address (a TCPStore listens on every
    interface whatever host it is given): its ranks rendezvous through a file store in a folder
    only this user reaches, removed afterwards, and gloo's connections listen on the loopback
    interface, not on the address the hostname resolves to (which other hosts may reach)."""
    import psutil

    loopback = next(name for name, addresses in psutil.net_if_addrs().items()
                    if any(a.address == "127.0.0.1" for a in addresses))
    before = _listening(os.getpid())  # what this test process held already (another test's servers)
    run: dict = {}
    launcher = threading.Thread(target=lambda: run.update(results=launch(w.hold_until_released, 2,
                                                                         args=(str(tmp_path),), timeout=120)))
    launcher.start()
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("rank-*.json"))) < 2:
            assert time.monotonic() < deadline and launcher.is_alive(), "the ranks did not start"
            time.sleep(0.05)
        reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
        sockets = {"launcher": _listening(os.getpid()) - before,
                   **{f"rank {r}": _listening(report["pid"]) for r, report in enumerate(reports)}}
        folders = [(path, os.stat(path).st_mode & 0o777, os.listdir(path)) for path in rendezvous_folders]
    finally:
        (tmp_path / "release").touch()
        launcher.join(timeout=60)
    assert run["results"] == reports and all(r["sum"] == 3.0 for r in reports)  # the ranks met
    assert all(sockets[f"rank {r}"] for r in range(2)), sockets  # gloo's own listeners: some to check
    assert {who: [s for s in held if not is_loopback(s[0])] for who, held in sockets.items()} == \
        {who: [] for who in sockets}, sockets
    assert sockets["launcher"] == set()  # the store is a file: not even a loopback port for other local users
    assert all(r["GLOO_SOCKET_IFNAME"] == r["NCCL_SOCKET_IFNAME"] == loopback for r in reports)
    assert [(mode, names) for _, mode, names in folders] == [(0o700, ["store"])]  # private, and held the store
    assert not os.path.exists(folders[0][0])


def test_an_interface_the_user_named_wins_over_the_loopback():
    lo = loopback_interface()
    assert loopback_environment({"GLOO_SOCKET_IFNAME": "ib0"}) == {"NCCL_SOCKET_IFNAME": lo}
    assert loopback_environment({"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}) == {}
    assert loopback_environment({"NCCL_SOCKET_IFNAME": ""}) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def test_a_single_process_group_listens_on_the_loopback():
    """``init_topology`` without torchrun (one process, no peer) puts gloo's listeners on the
    loopback; it reads the interface from the environment, which must name it before the group
    (and the mesh's groups) exist. In a process of its own: this one's group may exist."""
    script = ("import os, psutil, slapo_tune.topology as t; t.init_topology(); "
              "print(os.environ.get('GLOO_SOCKET_IFNAME'), sorted({c.laddr.ip for c in "
              "psutil.Process().net_connections(kind='inet') if c.status == 'LISTEN'}))")
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    interface, addresses = done.stdout.split(" ", 1)
    assert done.returncode == 0 and interface == loopback_interface(), done.stderr
    assert addresses.strip() != "[]" and all(is_loopback(a) for a in ast.literal_eval(addresses))


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


def test_ranks_end_when_the_launcher_is_sigkilled(tmp_path):
    """A SIGKILLed launcher (a killed tuner or training job) leaves no rank running, although a
    forked rank's parent is the fork server, not the launcher."""
    import signal
    import subprocess
    import sys

    script = ("import sys\nif __name__ == '__main__':\n    sys.path.insert(0, sys.argv[1])\n"
              "    import _launch_workers as w\n    from slapo_tune.launch import launch\n"
              "    launch(w.write_pid_and_hang, 2, args=(sys.argv[2],), timeout=600)\n")
    (tmp_path / "launcher.py").write_text(script)
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), os.path.dirname(__file__),
                                 str(tmp_path)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank-*"))) < 2 or any(not p.read_text() for p in tmp_path.glob("rank-*")):
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.2)
        ranks = [int(p.read_text()) for p in tmp_path.glob("rank-*")]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    finally:
        launcher.kill()
        launcher.wait()
    for pid in left:  # ended here, by PID, if the launcher's death did not end them
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"ranks {left} outlived their launcher"


def test_ranks_are_spawned_where_the_fork_servers_socket_path_would_be_too_long(monkeypatch):
    import multiprocessing.util

    import slapo_tune.launch as launch_module

    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: "/tmp/" + "d" * 80)
    assert launch_module._start_method("gloo", w.echo).get_start_method() == "forkserver"
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: "/tmp/" + "d" * 90)  # + 18: over 107
    assert launch_module._start_method("gloo", w.echo).get_start_method() == "spawn"
