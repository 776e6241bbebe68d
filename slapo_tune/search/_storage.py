"""Where a study lives: an embedded journal file under the output folder by default, or any
Optuna RDB URL (SQLite, PostgreSQL for a team's shared study). The URL may come from the command
line, a file or the environment (:func:`storage_url`), so that a password need not be on a command
line; passwords are never shown (:func:`redact`)."""

from __future__ import annotations

import os
import re
import shlex
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote

from .._inputs import read_small_text
from ..errors import UsageError

JOURNAL_NAME = "study.journal"
STORAGE_ENV = "SLAPO_TUNE_STORAGE"  # the storage URL when neither --storage nor --storage-file is given

# the password of a URL: ``user:secret@`` (of a URL, not a time such as 10:30@) and ``password=secret``
_PASSWORDS = (re.compile(r"(?P<before>://[^/:@\s]*:)(?P<password>[^@/\s]*)(?P<after>@)"),
              re.compile(r"(?P<before>[?&]password=)(?P<password>[^&#\s]*)(?P<after>)", re.IGNORECASE))


def url_passwords(url: str | None) -> set[str]:
    """The passwords a storage URL holds (``user:secret@``, ``?password=``), as written and
    URL-decoded: the forms in which a driver's message or a careless line could show them."""
    found = {m["password"] for pattern in _PASSWORDS for m in pattern.finditer(url or "")}
    return {p for p in found | {unquote(p) for p in found} if p}


def redact(text: str, url: str | None = None) -> str:
    """``text`` with every URL's password shown as ``***`` (``postgresql://user:secret@host/db`` ->
    ``postgresql://user:***@host/db``, ``?password=***``); given the ``url`` the text is about, its
    password also wherever else the text holds it, as written or URL-decoded."""
    for pattern in _PASSWORDS:
        text = pattern.sub(lambda m: f"{m['before']}***{m['after']}", text)
    for password in sorted(url_passwords(url), key=len, reverse=True):  # a longer form before its part
        text = text.replace(password, "***")
    return text


def storage_url(storage: str | None, storage_file: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The study's storage: ``--storage``, else the first line of ``--storage-file`` that is not
    blank or a ``#`` comment, else ``$SLAPO_TUNE_STORAGE``, else None (a journal in the output
    folder). A URL read from a file or the environment never appears on a command line."""
    if storage:
        return storage
    if storage_file:
        text = read_small_text(storage_file, "storage file")  # (a device, a pipe, a huge file: refused)
        check_private(storage_file)
        lines = [line.strip() for line in text.splitlines()]
        url = next((line for line in lines if line and not line.startswith("#")), None)
        if url is None:
            raise UsageError(f"the storage file {storage_file} holds no storage URL")
        return url
    return environ.get(STORAGE_ENV) or None


def check_private(path: str) -> None:
    """Refuse a storage file others may read or change, as ssh refuses such a private key: it
    holds the study's password (a reader has it), and a writer chooses where the study goes. Not a
    warning: by the time one is read, every user of the machine may have read the password."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if os.name == "posix" and mode & 0o077:
        raise UsageError(f"storage file {path} is open to other users (permissions {mode:04o}): it holds the "
                         f"study's password and says where the study goes; make it yours alone: "
                         f"chmod 600 {shlex.quote(path)}")


def is_journal(url: str | None) -> bool:
    return url is None or url.startswith("journal:") or url.endswith(".journal")


def journal_path(url: str | None, out: Path) -> Path:
    """The journal file of a journal storage ``url`` (None: the one in the output folder ``out``)."""
    return Path(url.removeprefix("journal:")) if url else out / JOURNAL_NAME


def check_storage(url: str | None) -> None:
    """Refuse an unusable storage before anything is started or written (RDB URLs are opened)."""
    if is_journal(url) or url == "memory":
        return
    open_storage(url, Path("."))


# the pip package of each database driver module SQLAlchemy may import for a URL (by its dialect)
_DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
                    "pymysql": "PyMySQL", "asyncpg": "asyncpg", "pg8000": "pg8000"}


def _missing_driver(exc: BaseException) -> str | None:
    """What to install when opening a storage failed for want of its database driver, else None."""
    missing = next((e for e in (exc, exc.__cause__, exc.__context__) if isinstance(e, ModuleNotFoundError)), None)
    if missing is None:
        return None
    module = (missing.name or "").split(".")[0]
    package = _DRIVER_PACKAGES.get(module, module)
    if module == "psycopg":  # what SQLAlchemy 2.1 imports for a plain postgresql:// URL: our extra has it
        return f"the PostgreSQL driver is not installed: pip install 'slapo-tune[postgres]' (or '{package}')"
    return f"its database driver is not installed: pip install '{package}'"


# what a driver that lost the race to create a new database's tables sees (SQLite, PostgreSQL)
_CREATION_RACES = ("already exists", "UNIQUE constraint failed", "duplicate key")


def open_storage(url: str | None, out: Path):
    """An Optuna storage for ``url`` (None: ``OUT/study.journal``; ``memory``: nothing kept, for
    replays); UsageError if unusable."""
    if url == "memory":
        return None
    import optuna
    from optuna.storages import JournalStorage

    # optuna-free: every --help imports this module (the tune command imports the tuner); _journal imports optuna
    from ._journal import CheckedJournalBackend

    if is_journal(url):
        path = journal_path(url, out)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # (a damaged record stops it here, or when read later: one line naming the salvage command)
            return JournalStorage(CheckedJournalBackend(path))
        except OSError as exc:
            raise UsageError(f"cannot use the study journal {path}: {exc.strerror or exc}") from None
    if "://" not in url:
        raise UsageError(redact(f"unreadable storage URL '{url}': expected sqlite:///PATH, postgresql://..., "
                                f"mysql://... or a .journal file", url))
    for attempt in range(3):
        try:
            return optuna.storages.RDBStorage(url)
        except Exception as exc:  # noqa: BLE001 - drivers raise many kinds; the user needs one line
            # drivers started together on a new database race to create its tables and stamp its
            # schema version: the loser finds them made and opens it again
            if any(race in str(exc) for race in _CREATION_RACES) and attempt < 2:
                time.sleep(0.2)
                continue
            reason = _missing_driver(exc) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            raise UsageError(redact(f"cannot open storage {url}: {reason}", url)) from None
