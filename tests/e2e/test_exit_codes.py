"""Exit codes a scheduler can act on: a tune that produced no result exits 3 (not 0) with one line,
and a local Ray head that does not come up is an infrastructure failure (1), not a usage error (2)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from runners import ray_cluster
from slapo_tune.cli import EXIT_FAILED, EXIT_NO_RESULT, EXIT_USAGE, main
from slapo_tune.search._storage import STORAGE_ENV

# a space of a few points (micro-batch sizes) on 2 ranks, one measured step per trial
SMALL = ["--ray-address", "none", "--model", "gpt2-tiny", "--world-size", "2", "--global-batch", "8",
         "--seq-len", "32", "--measured-steps", "1", "--confirm", "0",
         "--knobs", "tp=1,pp=1,zero=0,ckpt_ratio=0,attn=sdpa,fuse=off"]


def _run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning would be a line more on stderr
        code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def test_nothing_fits_exits_3_before_starting_with_one_line_naming_a_budget_that_fits(capsys, tmp_path):
    """No point of the space fits: one line naming the smallest predicted peak and a budget that
    holds it (what plan finds), exit 3, before any head, rank or study starts (not one line per
    pruned point after pruning the space); the budget it names passes that check."""
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "tune", *SMALL, "--memory-budget", "1KiB", "--out", str(out))
    assert code == EXIT_NO_RESULT and stdout == "" and len(err) == 1, err
    assert err[0].startswith("slapo-tune: no result: no point fits the memory budget of 0.0 MiB per rank, as the "
                             "cost model predicts (nothing was started): the smallest predicted peak is "), err
    from slapo_tune.cli.tune import nothing_fits_line
    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.problem import ProblemSpec
    from slapo_tune.units import parse_size

    named = err[0].rsplit("rerun with --memory-budget ", 1)[1].removesuffix(" or more")
    problem = ProblemSpec(model="gpt2-tiny", world_size=2, global_batch=8, seq_len=32, precision="fp32", device="cpu",
                          memory_budget=parse_size(named)).resolve().pinned(SMALL[SMALL.index("--knobs") + 1])
    cost = CostModel(problem, hardware("cpu"))
    assert nothing_fits_line(cost, problem, parse_size(named)) is None  # the budget named fits a point
    assert nothing_fits_line(cost, problem, parse_size(named) - 2**20) is not None  # and a MiB less does not
    assert not out.exists()  # no study, no outputs: nothing ran


def test_every_trial_failing_exits_3_with_one_line_naming_the_most_common_failure(capsys, tmp_path):
    """Rank 1 of every trial raises mid-step (a fault-injecting template): exit 3, one line with the
    trials by how they failed and the most common failure's error; ``show`` lists the trials and
    exits 0; ``export`` writes no schedule and exits 3."""
    out = tmp_path / "out"
    code, stdout, err = _run(capsys, "tune", *SMALL, "--knobs", "micro_batch=1", "--space", "_fault_templates:Raises",
                             "--trials", "1", "--quiet", "--out", str(out))
    assert code == EXIT_NO_RESULT and stdout == ""
    said = [line for line in err if not line.startswith("  ")]  # (the run's header wraps onto indented lines)
    assert said[1:] == [f"slapo-tune: no result: every trial failed, 1 launched (1 crash); most common: 1 crash "
                       f"(rank 1 raised RuntimeError: injected failure in block 0) (stopped: --trials spent); "
                       f"each point's outcome is in {out / 'trials.csv'}"], err
    code, stdout, _ = _run(capsys, "show", str(out))
    assert code == 0 and "crash" in stdout and "best: none yet" in stdout
    code, stdout, err = _run(capsys, "export", "--storage", str(out / "study.journal"), "--out", str(tmp_path / "x"),
                             "--space", "_fault_templates:Raises")
    assert code == EXIT_NO_RESULT and stdout == "" and len(err) == 1, err
    assert err[0].startswith("slapo-tune: study 'out' has no result, so no best_schedule.json: every trial failed")
    assert not (tmp_path / "x" / "best_schedule.json").exists() and (tmp_path / "x" / "trials.csv").is_file()


class _FastClock:
    """``time`` for ray_cluster: every reading 100 s after the last, sleeping takes no time (a head
    that never answers times out at once, whatever the timeout)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 100.0
        return self.now

    def sleep(self, _seconds: float) -> None:
        pass


@pytest.mark.parametrize("head", ["silent", "exits"])
def test_a_local_head_that_does_not_come_up_is_not_a_usage_error(capsys, tmp_path, monkeypatch, head):
    """A head that never answers (a loaded machine) or that exits while starting: one line naming
    the head's log, exit 1 (infrastructure), not 2; the head's process is stopped. The head would
    not have seen the study's storage URL (its environment variable is withheld from it)."""
    for name, value in ray_cluster.LOCAL_HEAD_ENV.items():  # (connect sets them in this process: restored after)
        monkeypatch.setenv(name, value)
    # the "head": a process of its own session, as start_head makes it, that never listens
    lifetime = 0 if head == "exits" else 600
    proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({lifetime})"], start_new_session=True)
    try:
        if head == "exits":
            proc.wait(timeout=30)
        withheld = []
        monkeypatch.setattr(ray_cluster, "start_head", lambda out, cpus, hidden: withheld.append(hidden)
                            or (proc.pid, "127.0.0.1:9", "http://x", None))
        monkeypatch.setattr(ray_cluster, "time", _FastClock())
        code, stdout, err = _run(capsys, "tune", *SMALL, "--ray-address", "local", "--out", str(tmp_path / "out"))
        assert code == EXIT_FAILED and code != EXIT_USAGE and len(err) == 1, err
        assert withheld == [(STORAGE_ENV,)]
        what = "did not answer at 127.0.0.1:9" if head == "silent" else "exited while starting"
        assert err[0].startswith(f"slapo-tune: the local Ray head {what}"), err
        assert err[0].endswith(f"(log: {tmp_path / 'out' / 'ray_head.log'})"), err
        assert "; --ray-address none runs the trials as local processes, without Ray (log:" in err[0], err
        assert proc.wait(timeout=30) is not None  # stopped by the tuner (by its process group)
        assert not (tmp_path / "out" / ray_cluster.HEAD_FILE).exists()
    finally:
        proc.kill()
        proc.wait()
