"""The storage URL's file and the command that reproduces a study: a ``--storage-file`` others may
read or write is refused as ssh refuses such a private key, a device or pipe is refused without
being read, and the reproduce command gives the storage as it was given (runnable: no ``***``
where the password came from a file or the environment). No database and no trial run here."""

from __future__ import annotations

import os
import shlex
import threading

import pytest

from slapo_tune.cli import build_parser, main
from slapo_tune.errors import UsageError

URL = "postgresql://tuner:s3cret-pw@db.example/tuning"


def _storage_file(tmp_path, mode: int):
    path = tmp_path / "storage.url"
    path.write_text(f"# the study's database\n{URL}\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o660], ids=lambda mode: f"{mode:04o}")
def test_a_storage_file_others_may_read_or_write_is_refused_naming_the_fix(tmp_path, capsys, mode):
    path = _storage_file(tmp_path, mode)
    out = tmp_path / "out"
    code = main(["tune", "--storage-file", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"storage file {path} is open to other users (permissions {mode:04o})" in err
    assert err.rstrip().endswith(f"chmod 600 {path}") and "s3cret" not in err
    assert not out.exists()
    for command in (["show", "--storage-file", str(path)], ["export", "--storage-file", str(path), "--out", str(out)]):
        assert main(command) == 2 and "chmod 600" in capsys.readouterr().err


def test_a_storage_file_of_its_owner_alone_is_read(tmp_path):
    from slapo_tune.search._storage import storage_url

    for mode in (0o600, 0o400):
        assert storage_url(None, str(_storage_file(tmp_path, mode))) == URL


def test_a_storage_file_that_is_a_pipe_is_refused_without_waiting_for_a_writer(tmp_path):
    from slapo_tune.search._storage import storage_url

    fifo = tmp_path / "storage.url"
    os.mkfifo(fifo, 0o600)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(_refusal(storage_url, None, str(fifo))), daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # (old behaviour: blocked in open() for a writer; unblock it)
        with open(fifo, "w"):
            pass
    assert outcome and "is not a regular file" in outcome[0], outcome


def _refusal(function, *args) -> str:
    try:
        function(*args)
    except UsageError as exc:
        return str(exc)
    return "accepted"


# ------------------------------------------------------------------ the command that reproduces the study
class _Captured(Exception):
    """Raised by a stand-in Tuner: the TuneConfig the CLI built, nothing run."""


@pytest.fixture
def captured_config(monkeypatch, tmp_path):
    """``config(*storage_args, env=None)``: the TuneConfig ``slapo-tune tune`` builds from the
    storage arguments (the storage not opened, no trial run)."""
    import slapo_tune.cli.tune as tune_command
    from slapo_tune.search import _storage

    def fake_tuner(config, *args, **kwargs):
        raise _Captured(config)

    monkeypatch.setattr(tune_command, "Tuner", fake_tuner)
    monkeypatch.setattr(tune_command, "check_storage", lambda url: None)

    def config(*storage_args, env=None):
        if env is None:
            monkeypatch.delenv(_storage.STORAGE_ENV, raising=False)
        else:
            monkeypatch.setenv(_storage.STORAGE_ENV, env)
        with pytest.raises(_Captured) as made:
            main(["tune", "--ray-address", "none", "--out", str(tmp_path / "out"), *storage_args])
        return made.value.args[0]
    return config


def _reproduced(command: str, environ: dict[str, str]):
    """The storage URL the reproduce command would use, run as printed (its note cut off)."""
    from slapo_tune.search._storage import storage_url

    args = build_parser().parse_args(shlex.split(command.split("   #")[0])[1:])
    return args, storage_url(args.storage, args.storage_file, environ)


def test_the_reproduce_command_reads_the_storage_file_it_was_given(captured_config, tmp_path):
    from slapo_tune.search._report import tune_command
    from slapo_tune.units import parse_size

    path = _storage_file(tmp_path, 0o600)
    config = captured_config("--storage-file", str(path))
    command = tune_command(config)
    args, url = _reproduced(command, {})
    assert args.storage_file == str(path) and args.storage is None and url == URL  # runnable as printed
    assert parse_size(args.memory_budget) == config.problem.memory_budget  # the same budget, with its unit
    assert "***" not in command and "s3cret" not in command


def test_the_reproduce_command_of_a_storage_from_the_environment_gives_no_flag_and_says_so(captured_config):
    from slapo_tune.search._report import tune_command

    command = tune_command(captured_config(env=URL))
    args, url = _reproduced(command, {"SLAPO_TUNE_STORAGE": URL})
    assert args.storage is None and args.storage_file is None and url == URL
    assert command.endswith("   # with $SLAPO_TUNE_STORAGE set to the study's storage") and "s3cret" not in command


def test_the_reproduce_command_of_a_storage_given_on_the_command_line_hides_its_password(captured_config):
    from slapo_tune.search._report import tune_command

    command = tune_command(captured_config("--storage", URL))
    args, _ = _reproduced(command, {})
    assert args.storage == "postgresql://tuner:***@db.example/tuning" and "s3cret" not in command
    assert command.endswith("   # *** stands for the storage's password")
    plain = tune_command(captured_config("--storage", "sqlite:///study.db"))  # nothing to hide: no note
    assert _reproduced(plain, {})[1] == "sqlite:///study.db" and "#" not in plain
