"""Reading what a user (or whoever wrote a file the user was given) hands us, bounded.

Schedule files, storage-URL files, model configs and template files are small: a few KiB. A path
that names something else (``/dev/zero``, a FIFO, a 1 GiB file) would otherwise be read whole,
or for ever, before anything could say it is not what was expected. So a file is read only when
it is a regular file, and only up to a stated size; JSON is parsed only up to a stated depth.
Every refusal is a :class:`~slapo_tune.errors.UsageError` of one line.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from .errors import UsageError

# the largest sizes and counts taken from a command line, a schedule file or the API: far above any
# real cluster or run, yet small enough that nothing built from them (a space, a loop) runs for ever
MAX_WORLD_SIZE = 2**20  # ranks
MAX_BATCH = 2**31  # sequences in a global or micro-batch
MAX_SEQ_LEN = 2**24  # tokens in a sequence
MAX_COUNT = 2**31  # trials, steps, and every other count an option takes
MAX_SEED = 2**32 - 1  # what every generator seeded from it (NumPy's too) accepts

MAX_INPUT_BYTES = 4 * 2**20  # a schedule, a config, a storage URL file, a template: KiBs, never MiBs
MAX_JSON_DEPTH = 32  # a schedule nests 3 deep, a model config 4-5


def _size_text(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 and n % 2**20 == 0 else f"{n} bytes"


def read_small_bytes(path: str | os.PathLike, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes (``what`` names it in the
    one-line :class:`UsageError` raised otherwise: missing, a directory, a device, a pipe, too large,
    unreadable)."""
    path = Path(path)
    try:
        info = path.stat()  # (follows a link: a link to /dev/zero is a device)
    except FileNotFoundError:
        raise UsageError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{what} {path} is a directory, not a file")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (what was opened is checked next)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UsageError(f"{what} {path} is not a regular file (a device, pipe or socket): refused")
            data = f.read(limit + 1)  # a file that grew since the stat is still read only this far
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise UsageError(f"{what} {path} is over the {_size_text(limit)} a {what} may have: refused")
    return data


def read_small_text(path: str | os.PathLike, what: str, limit: int = MAX_INPUT_BYTES) -> str:
    """:func:`read_small_bytes` decoded as UTF-8 (not text: a one-line :class:`UsageError`)."""
    data = read_small_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{what} {path} is not UTF-8 text") from None


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and dicts (a scalar: 0), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def parse_json(text: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``text`` parsed as JSON, nested at most ``max_depth`` deep (a one-line :class:`UsageError`
    otherwise: invalid, or deeper than any file of ours, which is how a parser is made to recurse
    until it fails)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise UsageError(f"{what} nests deeper than {max_depth} levels: refused") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if json_depth(data) > max_depth:
        raise UsageError(f"{what} nests deeper than {max_depth} levels: refused")
    return data


def read_json_file(path: str | os.PathLike, what: str, limit: int = MAX_INPUT_BYTES,
                   max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A small JSON file (:func:`read_small_text`, then :func:`parse_json`)."""
    return parse_json(read_small_text(path, what, limit), f"{what} {path}", max_depth)
