"""Fault injection: a study survives what happens to real ones. A damaged journal record, a disk
that fills up mid-study, a trial that leaks memory and threads, the driver killed at random
moments. Each time the study completes or stops with one clear line, no finished trial is lost
or run twice, and ``best_schedule.json`` is the previous valid file or the new valid one."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slapo_tune.schedule_file import read_schedule

from _fault_templates import LEAKED_BYTES

ROOT = Path(__file__).resolve().parents[2]

# A replayed study (recorded trials, no training) whose outputs and journal go to OUT.
REPLAY_STUDY = textwrap.dedent("""
    import sys
    from pathlib import Path
    from benchmarks.search_strategies import GRID, load_grid
    from runners.replay import ReplayRunner
    from slapo_tune.problem import ProblemSpec
    from slapo_tune.search import TuneConfig, Tuner

    out, trials = Path(sys.argv[1]), int(sys.argv[2])
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    hang_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1


    class Hangs(ReplayRunner):  # the trial launched as number `hang_at` never returns
        def run(self, spec):
            if len(self.launched) == hang_at:
                (out / "hanging").write_text(spec.name)
                import time
                time.sleep(3600)
            return super().run(spec)


    results, budget = load_grid()
    problem = ProblemSpec(GRID["model"], GRID["world_size"], template="benchmarks.search_strategies:FixedAttention",
                          global_batch=GRID["global_batch"], seq_len=GRID["seq_len"], memory_budget=budget)
    config = TuneConfig(problem=problem, out=out, trials=trials, strategy="tpe", seed=0, prune="analytic")
    tuner = Tuner(config, Hangs(results))
    if limit:  # from here on, no file may grow past `limit` bytes: a full disk quota
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        summary = tuner.run()
    except Exception as exc:
        print(f"STOPPED {type(exc).__name__}: {exc}")
        sys.exit(1)
    print("DONE", summary["launched"])
""")


def _replay_command(out: Path, trials: int, limit: int = 0, hang_at: int = -1) -> list[str]:
    return [sys.executable, "-c", REPLAY_STUDY, str(out), str(trials), str(limit), str(hang_at)]


def _replay_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _replay(out: Path, trials: int, limit: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run(_replay_command(out, trials, limit), env=_replay_env(), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def _trials(out: Path) -> list:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
    return optuna.load_study(storage=storage, study_name=out.name).trials


def _finished(out: Path) -> dict[str, str]:
    """Point -> status of every trial recorded in the study journal."""
    points = {}
    for t in _trials(out):
        status = t.user_attrs.get("status")
        if t.state.is_finished() and "point" in t.user_attrs and status not in (None, "pruned", "duplicate",
                                                                                 "interrupted"):
            key = json.dumps(t.user_attrs["point"], sort_keys=True)
            assert key not in points, f"{key} run twice"
            points[key] = status
    return points


def _schedule_is_whole(out: Path) -> None:
    path = out / "best_schedule.json"
    if path.exists():
        read_schedule(path)  # a partial file would not parse or validate
    assert not list(out.glob(".*.tmp")), "a temporary file was left behind"


def test_damaged_last_journal_record_is_cut_and_the_study_resumes(tmp_path):
    out = tmp_path / "study"
    first = _replay(out, 4)
    assert first.returncode == 0 and "DONE 4" in first.stdout, first.stderr[-2000:]
    before = _finished(out)
    with open(out / "study.journal", "a") as f:
        f.write('{"op_code": 6, "worker_id": "cut-sho')  # a record cut short by a crash
    second = _replay(out, 6)
    assert second.returncode == 0 and "DONE 6" in second.stdout, second.stderr[-2000:]
    assert "last record" in second.stderr and "was damaged" in second.stderr
    assert list(out.glob("study.journal.damaged-*"))
    after = _finished(out)
    assert before.items() <= after.items() and len(after) == 6
    _schedule_is_whole(out)


def test_resume_requeues_the_interrupted_trial_and_keeps_every_finished_result(tmp_path):
    """The driver is SIGKILLed while its 5th trial runs. Re-running the same command keeps every
    finished trial exactly (values, status, measurements, predictions), runs the interrupted point
    again (once, as a retry of it) and then only new points, until the requested count."""
    out = tmp_path / "study"
    driver = subprocess.Popen(_replay_command(out, 8, hang_at=4), env=_replay_env(), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (out / "hanging").exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (out / "hanging").exists(), "the driver never reached the hanging trial"
    finally:
        driver.kill()  # SIGKILL, by PID
        driver.wait(timeout=60)

    def by_number(trials):
        return {t.number: (t.state.name, t.values, t.user_attrs.get("status"), t.user_attrs.get("point"),
                           t.user_attrs.get("result"), t.user_attrs.get("predicted")) for t in trials}

    before = _trials(out)
    finished = {n: v for n, v in by_number(before).items() if v[0] != "RUNNING"}
    running = [t for t in before if t.state.name == "RUNNING"]
    assert len(running) == 1 and running[0].user_attrs["point"]
    launched = [v for v in finished.values() if v[2] in ("ok", "oom")]
    assert len(launched) == 4  # four trials measured before the kill

    resumed = _replay(out, 8)
    assert resumed.returncode == 0 and "DONE 8" in resumed.stdout, resumed.stderr[-2000:]
    after = _trials(out)
    now = by_number(after)
    for number, record in finished.items():  # nothing finished is lost or changed
        assert now[number] == record, number
    assert now[running[0].number][0] == "FAIL"  # failed by the resumed driver, and shown as interrupted
    with open(out / "trials.csv") as f:
        shown = {int(row["trial"]): row["status"] for row in csv.DictReader(f)}
    assert shown[running[0].number] == "interrupted"
    retries = [t for t in after if t.user_attrs.get("retry_of") == running[0].number]
    assert len(retries) == 1 and retries[0].user_attrs["point"] == running[0].user_attrs["point"]
    assert retries[0].user_attrs["status"] in ("ok", "oom")  # the interrupted point ran again, once
    assert len(_finished(out)) == 8  # launched points, none twice (_finished checks)


def test_full_disk_stops_with_one_line_and_loses_nothing(tmp_path):
    out = tmp_path / "study"
    first = _replay(out, 4)
    assert first.returncode == 0, first.stderr[-2000:]
    before = _finished(out)
    best = (out / "best_schedule.json").read_text()
    # the next outputs cannot be written: the journal may grow a little, the report not at all
    limit = (out / "study.journal").stat().st_size + 2048
    full = _replay(out, 8, limit=limit)
    assert full.returncode == 1
    line = full.stdout.strip().splitlines()[-1]
    assert line.startswith("STOPPED SlapoTuneError: stopped: cannot write") and "re-run the same command" in line
    assert "Traceback" not in full.stdout
    _schedule_is_whole(out)
    now = (out / "best_schedule.json").read_text()
    assert now == best or read_schedule(out / "best_schedule.json")  # the old file, or a whole new one
    assert before.items() <= _finished(out).items()
    resumed = _replay(out, 8)  # space freed: the same command resumes
    assert resumed.returncode == 0 and "DONE 8" in resumed.stdout, resumed.stderr[-2000:]
    after = _finished(out)
    assert before.items() <= after.items() and len(after) == 8
    _schedule_is_whole(out)


def test_trial_leaking_memory_and_threads_does_not_reach_the_next(no_leftover_children):
    from runners import LocalRunner
    from runners.trial import TrialSpec
    from slapo_tune.problem import ProblemSpec

    def spec(template: str, name: str) -> TrialSpec:
        problem = ProblemSpec("gpt2-tiny", 2, template=template, global_batch=8, seq_len=32)
        return TrialSpec(problem, knobs={"tp": 1, "pp": 1, "micro_batch": 2}, warmup_steps=1, measured_steps=2,
                         name=name)

    import torch

    # the launcher holds more than any rank: a rank's peak must be its own, not inherited across exec
    launcher = torch.ones(2**30 // 4)
    runner = LocalRunner()
    try:
        leaky = runner.run(spec("_fault_templates:LeaksMemoryAndThreads", "leaky"))
        clean = runner.run(spec("gpt2", "clean"))
    finally:
        runner.close()
    assert leaky.status == "ok" and clean.status == "ok", (leaky.error, clean.error)
    leaked = LEAKED_BYTES
    # every rank of the leaky trial held the leak; the next trial's ranks start fresh
    assert min(leaky.peak_rss) > leaked
    assert max(clean.peak_rss) < min(leaky.peak_rss) - leaked // 2
    assert max(leaky.peak_rss) < launcher.numel() * 4


def test_a_process_exec_from_a_large_launcher_reports_its_own_peak():
    """A rank started by fork and exec (the spawn start method: NCCL ranks, or gloo ranks whose
    socket path is too long for the forkserver) reports its own peak, not the launcher's:
    ``ru_maxrss`` carries the launcher's high-water mark across exec on Linux, ``VmHWM`` does not."""
    import multiprocessing

    import torch

    from slapo_tune.launch import peak_rss_bytes

    launcher = torch.ones(2**30 // 4)  # 1 GiB, touched: the launcher's resident high-water mark
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(peak_rss_bytes)
    assert 0 < child < launcher.numel() * 4 // 2, child


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_driver_killed_at_a_random_moment_resumes(tmp_path, seed, no_leftover_children):
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "slapo_tune", "tune", "--model", "gpt2-tiny", "--world-size", "2", "--trials", "4",
           "--ray-address", "none", "--memory-budget", "64MiB", "--global-batch", "8", "--seq-len", "32",
           "--measured-steps", "1", "--seed", str(seed), "--out", str(out), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    time.sleep(random.Random(seed).uniform(3.0, 40.0))
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and every rank it started
    driver.wait(timeout=60)
    before = _finished(out) if (out / "study.journal").exists() else {}
    if (out / "best_schedule.json").exists():
        read_schedule(out / "best_schedule.json")
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = _finished(out)
    assert before.items() <= after.items()
    assert len(after) == 4
    _schedule_is_whole(out)
