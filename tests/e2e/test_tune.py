"""slapo-tune tune, end to end on CPU: a local Ray head, cost-model pruning, trials visible in the
dashboard's state API, exported schedule; exact resume after the driver is SIGKILLed; bad input."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pandas as pd
import pytest

from slapo_tune.cli import main
from slapo_tune.plan import KNOBS as PLAN_KNOBS
from slapo_tune.schedule_file import read_schedule

from _helpers import is_loopback

LAUNCHED = ("ok", "oom", "crash", "timeout")
# no confirmation before crowning (three more Ray runs per candidate: CI's time; test_confirm covers it)
TUNE = ["--model", "gpt2-tiny", "--world-size", "2", "--global-batch", "8", "--seq-len", "32",
        "--memory-budget", "4MiB", "--measured-steps", "1", "--concurrency", "1", "--confirm", "0", "--quiet"]


@pytest.fixture
def ray_tmp():
    """A short temp dir for the Ray head (its socket paths may not exceed ~107 bytes)."""
    path = tempfile.mkdtemp(prefix="sr", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(tmp_path: Path, mark: str, ray_tmp: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    # every process the tuner starts (Ray head, agents, workers, ranks) inherits the mark
    return {**os.environ, "HOME": str(home), "SLAPO_RAY_TMPDIR": ray_tmp, "SLAPO_TEST_MARK": mark,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")]))}


def _marked(mark: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SLAPO_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _assert_nothing_left(mark: str) -> None:
    deadline = time.monotonic() + 30
    left = _marked(mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _marked(mark)
    assert not left, f"processes of the study still running: {left}"


def _rows(out: Path) -> pd.DataFrame:
    return pd.read_csv(out / "trials.csv")


def _launched_points(frame: pd.DataFrame, knobs: list[str]) -> list[tuple]:
    return [tuple(r) for r in frame[frame.status.isin(LAUNCHED)][knobs].itertuples(index=False)]


KNOBS = list(PLAN_KNOBS)  # a point is all of them (points differing in ckpt_policy alone are two)


def _dashboard_trial_names(out: Path, home: Path) -> set[str]:
    head = json.loads((out / ".ray_head.json").read_text())
    token = (home / ".ray" / "auth_token").read_text().strip()
    req = urllib.request.Request(f"{head['dashboard']}/api/v0/actors?limit=1000",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        data = json.load(resp)
    names: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("name"), str) and x["name"].startswith("trial-"):
                names.add(x["name"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(data)
    return names


def _listening(pids: list[int]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``pids`` and their descendants."""
    import psutil

    processes: dict[int, psutil.Process] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            processes[pid] = psutil.Process(pid)
            processes.update((child.pid, child) for child in processes[pid].children(recursive=True))
    found = set()
    # one pass over the machine's sockets, not one per process (each pass parses all of them, Ray's
    # many): per process, watching took 6 s of CPU from the trials it watched, 7x what this takes
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in processes:
            with contextlib.suppress(psutil.Error):  # (one that ended meanwhile has nothing to show)
                found.add((processes[c.pid].name(), c.laddr.ip, c.laddr.port))
    return found


def _run_watched(cmd: list[str], env: dict[str, str], out: Path, logs: Path, watch: dict, *,
                 kill_after_launched: int | None = None) -> subprocess.Popen:
    """Run the tuner, gathering meanwhile (into ``watch``) every listening socket of the driver, the
    head it started (by the head's PID) and their processes (GCS, raylet, dashboard and agents,
    client server, trial actors), and the trial actors' names from the dashboard's state API.
    With ``kill_after_launched``: SIGKILL the driver once that many trials were launched."""
    # (output to files: sockets are watched until the end, nobody reads a pipe meanwhile)
    with open(logs.with_suffix(".out"), "w") as stdout, open(logs.with_suffix(".err"), "w") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):
                watch["head"] = json.loads((out / ".ray_head.json").read_text())["pid"]
                watch["listening"] |= _listening([proc.pid, watch["head"]])
                watch["names"] |= _dashboard_trial_names(out, Path(env["HOME"]))  # trial actors, by name
            if kill_after_launched and (out / "trials.csv").is_file() \
                    and len(_launched_points(_rows(out), KNOBS)) >= kill_after_launched:
                assert proc.poll() is None, "the first run finished before it could be killed"
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.5)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc


def test_tune_killed_and_resumed_end_to_end(tmp_path, ray_tmp):
    """One study through a local head: the driver SIGKILLed after 2 trials, the same command resumes
    it to exactly the requested 4 (none twice), prunes by the cost model, exports the best schedule,
    shows its trial actors by name in the dashboard, and the head (its agents, workers, ranks)
    listens on the loopback only and leaves no process and no temp folder behind."""
    out, mark = tmp_path / "study", uuid.uuid4().hex
    env = _env(tmp_path, mark, ray_tmp)
    # random: the default strategy now avoids points predicted over the budget, so that pruning is
    # rare among its first trials; random's (seeded) proposals are pruned or launched as they come
    cmd = [sys.executable, "-m", "slapo_tune.cli", "tune", *TUNE, "--trials", "4", "--strategy", "random",
           "--out", str(out)]
    watch: dict = {"listening": set(), "names": set()}
    first = _run_watched(cmd, env, out, tmp_path / "first", watch, kill_after_launched=2)
    assert first.returncode == -signal.SIGKILL
    assert len(_launched_points(_rows(out), KNOBS)) == 2
    second = _run_watched(cmd, env, out, tmp_path / "second", watch)
    stdout, stderr = (tmp_path / "second.out").read_text(), (tmp_path / "second.err").read_text()
    assert second.returncode == 0, stderr[-3000:]
    seen, listening = watch["names"], watch["listening"]
    assert seen and all(" rank " in name and "tp=" in name for name in seen), seen
    names = {name for name, _, _ in listening}
    assert {"gcs_server", "raylet", "ray::DashboardAgent"} <= names, listening
    assert any(name.startswith("ray::_RankActor") for name in names), listening  # a trial's ranks too
    assert [s for s in listening if not is_loopback(s[1])] == []
    assert not list(Path(ray_tmp).glob("slapo-ray-*"))  # the re-attached head's temp folder went with it
    frame = _rows(out)
    launched = _launched_points(frame, KNOBS)
    assert len(launched) == 4 and len(set(launched)) == 4  # exactly the requested trials, none twice
    # each rank's place: the local head's node (on the loopback), on its CPU
    head_node = {place.split(":")[0] for nodes in frame[frame.status == "ok"].nodes for place in nodes.split()}
    assert len(head_node) == 1 and head_node.pop().startswith("127.0.0.1/"), frame.nodes.tolist()
    pruned = {tuple(r) for r in frame[frame.status == "pruned"][KNOBS].itertuples(index=False)}
    assert pruned and not pruned & set(launched)  # pruned points were never launched
    assert (frame[frame.status == "pruned"].pruned_peak > 4 * 2**20).all()  # by the mode that pruned it
    schedule = read_schedule(out / "best_schedule.json")
    ok = frame[frame.status == "ok"]
    best = ok.loc[ok.samples_per_s.idxmax()]
    assert schedule["measured"]["samples_per_s"] == pytest.approx(best.samples_per_s)  # --confirm 0
    assert frame.crowned.sum() == 1 and bool(best.crowned)
    assert {k: schedule["knobs"][k] for k in ("tp", "pp", "micro_batch")} == {k: int(best[k]) for k in ("tp", "pp", "micro_batch")}
    assert max(schedule["measured"]["peak_memory"]) <= 4 * 2**20
    assert "data:image/png;base64" in (out / "report.html").read_text()
    assert "best:" in stdout and "slapo-tune show" in stdout
    _assert_nothing_left(mark)
    assert main(["show", str(out)]) == 0


@pytest.mark.parametrize("extra,message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--space", "no-such-space"], "unknown space/template 'no-such-space'"),
    # (3 ranks are legal since uneven stages: pp=3 cuts 1, 2, 1 blocks; 5 exceed the 4 blocks)
    (["--world-size", "5", "--global-batch", "8"], "no legal schedule for gpt2-tiny on 5 ranks"),
    (["--ray-address", "127.0.0.1:1"], "cannot reach the Ray cluster at 127.0.0.1:1"),
    (["--storage", "nosuchdb://user:hunter2@host/db"], "cannot open storage nosuchdb://user:***@host/db"),
    (["--storage", "not-a-url"], "unreadable storage URL 'not-a-url'"),
    (["--storage-file", "/no/such/file"], "storage file /no/such/file does not exist"),
    (["--storage-file", "/dev/zero"], "storage file /dev/zero is not a regular file"),
    (["--storage", "sqlite:///a.db", "--storage-file", "f"], "argument --storage-file: not allowed with argument --storage"),
    (["--memory-budget", "4XB"], "unparsable size '4XB'"),
    (["--strategy", "simulated-annealing"], "unknown strategy 'simulated-annealing'"),
    (["--knobs", "tp=3"], "tp=3 is not legal for this model and world; legal values: 1, 2"),
    (["--knobs", "tp=2,pp=2"], "pp=2 is not legal for this model and world with tp=2; legal values: 1"),
    (["--knobs", "speed=max"], "unknown knob 'speed'"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    code = main(["tune", "--model", "gpt2-tiny", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert "hunter2" not in err
    assert not out.exists()


def test_output_folder_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "taken"
    out.write_text("keep me")
    code = main(["tune", "--model", "gpt2-tiny", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "is a file" in err and out.read_text() == "keep me"
