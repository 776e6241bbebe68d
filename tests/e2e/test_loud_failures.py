"""Failures that must not look like success: a world larger than the cores refused before anything
starts (unless insisted on), a local Ray head that does not start says why in one line and what
runs without Ray, a head file left by a dead head is removed, and a study with no result names
its most common failure. (Nothing fitting the budget, and every trial failing, through the
command line: test_exit_codes.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from runners import ray_cluster
from slapo_tune import device
from slapo_tune.cli import EXIT_FAILED, EXIT_NO_RESULT, EXIT_USAGE, main
from slapo_tune.cli import tune as tune_command

TUNE = ["tune", "--ray-address", "none", "--model", "gpt2-tiny", "--global-batch", "8", "--seq-len", "32",
        "--confirm", "0", "--knobs", "tp=1,pp=1,zero=0,ckpt_ratio=0,attn=sdpa,fuse=off"]


class _StandInTuner:
    """Stands in for the driver: records that the command got as far as tuning; runs nothing."""

    made: list = []

    def __init__(self, config, runner, **_):
        _StandInTuner.made.append(config)
        self.study = SimpleNamespace(study_name="s", user_attrs={}, get_trials=lambda **_: [])

    def run(self) -> dict:
        return {"stop": "trials", "launched": 0, "pruned": 0, "failed": 0, "infrastructure": 0, "duplicates": 0,
                "best_point": None, "confirmed": None, "elapsed": 0.0}


def test_a_cpu_world_larger_than_the_cores_is_refused_unless_insisted(capsys, tmp_path, monkeypatch):
    """4 ranks on 2 usable cores: one line naming --oversubscribe, exit 2, before the tuner is made;
    with --oversubscribe it tunes, with one warning line; 2 ranks on 2 cores, no warning."""
    monkeypatch.setattr(device, "usable_cores", lambda: [0, 1])
    monkeypatch.setattr(tune_command, "Tuner", _StandInTuner)
    _StandInTuner.made.clear()
    code = main([*TUNE, "--world-size", "4", "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err.splitlines()
    assert code == EXIT_USAGE and len(err) == 1, err
    assert err[0].startswith("slapo-tune: error: 4 cpu ranks on this machine's 2 usable core(s): ranks would take "
                             "turns on the cores"), err
    assert err[0].endswith("use --world-size 2 or less, run it on a Ray cluster, or insist with --oversubscribe")
    assert _StandInTuner.made == [] and not (tmp_path / "a").exists()

    code = main([*TUNE, "--world-size", "4", "--oversubscribe", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err.splitlines()
    assert code == EXIT_NO_RESULT and [c.problem.world_size for c in _StandInTuner.made] == [4]  # (the stand-in: no result)
    warnings = [line for line in err if "warning" in line]
    assert warnings == ["slapo-tune: warning: 4 cpu ranks on this machine's 2 usable core(s) (--oversubscribe): the "
                        "ranks take turns on the cores, so trials run slower and their figures include that"], err

    code = main([*TUNE, "--world-size", "2", "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert code == EXIT_NO_RESULT and len(_StandInTuner.made) == 2 and "warning" not in err and "usable core" not in err


# what `ray start --head --block` writes when its GCS cannot start (stands in for Ray, whatever the load)
FAILING_RAY = """#!/bin/sh
echo "Usage stats collection is disabled."
echo "Local node IP: 127.0.0.1"
echo "Traceback (most recent call last):"
echo '  File "ray/_private/node.py", line 1, in start_gcs_server'
echo "ValueError: GCS could not bind 127.0.0.1:6379 (Address already in use)"
echo
echo "Remaining processes will be killed."
exit 1
"""


def test_a_local_head_that_exits_says_why_from_its_log_and_what_runs_without_ray(capsys, tmp_path, monkeypatch):
    """The real start_head, with a `ray` that fails as Ray does: one line with the reason from this
    head's lines of ray_head.log (not an earlier head's, not Ray's closing words) and the
    --ray-address none that needs no head; exit 1; the head's temp folder and head file removed."""
    for name, value in ray_cluster.LOCAL_HEAD_ENV.items():  # (connect sets them in this process: restored after)
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))  # not the user's ~/.ray
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(FAILING_RAY)
    (bin_dir / "ray").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))  # start_head takes the `ray` beside Python
    out = tmp_path / "out"
    out.mkdir()
    log = out / "ray_head.log"
    log.write_text("slapo-tune: starting a Ray head: ray start ...\nRuntimeError: an earlier head's failure\n")
    code = main([*TUNE, "--world-size", "2", "--ray-address", "local", "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert code == EXIT_FAILED and len(err) == 1, err
    assert err[0] == ("slapo-tune: the local Ray head exited while starting: ValueError: GCS could not bind "
                      "127.0.0.1:6379 (Address already in use); --ray-address none runs the trials as local "
                      f"processes, without Ray (log: {log})")
    started = log.read_text().splitlines()[2]
    assert started.startswith(f"slapo-tune: starting a Ray head: {bin_dir / 'ray'} start --head")
    temp = started.split("--temp-dir=", 1)[1].split()[0]
    assert not (out / ray_cluster.HEAD_FILE).exists() and not Path(temp).exists()


@pytest.mark.parametrize("text,reason", [
    # Ray's own report of a subprocess that died: the failing line of the tail it quotes
    ("Some Ray subprocesses exited unexpectedly:\n  gcs_server [exit code=1]\n\n"
     "----- BEGIN gcs_server.err tail (exit code(s)=1) -----\n"
     "[2026-01-01 00:00:00,000 E 12 12] gcs_server.cc:80: Failed to bind port 6379\n"
     "----- END gcs_server.err tail (exit code(s)=1) -----\n\nRemaining processes will be killed.\n",
     "[2026-01-01 00:00:00,000 E 12 12] gcs_server.cc:80: Failed to bind port 6379"),
    ("\x1b[31mray.exceptions.RaySystemError: System error: no space left on device\x1b[0m\nbye\n",
     "ray.exceptions.RaySystemError: System error: no space left on device"),
    ("Local node IP: 127.0.0.1\nStarting the head...\n", "Starting the head..."),  # nothing failed yet: its last line
    ("", "nothing in its log"),
    ("x" * 500 + " error\n", "x" * 197 + "..."),
])
def test_the_reason_read_from_a_heads_log(tmp_path, text, reason):
    log = tmp_path / "ray_head.log"
    log.write_text(text)
    assert ray_cluster.head_log_reason(log) == reason
    assert ray_cluster.head_log_reason(tmp_path / "none.log") == "nothing in its log"


def test_a_head_file_of_a_dead_head_is_removed_and_a_live_ones_kept(tmp_path):
    """A head file whose PID has ended (spawned and reaped here) is removed with the head's temp
    folder, whichever --ray-address; an unreadable one too; a live head's file is kept, and so is
    a temp folder a running process names (a head started since on that port)."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    out, temp, busy = tmp_path / "out", tmp_path / "slapo-ray-1", tmp_path / "slapo-ray-2"
    for folder in (out, temp / "session_latest", busy):
        folder.mkdir(parents=True)
    head_file = out / ray_cluster.HEAD_FILE

    def record(pid: int, folder) -> None:
        head_file.write_text(json.dumps({"pid": pid, "address": "127.0.0.1:9", "dashboard": "http://127.0.0.1:9",
                                         "temp": str(folder)}))

    record(ended.pid, temp)
    ray_cluster.connect("none", out, 2, None).stop()
    assert not head_file.exists() and not temp.exists()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", f"--temp-dir={busy}"],
                            start_new_session=True)
    try:
        record(live.pid, busy)
        ray_cluster.connect("none", out, 2, None).stop()
        assert head_file.is_file() and busy.is_dir()  # its head runs
        record(ended.pid, busy)
        ray_cluster.connect("none", out, 2, None).stop()
        assert not head_file.exists() and busy.is_dir()  # a running process names the folder
    finally:
        live.kill()
        live.wait()
    head_file.write_text('{"pid": ')  # cut short
    assert ray_cluster.remove_stale_head(out) and not head_file.exists()
    assert not ray_cluster.remove_stale_head(out)  # nothing there


def _study(*trials: tuple[str, str]):
    """An in-memory study whose trials ended as ``(status, error)`` say."""
    study = optuna.create_study(directions=["maximize"])
    for n, (status, error) in enumerate(trials):
        study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.FAIL, params={}, distributions={},
            user_attrs={"point": {"micro_batch": n}, "status": status, "result": {"error": error}}))
    return study


def test_no_result_names_the_most_common_failure_and_its_setting():
    """Trials by how they failed: the most common kind named with its most frequent error and,
    for a timeout or an out-of-memory, the setting to change (64 ranks on 2 cores timed out and
    were told to loosen --memory-budget)."""
    from slapo_tune.search._report import no_result_reason

    waited = "timed out after 300 s waiting for rank(s) [0, 1]"
    study = _study(("timeout", waited), ("crash", "rank 1 raised RuntimeError: x"), ("timeout", waited),
                   ("pruned", ""), ("timeout", "timed out after 300 s waiting for rank(s) [1]"))
    assert no_result_reason(study) == (
        f"every trial failed, 4 launched (3 timeout, 1 crash); 1 pruned; most common: 3 timeout ({waited}); a longer "
        "--trial-timeout (or fewer ranks per core) gives them time")
    assert no_result_reason(_study(("oom", "rank 0 raised OutOfMemoryError"), ("crash", "a"))).endswith(
        "most common: 1 oom (rank 0 raised OutOfMemoryError); their measured peaks exceeded the budget: raise "
        "--memory-budget")  # (equal counts: the first in TrialStatus's order)
    assert no_result_reason(_study(("lost", "node 1 died"), ("lost", "node 1 died"), ("interrupted", ""))) == (
        "nothing was measured (1 interrupted, 2 lost); most common: 2 lost (node 1 died)")
