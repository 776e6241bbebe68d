"""Atomic file writes: readers see the old file or the new one, never a part of either."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


_MODE = 0o666 & ~_umask()  # what open() would give a new file (mkstemp's is 0600)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], mode: int | None = None) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it over ``path``
    (its permissions ``mode``; default: what open() would give a new file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # on disk before it replaces the old file: a crash keeps one of them
            os.fsync(f.fileno())
        os.chmod(tmp, _MODE if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
