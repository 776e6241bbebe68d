"""SIGTERM (what kill, systemd and Slurm send) stops a command that runs ranks as Ctrl-C does:
its ranks ended, one line, exit 143 = 128 + 15, and no multiprocessing folder (``pymp-*``) left
in $TMPDIR. A SIGKILLed driver cannot clean up: the next run removes its folder, and only folders
whose owner has ended."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
from test_tune import _assert_nothing_left as assert_nothing_left
from test_tune import _env as tune_env
from test_tune import _marked as marked

from slapo_tune._owned import OWNER_FILE, process_identity, remove_orphans, tag_as_mine

ROOT = Path(__file__).resolve().parents[2]
# one point, trials that run until stopped
TUNE = ["tune", "--ray-address", "none", "--model", "gpt2-tiny", "--world-size", "2", "--global-batch", "8",
        "--seq-len", "32", "--knobs", "tp=1,pp=1,zero=0,ckpt_ratio=0,attn=sdpa,fuse=off,micro_batch=1",
        "--measured-steps", "100000", "--confirm", "0", "--trials", "2", "--json-lines"]


@pytest.fixture
def temp_dir():
    """$TMPDIR of the commands a test runs: short, under /tmp (multiprocessing's socket path there
    may not exceed 107 bytes, or ranks are spawned, slowly), removed after."""
    path = Path(tempfile.mkdtemp(prefix="sg", dir="/tmp"))
    (path / "tmp").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(args: list[str], temp: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(temp / "tmp"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(temp / f"{name}.out", "w") as out, open(temp / f"{name}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "slapo_tune", *args], env=env, stdout=out, stderr=err,
                                cwd=temp)


def _ranks_started(command: subprocess.Popen, temp: Path, name: str, timeout: float = 240) -> list[psutil.Process]:
    """Every process under ``command`` (multiprocessing's helpers, the ranks), once its rank fork
    server runs two ranks."""
    driver = psutil.Process(command.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert command.poll() is None, (temp / f"{name}.err").read_text()[-3000:]
        try:
            under = driver.children(recursive=True)
            ranks = [p for p in under if p.ppid() != command.pid]  # forked by the fork server
        except psutil.Error:
            continue
        if len(ranks) >= 2:
            return under
        time.sleep(0.2)
    raise AssertionError(f"no ranks within {timeout} s: " + (temp / f"{name}.err").read_text()[-3000:])


def _assert_ended(processes: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 15
    while True:
        left = [p for p in processes if _running(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"still running: {[(p.pid, p.cmdline()[:3]) for p in left]}"


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # (is_running: the same process, by start time)
    except psutil.NoSuchProcess:
        return False


def _stop(command: subprocess.Popen) -> None:
    if command.poll() is None:
        command.kill()
    command.wait(timeout=30)


def _sigterm_ends_it_like_ctrl_c(args: list[str], temp: Path, message: str) -> None:
    command = _start(args, temp, "run")
    try:
        under = _ranks_started(command, temp, "run")
        command.send_signal(signal.SIGTERM)
        code = command.wait(timeout=120)
    finally:
        _stop(command)
    err = (temp / "run.err").read_text().splitlines()
    assert code == 128 + signal.SIGTERM and len(err) == 1 and err[0].startswith(message), (code, err[-20:])
    _assert_ended(under)
    assert not list((temp / "tmp").glob("pymp-*"))  # multiprocessing's folder went with it


def test_sigterm_stops_a_tune_and_its_trials_as_ctrl_c_does(temp_dir):
    _sigterm_ends_it_like_ctrl_c([*TUNE, "--out", str(temp_dir / "out")], temp_dir,
                                 "slapo-tune: interrupted; running trials were stopped. Resume with the same command")


def test_sigterm_stops_a_tune_on_a_local_ray_head_and_the_head(temp_dir):
    """Through a Ray head the tuner started: Ray's own SIGTERM handlers (``ray.init``'s calls
    sys.exit, its core worker's dumps a stack and aborts) give way to the command's, so the trial's
    rank actors, the head and every process of it end, its temp folder is removed, and no
    ``pymp-*`` of its dashboard is left in $TMPDIR."""
    mark = uuid.uuid4().hex
    env = {**tune_env(temp_dir, mark, str(temp_dir)), "TMPDIR": str(temp_dir / "tmp")}  # (the head's in temp_dir)
    args = [*TUNE, "--ray-address", "local", "--out", str(temp_dir / "out")]
    with open(temp_dir / "run.out", "w") as out, open(temp_dir / "run.err", "w") as err:
        command = subprocess.Popen([sys.executable, "-m", "slapo_tune", *args], env=env, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while not _rank_actor_running(mark):
            assert command.poll() is None and time.monotonic() < deadline, (temp_dir / "run.err").read_text()[-3000:]
            time.sleep(0.5)
        command.send_signal(signal.SIGTERM)
        code = command.wait(timeout=120)
    finally:
        _stop(command)
        assert_nothing_left(mark)  # the head, its agents and workers, the rank actors
    err = (temp_dir / "run.err").read_text().splitlines()
    assert code == 128 + signal.SIGTERM and len(err) == 1, (code, err[-20:])
    assert err[0].startswith("slapo-tune: interrupted; running trials were stopped. Resume with the same command")
    assert not list(temp_dir.glob("slapo-ray-*")) and not list((temp_dir / "tmp").glob("pymp-*"))


def _rank_actor_running(mark: str) -> bool:
    for pid in marked(mark):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).cmdline()[:1] == ["ray::_RankActor.run"]:
                return True
    return False


def test_sigterm_stops_train_and_its_ranks(temp_dir):
    from test_train import _schedule

    schedule = _schedule(temp_dir / "best_schedule.json", dp=2)
    _sigterm_ends_it_like_ctrl_c(["train", "--schedule", str(schedule), "--steps", "100000"], temp_dir,
                                 "slapo-tune: interrupted")


def test_a_sigkilled_drivers_folder_is_removed_by_the_next_run_and_no_other(temp_dir):
    tmp = temp_dir / "tmp"
    driver = _start([*TUNE, "--out", str(temp_dir / "out")], temp_dir, "killed")
    try:
        deadline = time.monotonic() + 240
        while not list(tmp.glob("pymp-*")) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        under = psutil.Process(driver.pid).children(recursive=True)
        driver.kill()
        driver.wait(timeout=30)
    finally:
        _stop(driver)
    _assert_ended(under)
    left = list(tmp.glob("pymp-*"))
    assert len(left) == 1, (temp_dir / "killed.err").read_text()[-3000:]  # SIGKILL runs no cleanup
    foreign, live = tmp / "pymp-foreign", tmp / "pymp-live"  # another program's; a running process's
    foreign.mkdir()
    live.mkdir()
    tag_as_mine(live)  # (this test's process)
    # the next run, whose budget nothing fits: it starts no rank
    nothing_fits = [*TUNE[:-1], "--memory-budget", "1KiB", "--quiet", "--out", str(temp_dir / "next")]
    again = _start(nothing_fits, temp_dir, "next")
    try:
        assert again.wait(timeout=120) == 3, (temp_dir / "next.err").read_text()[-3000:]
    finally:
        _stop(again)
    assert not left[0].exists() and foreign.is_dir() and live.is_dir()


def test_only_tagged_folders_of_ended_processes_are_removed(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    tags = {"ended": f"{ended.pid} 1", "reused": f"{os.getpid()} 1",  # (this PID, another start time: reused)
            "running": process_identity(os.getpid()), "garbage": "not a pid", "untagged": None}
    for name, tag in tags.items():
        (tmp_path / f"pymp-{name}").mkdir()
        if tag is not None:
            (tmp_path / f"pymp-{name}" / OWNER_FILE).write_text(tag)
    (tmp_path / "other-ended").mkdir()  # another prefix
    (tmp_path / "other-ended" / OWNER_FILE).write_text(tags["ended"])
    (tmp_path / "pymp-a-file").write_text("")
    removed = remove_orphans(tmp_path, "pymp-")
    assert sorted(p.name for p in removed) == ["pymp-ended", "pymp-reused"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-ended", "pymp-a-file", "pymp-garbage",
                                                          "pymp-running", "pymp-untagged"]


def test_sigterm_in_a_deferred_block_takes_effect_at_its_end_and_once():
    """Cleanup that must not stop half-way (stopping a Ray head) finishes first; a second SIGTERM
    while the first one's cleanup runs is ignored; the previous handler is back afterwards."""
    from slapo_tune.cli._signals import sigterm_as_interrupt, termination_deferred
    from slapo_tune.errors import Terminated

    previous = signal.getsignal(signal.SIGTERM)
    finished = []
    with sigterm_as_interrupt():
        with pytest.raises(Terminated) as raised, termination_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # (Python runs the handler meanwhile)
            finished.append(True)
        assert finished and raised.value.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    assert signal.getsignal(signal.SIGTERM) is previous
