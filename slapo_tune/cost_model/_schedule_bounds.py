"""torch's interleaved schedules' send bound and receive buffers (:mod:`slapo_tune.parallel._send_release`),
remembered on disk. Reading them lowers torch's action lists of every rank, which takes
``torch.distributed.pipelining`` (seconds to import, where ``plan`` imports no torch otherwise) and
up to a quarter of a second a shape: a plan at scale asks for some 150 shapes. The file is keyed by
torch's version and by the walk's own source, so that neither a new torch nor an edited walk reads
what another one found; it holds integers only, and is read only where it has the expected form."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from importlib import metadata
from pathlib import Path

from .._atomic import atomic_write_text
from ..parallel import _send_release
from ..parallel._send_release import ReceiveBuffers, steady_microbatches
from .hardware import _cache_dir

Bounds = tuple[tuple[int, ...], tuple[ReceiveBuffers, ...]]
MAX_SHAPES = 100_000  # a file at most this many shapes long (some 10 MB); beyond it, shapes are not added
_KNOWN: dict[tuple[int, int, int, str], Bounds] = {}
_READ: set[Path] = set()  # the files read into _KNOWN


def schedule_bounds(pp: int, vpp: int, n_microbatches: int, schedule: str) -> Bounds:
    """:func:`~slapo_tune.parallel._send_release.schedule_bounds`, from the file where it is known."""
    key = (int(pp), int(vpp), steady_microbatches(int(pp), int(n_microbatches)), schedule)
    if key not in _KNOWN:
        path = _file()
        if path is not None and path not in _READ:
            _read(path)
        if key not in _KNOWN:
            _KNOWN[key] = _send_release.schedule_bounds(*key)
            if path is not None and len(_KNOWN) <= MAX_SHAPES:
                with contextlib.suppress(OSError):  # a read-only cache: the shapes are found again next time
                    atomic_write_text(path, json.dumps([[list(k), list(sends), [list(r) for r in receives]]
                                                        for k, (sends, receives) in _KNOWN.items()]))
    return _KNOWN[key]


def _file() -> Path | None:
    """The file for this torch and this walk (None: torch's version unknown, or no cache directory)."""
    try:
        torch_version, walk = _torch_version(), _source_hash(_send_release.__file__)
        return _cache_dir() / f"schedule-bounds-torch{torch_version}-{walk}.json"
    except (metadata.PackageNotFoundError, OSError):
        return None


# once per process: a plan's every new shape asks for the file (the cache directory may change,
# the installed torch and a source file's content do not)
@functools.cache
def _torch_version() -> str:
    return metadata.version("torch")


@functools.cache
def _source_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _read(path: Path) -> None:
    """The shapes ``path`` holds into :data:`_KNOWN` (entries not of the form written here skipped)."""
    _READ.add(path)
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for entry in entries[:MAX_SHAPES] if isinstance(entries, list) else ():
        try:
            (pp, vpp, m, schedule), sends, receives = entry
            key = (int(pp), int(vpp), int(m), str(schedule))
            value = (tuple(int(s) for s in sends), tuple(ReceiveBuffers(*map(int, r)) for r in receives))
        except (TypeError, ValueError):
            continue
        if len(value[0]) == len(value[1]) == key[0]:
            _KNOWN.setdefault(key, value)
