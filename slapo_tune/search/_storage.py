"""Where a study lives: an embedded journal file under the output folder by default, or any
Optuna RDB URL (SQLite, PostgreSQL for a team's shared study). Passwords in URLs are never shown."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from ..errors import UsageError

JOURNAL_NAME = "study.journal"


def redact(url: str) -> str:
    """``postgresql://user:secret@host/db`` -> ``postgresql://user:***@host/db``."""
    return re.sub(r"(://[^/:@]+:)[^@/]*@", r"\1***@", url)


def is_journal(url: str | None) -> bool:
    return url is None or url.startswith("journal:") or url.endswith(".journal")


def check_storage(url: str | None) -> None:
    """Refuse an unusable storage before anything is started or written (RDB URLs are opened)."""
    if is_journal(url) or url == "memory":
        return
    if "://" not in url:
        raise UsageError(f"unreadable storage URL '{redact(url)}': expected sqlite:///PATH, postgresql://..., "
                         f"mysql://... or a .journal file")
    open_storage(url, Path("."))


def repair_journal(path: Path) -> str | None:
    """Cut a damaged last record off a journal (a write cut short by a crash or a full disk), so
    that new records start on a line of their own; the bytes cut are kept beside it. Returns what
    was done, or None when the journal was sound."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return None
    with open(path, "rb") as f:
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    complete = tail.endswith(b"\n")
    last_start = tail.rstrip(b"\n").rfind(b"\n") + 1
    last = tail[last_start:]
    if complete:
        try:
            json.loads(last)
            return None
        except ValueError:
            pass
    if last_start == 0 and size > len(tail):  # a last record over 1 MiB: not ours to judge
        return None
    cut_at = size - len(tail) + last_start
    backup = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    backup.write_bytes(last)
    with open(path, "r+b") as f:
        f.truncate(cut_at)
        f.flush()
        os.fsync(f.fileno())
    return (f"the last record of {path} was damaged ({len(last)} bytes, kept in {backup.name}) and was "
            "removed; the trials before it are intact")


# what a driver that lost the race to create a new database's tables sees (SQLite, PostgreSQL)
_CREATION_RACES = ("already exists", "UNIQUE constraint failed", "duplicate key")


def open_storage(url: str | None, out: Path):
    """An Optuna storage for ``url`` (None: ``OUT/study.journal``; ``memory``: nothing kept, for
    replays); UsageError if unusable."""
    if url == "memory":
        return None
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if is_journal(url):
        path = Path(url.removeprefix("journal:")) if url else out / JOURNAL_NAME
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            repaired = repair_journal(path)
            if repaired:
                print(f"slapo-tune: warning: {repaired}", file=sys.stderr)
            return JournalStorage(JournalFileBackend(str(path)))
        except OSError as exc:
            raise UsageError(f"cannot use the study journal {path}: {exc.strerror or exc}") from None
    if "://" not in url:
        raise UsageError(f"unreadable storage URL '{redact(url)}': expected sqlite:///PATH, postgresql://..., "
                         f"mysql://... or a .journal file")
    for attempt in range(3):
        try:
            return optuna.storages.RDBStorage(url)
        except Exception as exc:  # noqa: BLE001 - drivers raise many kinds; the user needs one line
            # drivers started together on a new database race to create its tables and stamp its
            # schema version: the loser finds them made and opens it again
            if any(race in str(exc) for race in _CREATION_RACES) and attempt < 2:
                time.sleep(0.2)
                continue
            reason = redact(str(exc).splitlines()[0]) if str(exc) else type(exc).__name__
            raise UsageError(f"cannot open storage {redact(url)}: {reason}") from None
