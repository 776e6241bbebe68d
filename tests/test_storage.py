"""The storage URL's file: a ``--storage-file`` others may read or write is refused as ssh refuses
such a private key, a device or pipe is refused without being read. No database and no trial run
here."""

from __future__ import annotations

import os
import threading

import pytest

from slapo_tune.cli import main
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
