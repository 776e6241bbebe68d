"""The study journal (Optuna's journal file: one JSON record a line), read and written with
checks, and salvaged when it is damaged.

Optuna replays a journal record by record and numbers studies and trials by the order of the
records that create them; its own file backend raises a ``JSONDecodeError`` traceback on a damaged
line, and keeps writing into a file cut under it, with trial numbers it can no longer read back.
Here:

- a record cut short at the end (a writer killed mid-append, a full disk) is cut off before the
  next append, under the journal's lock, its bytes kept beside the journal: Optuna always ends a
  record with its newline in the same write, so an unfinished last line is never a record to keep;
- a driver whose journal is cut, overwritten or replaced while it runs stops at its next read or
  write (:class:`JournalDamaged`: one line naming the file and the salvage command), having
  written nothing more into it;
- a damaged record anywhere else stops every reader the same way: the study is left as it is
  until ``slapo-tune salvage`` (:func:`salvage_journal`) rewrites it, keeping every intact record
  and the original bytes beside it.
"""

from __future__ import annotations

import bisect
import json
import os
import shlex
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optuna.storages.journal import BaseJournalBackend

from .._atomic import atomic_write
from ..errors import UsageError

CREATE_STUDY, DELETE_STUDY, CREATE_TRIAL = 0, 1, 4
# the fields Optuna's replay reads from a record of each operation (JournalOperation's codes);
# a record without them, or of another code, is not one Optuna wrote (DISCARD_TRIALS, 10, is
# Rustuna's: Optuna skips it)
_FIELDS: dict[int, tuple[str, ...]] = {
    0: ("study_name", "directions"), 1: ("study_id",), 2: ("study_id", "user_attr"), 3: ("study_id", "system_attr"),
    4: ("study_id", "datetime_start"), 5: ("trial_id", "param_name", "param_value_internal", "distribution"),
    6: ("trial_id", "state", "values"), 7: ("trial_id", "step", "intermediate_value"), 8: ("trial_id", "user_attr"),
    9: ("trial_id", "system_attr"), 10: ()}
RECORD_START = b'{"op_code":'  # how Optuna begins every record (json.dumps of a dict with op_code first)
SEEN_BYTES = 64  # the bytes before the end of what a reader has read, compared at each read and write
SALVAGE_WORKER = "slapo-tune-salvage"  # the worker_id of the records a salvage writes itself
FAIL = 3  # optuna.trial.TrialState.FAIL, as a journal record holds it


def salvage_command(path: Path | str) -> str:
    return f"slapo-tune salvage {shlex.quote(str(path))}"


class JournalDamaged(UsageError):
    """A study journal that cannot be read on as it is: one line naming it and the command that
    salvages it (a usage error: exit code 2)."""

    def __init__(self, path: Path | str, what: str) -> None:
        self.path = Path(path)
        super().__init__(f"the study journal {path} {what}; salvage it with: {salvage_command(path)} (it keeps "
                         "every intact trial and sets the original aside), then re-run the same command")


def parse_record(line: bytes) -> dict[str, Any] | None:
    """The journal record ``line`` holds (with or without its newline); None when it is not one
    Optuna could replay: not JSON, not UTF-8, not an object, an unknown operation, a field missing."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # (a UnicodeDecodeError is a ValueError)
        return None
    if not isinstance(record, dict) or type(record.get("op_code")) is not int \
            or not isinstance(record.get("worker_id"), str):
        return None
    fields = _FIELDS.get(record["op_code"])
    if fields is None or any(name not in record for name in fields):
        return None
    if any(type(record[name]) is not int for name in ("study_id", "trial_id") if name in fields):
        return None
    return record


@contextmanager
def journal_lock(path: Path) -> Iterator[None]:
    """The lock every writer of the journal takes (Optuna's own, a symlink beside the file)."""
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _aside(path: Path, keep) -> Path:
    """A new file beside ``path``, ``NAME.damaged-TIME``, made by ``keep(aside_path)``, which must
    fail with FileExistsError when that name is taken (then the next name is tried)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        aside = path.with_name(f"{path.name}.damaged-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            keep(aside)
            return aside
        except FileExistsError:
            continue
    raise UsageError(f"cannot set the damaged part of {path} aside: too many {path.name}.damaged-* files")


def _keep_bytes(path: Path, data: bytes, mode: int) -> Path:
    def write(aside: Path) -> None:
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    return _aside(path, write)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _line_start(fd: int, size: int) -> int:
    """Where the last line of the file open as ``fd`` (``size`` bytes) starts."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def cut_torn_tail(fd: int, path: Path) -> str | None:
    """Cut an unfinished last record (no newline at the end: its writer died mid-append) off the
    journal open as ``fd``, the journal's lock held, so that the next record starts on a line of its
    own; its bytes are kept beside the journal. Returns what was done; None when the journal ends
    on a whole record. A journal holding no whole record is damaged: nothing would be left."""
    info = os.fstat(fd)
    if info.st_size == 0 or os.pread(fd, 1, info.st_size - 1) == b"\n":
        return None
    start = _line_start(fd, info.st_size)
    if start == 0:
        raise JournalDamaged(path, "holds no whole record (its first one was cut short)")
    torn = os.pread(fd, info.st_size - start, start)
    kept = _keep_bytes(path, torn, stat.S_IMODE(info.st_mode))
    os.ftruncate(fd, start)
    os.fsync(fd)
    return (f"the last record of {path} was damaged (cut short: {len(torn)} bytes, kept in {kept.name}) and was "
            "removed; the records before it are intact")


class CheckedJournalBackend(BaseJournalBackend):
    """Optuna's journal file (the format and the lock of ``JournalFileBackend``), read and written
    with checks: a damaged record is a :class:`JournalDamaged` error, not a traceback; nothing is
    written into a journal that was cut, overwritten or replaced since this reader read it (its
    trial numbers would no longer be the file's); an unfinished last record is cut off before
    appending (:func:`cut_torn_tail`)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offsets = [0]  # where record n starts; the last: the end of the records read so far
        self._seen = b""  # the last bytes before that end, as read
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file read
        with open(self.path, "ab"):  # as Optuna's backend does: a new study's journal is made here
            pass

    def _unchanged(self, fd: int) -> int:
        """The size of the journal open as ``fd``, once it is known to be the file read so far,
        holding at least what was read, as it was read."""
        info = os.fstat(fd)
        identity = (info.st_dev, info.st_ino)
        if self._identity is None:
            self._identity = identity
        elif identity != self._identity:
            raise JournalDamaged(self.path, "was replaced while this driver used it; nothing more was written to it")
        end = self._offsets[-1]
        if info.st_size < end or os.pread(fd, len(self._seen), end - len(self._seen)) != self._seen:
            raise JournalDamaged(self.path, f"was cut or overwritten while this driver used it ({info.st_size} "
                                            f"bytes now, {end} read before); nothing more was written to it")
        return info.st_size

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags)
        except FileNotFoundError:
            raise JournalDamaged(self.path, "was removed while this driver used it") from None

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        fd = self._open(os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            size = self._unchanged(fd)
            number = min(log_number_from, len(self._offsets) - 1)
            position = self._offsets[number]
            f.seek(position)
            while position < size:
                line = f.readline()
                if not line.endswith(b"\n") or position + len(line) > size:
                    break  # a record being written (or left unfinished): not read yet
                record = parse_record(line)
                if record is None:
                    raise JournalDamaged(self.path, f"has a damaged record at line {number + 1}")
                position += len(line)
                number += 1
                if number == len(self._offsets):
                    self._offsets.append(position)
                    self._seen = line[-SEEN_BYTES:]
                if number > log_number_from:
                    yield record

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        with journal_lock(self.path):
            fd = self._open(os.O_RDWR | os.O_APPEND)
            try:
                self._unchanged(fd)
                cut = cut_torn_tail(fd, self.path)
                if cut:
                    print(f"slapo-tune: warning: {cut}", file=sys.stderr)
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)


# ------------------------------------------------------------------------------------------ salvage
@dataclass
class _Piece:
    """A line of the journal: the record it holds, or (``record`` None) damaged bytes."""

    line: int
    data: bytes
    record: dict[str, Any] | None
    note: str = ""


def _pieces(data: bytes) -> list[_Piece]:
    """The journal's lines as records and damaged pieces. A damaged line may end in an intact
    record: a writer appended it after another's record was cut short (Optuna's backend does not
    start a new line): that record is recovered, the part before it is damaged."""
    lines = data.split(b"\n")
    last = lines.pop()  # after the final newline: b"", or a last record cut short
    pieces = []
    for number, line in enumerate(lines, start=1):
        record = parse_record(line)
        if record is not None:
            pieces.append(_Piece(number, line, record))
            continue
        start = line.find(RECORD_START, 1)
        while start > 0 and parse_record(line[start:]) is None:
            start = line.find(RECORD_START, start + 1)
        if start > 0:
            pieces += [_Piece(number, line[:start], None, "cut short, an intact record appended to it"),
                       _Piece(number, line[start:], parse_record(line[start:]))]
        else:
            pieces.append(_Piece(number, line, None, "unreadable"))
    if last:
        pieces.append(_Piece(len(lines) + 1, last, None, "cut short, at the end"))
    return pieces


@dataclass
class _Gap:
    """Where a damaged piece was, among the records kept, and the latest time recorded before it."""

    at: int
    when: str | None


@dataclass
class _Renumbering:
    """The records to keep, in order, and what was dropped; trials whose creation record was lost
    are re-created where the damage is, so that every later trial keeps its number (Optuna numbers
    trials by the order of their creation records, and every later record names a trial by it)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    restored: dict[int, dict[str, Any]] = field(default_factory=dict)  # trial id -> the record re-creating it
    trials: int = 0  # trial ids given so far
    gaps: list[_Gap] = field(default_factory=list)  # the damaged pieces since the last creation record
    when: str | None = None  # the latest time the records kept so far hold

    def restore(self, count: int, study: int) -> None:
        """Re-create ``count`` trials of ``study`` at the latest damaged piece (they were lost there:
        the records between it and now create no trial and name none from that number on)."""
        gap = self.gaps[-1]
        for _ in range(count):
            record = {"op_code": CREATE_TRIAL, "worker_id": SALVAGE_WORKER, "study_id": study,
                      "datetime_start": gap.when}
            self.records.insert(gap.at, record)
            self.restored[self.trials] = record
            self.trials += 1
            gap.at += 1


def _first_reference(pieces: list[_Piece]):
    """``reference(index)``: the trial id the first record after ``pieces[index]`` by the same
    worker names (None if none). A worker names the trial it created next (Optuna's ask creates a
    trial, then sets its parameters), which tells the id the trial was created with."""
    by_worker: dict[str, tuple[list[int], list[int]]] = {}
    for index, piece in enumerate(pieces):
        if piece.record is not None and "trial_id" in piece.record:
            indices, trials = by_worker.setdefault(piece.record["worker_id"], ([], []))
            indices.append(index)
            trials.append(piece.record["trial_id"])

    def reference(index: int) -> int | None:
        indices, trials = by_worker.get(pieces[index].record["worker_id"], ([], []))
        after = bisect.bisect_right(indices, index)
        return trials[after] if after < len(trials) else None
    return reference


def _renumber(pieces: list[_Piece]) -> _Renumbering:
    """The records to keep. Damaged pieces are dropped, and with them every record naming a study
    or trial whose creation record was lost where nothing shows which it was. A lost trial creation
    shows when a record after a damaged piece names a trial id not created yet, or when a creation's
    worker next names an id past those created: the trials missing are re-created at that damaged
    piece, running (their later records, intact, replay on them as they did), or failed when no
    record names them (they only keep the numbers after them)."""
    state = _Renumbering()
    reference = _first_reference(pieces)
    studies: dict[str, int] = {}  # name -> id, as Optuna's replay gives them
    live: set[int] = set()
    study: int | None = None  # the study of the latest trial created
    orphans: dict[int, list[int]] = {}  # trial id -> the lines of the records dropped for naming it
    for index, piece in enumerate(pieces):
        record = piece.record
        if record is None:
            state.gaps.append(_Gap(len(state.records), state.when))
            state.dropped.append(f"line {piece.line}: {len(piece.data)} bytes, {piece.note}")
            continue
        op = record["op_code"]
        if op == CREATE_STUDY:
            if record["study_name"] not in studies:
                studies[record["study_name"]] = len(studies)
                live.add(studies[record["study_name"]])
        elif "study_id" in record and record["study_id"] not in live:
            state.dropped.append(f"line {piece.line}: a record of study id {record['study_id']}, whose creation "
                                 "was lost")
            continue
        elif op == DELETE_STUDY:
            live.discard(record["study_id"])
        elif op == CREATE_TRIAL:
            study = record["study_id"]
            named = reference(index)
            if state.gaps and named is not None and 0 < named - state.trials < len(pieces):
                state.restore(named - state.trials, study)
            state.gaps.clear()
            state.trials += 1
        elif "trial_id" in record and record["trial_id"] >= state.trials:
            missing = record["trial_id"] + 1 - state.trials
            owner = study if study is not None else min(live, default=None)
            if not state.gaps or owner is None or missing > len(pieces):
                orphans.setdefault(record["trial_id"], []).append(piece.line)
                continue
            state.restore(missing, owner)
        state.records.append(record)
        state.when = record.get("datetime_complete") or record.get("datetime_start") or state.when
    for number, lines in orphans.items():
        state.dropped.append(f"line{'s' if len(lines) > 1 else ''} {_span(lines)}: {len(lines)} record(s) of "
                             f"trial id {number}, whose creation was lost")
    named = {r["trial_id"] for r in state.records if "trial_id" in r}
    for number, record in state.restored.items():
        if number not in named:
            record["state"] = FAIL
            if record["datetime_start"] is not None:
                record["datetime_complete"] = record["datetime_start"]
    return state


def _span(lines: list[int]) -> str:
    return f"{lines[0]}-{lines[-1]}" if len(lines) > 1 else str(lines[0])


class _Records(BaseJournalBackend):
    """Journal records in memory, for Optuna's own replay of a salvaged journal before it is written."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        yield from self.records[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        raise AssertionError("a salvage only reads")


def _replayed(records: list[dict[str, Any]], dropped: list[str], lines: dict[int, int]) -> tuple[list, dict[str, int]]:
    """The records Optuna's replay takes, one by one (a record it fails on is dropped, as it would
    stop every reader), and each study's trial count after them."""
    from optuna.storages import JournalStorage

    backend = _Records()
    storage = JournalStorage(backend)
    kept = []
    for record in records:
        backend.records.append(record)
        try:
            storage.get_all_studies()  # replays the record just added
        except Exception as exc:  # noqa: BLE001 - whatever Optuna's replay raises, the record cannot be kept
            where = f"line {lines[id(record)]}" if id(record) in lines else "a re-created trial"
            dropped.append(f"{where}: a record Optuna cannot replay ({type(exc).__name__})")
            continue
        kept.append(record)
    trials = {s.study_name: len(storage.get_all_trials(storage.get_study_id_from_name(s.study_name), deepcopy=False))
              for s in storage.get_all_studies()}
    return kept, trials


@dataclass
class Salvaged:
    """What :func:`salvage_journal` did."""

    path: Path
    records: int  # records in the journal now
    trials: dict[str, int]  # study name -> trials
    dropped: list[str]  # each damaged piece dropped and each record dropped with it, by line
    restored: list[int]  # the trial ids re-created in place of trials whose creation record was lost
    aside: Path | None  # where the original is kept; None when the journal was intact (nothing written)


def salvage_journal(path: Path | str) -> Salvaged:
    """Rewrite a damaged study journal keeping every record that still replays as it did, the
    journal's lock held throughout; the original is kept beside it, ``NAME.damaged-TIME`` (its
    bytes as they were), and the new journal replaces it atomically. A driver still
    running on it stops at its next read or write (the file was replaced) and resumes when re-run.
    See :func:`_pieces` and :func:`_renumber` for what is kept."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise UsageError(f"no study journal at {path}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{path} is not a regular file (a folder, device or pipe): not a study journal")
    with open(path, "rb") as f:
        start = f.read(len(RECORD_START))
    if start and start != RECORD_START:  # (before the lock, a link made beside it)
        raise UsageError(f"{path} does not begin as a study journal does ({RECORD_START.decode()}...): "
                         "not salvaged (a study's first record lost leaves nothing to salvage)")
    with journal_lock(path):
        data = path.read_bytes()
        pieces = _pieces(data)
        renumbered = _renumber(pieces)
        lines = {id(p.record): p.line for p in pieces if p.record is not None}
        records, trials = _replayed(renumbered.records, renumbered.dropped, lines)
        if not renumbered.dropped:
            return Salvaged(path, len(records), trials, [], [], None)
        if not records:
            raise UsageError(f"{path} holds no intact journal record (its first one was cut short): nothing can be "
                             "salvaged from it")
        aside = _keep_bytes(path, data, stat.S_IMODE(info.st_mode))
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(text), mode=stat.S_IMODE(info.st_mode))
    kept = {id(r) for r in records}
    return Salvaged(path, len(records), trials, renumbered.dropped,
                    [n for n, r in renumbered.restored.items() if id(r) in kept], aside)
