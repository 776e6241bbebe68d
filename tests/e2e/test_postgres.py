"""A study on a real PostgreSQL server (started by the session's ``postgres`` fixture: pgserver, no
root): tuned, the driver SIGKILLed and resumed with the finished trials kept, the URL given by a
file and by the environment, and the password in no line, event or file the runs wrote (grep);
a wrong password and a missing driver end in one line, exit 2, nothing shown of the secret.

Trials run as local processes (``--ray-address none``) of one rank: Ray is not the point here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import pandas as pd
import pytest

from slapo_tune.cli import main
from slapo_tune.errors import UsageError
from slapo_tune.search._storage import STORAGE_ENV, redact, storage_url

TUNE = ["tune", "--model", "gpt2-tiny", "--world-size", "1", "--global-batch", "2", "--seq-len", "16",
        "--memory-budget", "64MiB", "--measured-steps", "1", "--prune", "analytic", "--concurrency", "1",
        "--ray-address", "none", "--study", "pg-study", "--trials", "2"]
LAUNCHED = ("ok", "oom", "crash", "timeout")


def _secrets(password: str) -> list[str]:
    """The password as a leak would show it: as set, and URL-encoded as in the URL."""
    return [password, quote(password, safe="")]


def _grep(secrets: list[str], where: Path, exclude_dir: str | None = None) -> list[str]:
    """Files under ``where`` holding any of ``secrets``, by grep (which slapo-tune does not use)."""
    cmd = ["grep", "-rlF", *[arg for s in secrets for arg in ("-e", s)], str(where)]
    if exclude_dir:
        cmd.insert(1, f"--exclude-dir={exclude_dir}")
    found = subprocess.run(cmd, capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr  # 2: grep itself failed
    return found.stdout.splitlines()


def _study_trials(postgres, database: str) -> dict[int, str]:
    """Trial number -> state, read from the server with SQL (not through Optuna)."""
    import psycopg

    with psycopg.connect(postgres.superuser_url.replace("/postgres?", f"/{database}?")) as conn:
        if conn.execute("SELECT to_regclass('trials')").fetchone()[0] is None:  # tables not made yet
            return {}
        rows = conn.execute("SELECT t.number, t.state FROM trials t JOIN studies s USING (study_id) "
                            "WHERE s.study_name = 'pg-study'").fetchall()
    return {number: str(state) for number, state in rows}


def test_tune_on_postgresql_killed_resumed_and_the_password_in_no_output(tmp_path, postgres, monkeypatch, capfd):
    url = postgres.create_database("tune_resume")
    secret_dir, logs, out = tmp_path / "secret", tmp_path / "logs", tmp_path / "out"
    storage_file = secret_dir / "storage.url"
    cache = tmp_path / "cache"  # whatever the runs write, they write under tmp_path: grep sees it all
    # (not the temporary files of a write in progress: the other xdist worker shares the session's cache)
    shutil.copytree(os.environ["SLAPO_TUNE_CACHE"], cache, ignore=shutil.ignore_patterns("*.tmp"))
    for folder in (secret_dir, logs, tmp_path / "home", tmp_path / "tmp"):
        folder.mkdir()
    storage_file.write_text(f"# the study's database\n{url}\n")
    storage_file.chmod(0o600)  # (the tuner refuses a storage file others may read)
    for name, value in (("HOME", tmp_path / "home"), ("TMPDIR", tmp_path / "tmp"), ("SLAPO_TUNE_CACHE", cache)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                                   os.environ.get("PYTHONPATH")])))

    # 1: a driver of its own, the URL from a file; SIGKILLed once a trial is told and the next one runs
    with open(logs / "1.out", "w") as stdout, open(logs / "1.err", "w") as stderr:
        first = subprocess.Popen([sys.executable, "-m", "slapo_tune.cli", *TUNE, "--out", str(out), "--storage-file",
                                  str(storage_file)], stdout=stdout, stderr=stderr)
        try:
            deadline = time.monotonic() + 180
            while first.poll() is None and time.monotonic() < deadline:
                states = _study_trials(postgres, "tune_resume")
                if "COMPLETE" in states.values() and "RUNNING" in states.values():
                    break
                time.sleep(0.2)
            assert first.poll() is None, (logs / "1.err").read_text()[-2000:]
        finally:
            first.send_signal(signal.SIGKILL)  # by PID, whatever happened
            first.wait()
    told_first = pd.read_csv(out / "trials.csv")
    told_first = told_first[told_first.status.isin(LAUNCHED)]
    assert len(told_first) == 1

    # 2: in this process (its trial's ranks too: fd-level capture), the URL from the environment,
    # JSON lines; resumes the study
    monkeypatch.setenv(STORAGE_ENV, url)
    capfd.readouterr()
    code = main([*TUNE, "--out", str(out), "--json-lines"])
    printed = _keep(capfd.readouterr(), logs / "2")
    assert code == 0, printed.err[-2000:]
    frame = pd.read_csv(out / "trials.csv")
    launched = frame[frame.status.isin(LAUNCHED)]
    assert len(launched) == 2 and launched.trial.nunique() == 2
    kept = launched[launched.trial == told_first.trial.iloc[0]]  # the first run's trial, as it was told
    assert kept.samples_per_s.tolist() == pytest.approx(told_first.samples_per_s.tolist())
    states = _study_trials(postgres, "tune_resume")
    assert "RUNNING" not in states.values() and [states[n] for n in launched.trial] == ["COMPLETE"] * 2
    done = [json.loads(line) for line in printed.out.splitlines() if line.startswith("{")][-1]
    assert done["event"] == "done" and done["config"]["storage"].startswith("postgresql://tuner:***@")

    # 3: the study is done: nothing runs, the outputs are rewritten and the summary printed
    assert main([*TUNE, "--out", str(out)]) == 0
    printed = _keep(capfd.readouterr(), logs / "3")
    assert "optuna-dashboard postgresql://tuner:***@/tune_resume" in printed.out

    secrets = _secrets(postgres.password)
    assert _grep(secrets, secret_dir) == [str(storage_file)]  # grep finds the password where it is
    wrote = [p for p in tmp_path.rglob("*") if p.is_file() and secret_dir not in p.parents]
    assert {"trials.csv", "best_schedule.json", "report.html", "1.err", "2.out", "3.err"} <= {p.name for p in wrote}
    assert _grep(secrets, tmp_path, exclude_dir=secret_dir.name) == []


def _keep(captured, stem: Path):
    """Write captured output to ``STEM.out`` and ``STEM.err`` (for the grep); return it."""
    stem.with_suffix(".out").write_text(captured.out)
    stem.with_suffix(".err").write_text(captured.err)
    return captured


def test_wrong_password_is_one_line_and_shows_no_secret(tmp_path, postgres, monkeypatch, capsys):
    wrong = "not-" + postgres.password
    monkeypatch.setenv(STORAGE_ENV, postgres.url("postgres", password=wrong))
    out = tmp_path / "out"
    code = main([*TUNE, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "password authentication failed" in err, err
    assert "tuner:***@" in err and not [s for s in _secrets(wrong) + _secrets(postgres.password) if s in err]
    assert not out.exists()


def test_a_missing_driver_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as on an install without slapo-tune[postgres]
    out = tmp_path / "out"
    code = main([*TUNE, "--out", str(out), "--storage", "postgresql://tuner:hunter2%2Fx@db.example/study"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "pip install 'slapo-tune[postgres]'" in err, err
    assert "tuner:***@db.example" in err and "hunter2" not in err and not out.exists()


def test_storage_url_comes_from_the_flag_else_the_file_else_the_environment(tmp_path):
    file = tmp_path / "url"
    file.write_text("\n# a comment\n  postgresql://u:from-file@h/db  \nsqlite:///ignored.db\n")
    file.chmod(0o600)
    env = {STORAGE_ENV: "postgresql://u:from-env@h/db"}
    assert storage_url("sqlite:///flag.db", None, env) == "sqlite:///flag.db"
    assert storage_url(None, str(file), env) == "postgresql://u:from-file@h/db"
    assert storage_url(None, None, env) == "postgresql://u:from-env@h/db"
    assert storage_url(None, None, {}) is None  # the journal in the output folder
    file.write_text("# nothing but a comment\n")
    with pytest.raises(UsageError, match="holds no storage URL"):
        storage_url(None, str(file), env)


@pytest.mark.parametrize("text,url,shown", [
    ("postgresql://tuner:s3cret@host/db", None, "postgresql://tuner:***@host/db"),
    ("postgresql://tuner:@/db?host=/run/pg", None, "postgresql://tuner:***@/db?host=/run/pg"),
    ("postgresql:///db?user=tuner&password=s3cret&host=h", None, "postgresql:///db?user=tuner&password=***&host=h"),
    # a driver's message quoting the password (decoded) beside the URL it came from
    ("auth failed for p@ss/w in postgresql://u:p%40ss%2Fw@h/db", "postgresql://u:p%40ss%2Fw@h/db",
     "auth failed for *** in postgresql://u:***@h/db"),
    ("at 10:30@noon, see https://example.com/a", None, "at 10:30@noon, see https://example.com/a"),
])
def test_redact_hides_every_form_of_the_password(text, url, shown):
    assert redact(text, url) == shown
