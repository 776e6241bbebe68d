"""A damaged study journal: a record cut short (a crash mid-append, a full disk) at the end or in
the middle with intact records after it, garbage over part of it, the file cut while a driver
runs. Readers stop with one line naming the file and the salvage command; ``slapo-tune salvage``
keeps every intact record (checked against the journal read here line by line, and against
Optuna's own replay of the undamaged journal), sets the original aside, and the same study
resumes. Replayed studies (recorded trials, no training): each test takes a fraction of a second
once the grid's problem is built."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from benchmarks.search_strategies import SMALL, grid_problem, load_grid, replay_tuner
from runners.replay import ReplayRunner
from slapo_tune.cli import main
from slapo_tune.errors import UsageError

STUDY = "s"
TRIALS = 6
TORN = 2  # the trial whose record is torn: records of trials before and after it stay intact


@pytest.fixture(scope="module")
def grid():
    return load_grid()


@pytest.fixture(scope="module")
def pristine(grid, tmp_path_factory) -> Path:
    """An undamaged journal of a replayed study of TRIALS trials (never modified: tests copy it)."""
    results, budget = grid
    path = tmp_path_factory.mktemp("pristine") / "study.journal"
    tuner, _ = _tuner(grid, path, TRIALS)
    tuner.run()
    return path


@pytest.fixture
def earlier_drivers_gone(monkeypatch):
    """The drivers that wrote the journals so far have exited (in a test they are this process,
    which lives on: a resumed driver would leave their running trials to them)."""
    from slapo_tune.search import _shared

    monkeypatch.setattr(_shared, "driver_alive", lambda name: False)


def _tuner(grid, journal: Path, trials: int, runner=None):
    results, budget = grid
    return replay_tuner("random", 0, "analytic", results, budget, trials=trials, storage=f"journal:{journal}",
                        study=STUDY, confirm=0, runner=runner)


def _copy(pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "study.journal"
    shutil.copy(pristine, path)
    return path


def _lines(path: Path) -> list[bytes]:
    """The journal's records as written, one line each (read here, not by the code under test)."""
    return path.read_bytes().split(b"\n")[:-1]


def _record_of(lines: list[bytes], op_code: int, trial: int) -> int:
    """The index of the first line holding a record of ``op_code`` about trial id ``trial`` (a
    creation, op 4, names no trial: the trial-th creation is trial id ``trial``)."""
    records = [json.loads(line) for line in lines]
    if op_code == 4:
        return [i for i, r in enumerate(records) if r["op_code"] == 4][trial]
    return next(i for i, r in enumerate(records) if r["op_code"] == op_code and r.get("trial_id") == trial)


def _trials(path: Path) -> list:
    """The study's trials as Optuna's own file backend replays them."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=STUDY, storage=JournalStorage(JournalFileBackend(str(path)))).trials


def _fields(trial, start: bool = True) -> tuple:
    return (trial.number, trial.state, trial.values, trial.params, trial.user_attrs, trial.system_attrs,
            trial.datetime_complete) + ((trial.datetime_start,) if start else ())


def _salvage(capsys, path: Path) -> list[str]:
    code = main(["salvage", str(path)])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    return out.splitlines()


def _one_line_naming_the_salvage(exc: UsageError, path: Path) -> None:
    message = str(exc)
    assert "\n" not in message and str(path) in message and f"slapo-tune salvage {path}" in message, message


# ----------------------------------------------------------------------------- a record torn in the middle
@pytest.mark.parametrize("op_code,what", [(4, "its creation"), (5, "a parameter"), (8, "a user attribute"),
                                          (6, "its state and values (the tell)")])
def test_a_torn_record_followed_by_intact_ones_is_salvaged_keeping_every_other(grid, pristine, tmp_path, capsys,
                                                                                 earlier_drivers_gone, op_code, what):
    """A writer died mid-append in a record of trial TORN; the next append went on the same line
    (Optuna's backend starts none). Reading it stops with one line; the salvage drops the torn
    part only: the study equals the undamaged one less that record (a lost creation: the trial is
    re-created from its later records, only its start time unknown); the same study resumes."""
    path = _copy(pristine, tmp_path)
    lines = _lines(path)
    torn = _record_of(lines, op_code, TORN)
    damaged = lines[:torn] + [lines[torn][:40] + lines[torn + 1]] + lines[torn + 2:]
    path.write_bytes(b"\n".join(damaged) + b"\n")
    original = path.read_bytes()

    with pytest.raises(UsageError) as stopped:
        _tuner(grid, path, TRIALS + 2)[0].open()
    _one_line_naming_the_salvage(stopped.value, path)
    assert f"line {torn + 1}" in str(stopped.value)
    assert path.read_bytes() == original  # nothing written into it

    said = _salvage(capsys, path)
    restored = op_code == 4  # a creation lost is re-created
    assert said[0] == f"salvaged {path}: kept {len(lines) - 1 + restored} record(s), study '{STUDY}' with {TRIALS} trial(s)"
    assert any(line.startswith(f"  re-created trial id(s) {TORN}:") for line in said) == restored, said
    assert any(f"line {torn + 1}: 40 bytes, cut short" in line for line in said), said
    aside = list(tmp_path.glob("study.journal.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == original  # the original, byte for byte

    # what the salvage must give: the undamaged journal less the torn record, replayed by Optuna
    expected_path = tmp_path / "expected.journal"
    expected_path.write_bytes(b"".join(line + b"\n" for i, line in enumerate(lines) if i != torn or op_code == 4))
    expected, salvaged = _trials(expected_path), _trials(path)
    assert len(salvaged) == len(expected) == TRIALS
    for want, got in zip(expected, salvaged):
        assert _fields(got, start=want.number != TORN or op_code != 4) == \
            _fields(want, start=want.number != TORN or op_code != 4), want.number
    if op_code == 4:  # re-created: its start time is the latest time recorded before it
        assert salvaged[TORN - 1].datetime_start <= salvaged[TORN].datetime_start <= expected[TORN].datetime_start
    if op_code == 6:  # the trial was never told: it is left running, as a killed driver leaves one
        assert salvaged[TORN].state.name == "RUNNING"

    tuner, _ = _tuner(grid, path, TRIALS + 2)  # the same command again: the same study, resumed
    summary = tuner.run()
    resumed = _trials(path)
    assert summary["study"] == STUDY and len(resumed) > TRIALS
    for before, after in zip(salvaged, resumed):
        if before.state.name != "RUNNING":
            assert _fields(after) == _fields(before), before.number
    if op_code == 6:  # left running, told all but its state: failed on resume as interrupted, measured again
        assert (resumed[TORN].state.name, resumed[TORN].user_attrs["status"]) == ("FAIL", "interrupted")
        retry = [t for t in resumed if t.user_attrs.get("retry_of") == TORN]
        assert len(retry) == 1 and retry[0].user_attrs["point"] == resumed[TORN].user_attrs["point"]
        assert retry[0].user_attrs["status"] == resumed[TORN].user_attrs["result"]["status"]  # (replayed: the same)
    assert not list(tmp_path.glob("study.journal.damaged-*"))[1:]  # nothing else was cut


def test_a_trial_whose_records_are_all_lost_keeps_the_numbers_of_the_trials_after_it(grid, pristine, tmp_path,
                                                                                     capsys):
    """Garbage over every record of trial TORN, its creation included: the next trial's creation,
    intact, would take its number (Optuna numbers trials by their creation records) and every
    later record would name the wrong trial. The lost trial is re-created, failed, in its place."""
    path = _copy(pristine, tmp_path)
    lines = _lines(path)
    first, last = _record_of(lines, 4, TORN), _record_of(lines, 4, TORN + 1)  # its creation .. the next one's
    path.write_bytes(b"".join(line + b"\n" for line in lines[:first]) + b"\x00garbage\xff\n"
                     + b"".join(line + b"\n" for line in lines[last:]))
    said = _salvage(capsys, path)
    assert any(line.startswith(f"  re-created trial id(s) {TORN}:") for line in said), said
    expected, salvaged = _trials(pristine), _trials(path)
    assert len(salvaged) == TRIALS
    for want, got in zip(expected, salvaged):
        if want.number != TORN:
            assert _fields(got) == _fields(want), want.number
    lost = salvaged[TORN]
    assert (lost.state.name, lost.params, lost.user_attrs) == ("FAIL", {}, {})


def test_garbage_over_the_middle_of_a_journal_loses_only_the_records_it_covers(grid, pristine, tmp_path, capsys):
    path = _copy(pristine, tmp_path)
    lines = _lines(path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 300] = random.Random(0).randbytes(300)
    path.write_bytes(bytes(data))
    covered = {i for i, line in enumerate(lines)  # the lines the garbage touched, counted here
               if (start := sum(len(x) + 1 for x in lines[:i])) < middle + 300 and start + len(line) + 1 > middle}

    with pytest.raises(UsageError) as stopped:
        _tuner(grid, path, TRIALS)[0].open()
    _one_line_naming_the_salvage(stopped.value, path)
    code = main(["show", "--storage", str(path)])  # every reader: one line, exit 2
    assert code == 2 and capsys.readouterr().err.count("\n") == 1

    _salvage(capsys, path)
    kept = [json.loads(line) for line in _lines(path)]
    assert kept == [json.loads(line) for i, line in enumerate(lines) if i not in covered]
    assert len(_trials(path)) == TRIALS


# ----------------------------------------------------------------------------- a record torn at the end
def test_a_record_torn_at_the_end_is_cut_when_salvaged_or_resumed(grid, pristine, tmp_path, capsys):
    path = _copy(pristine, tmp_path)
    lines = _lines(path)
    path.write_bytes(b"".join(line + b"\n" for line in lines[:-1]) + lines[-1][:50])  # the last tell, cut short
    said = _salvage(capsys, path)
    assert said[1] == f"  dropped line {len(lines)}: 50 bytes, cut short, at the end"
    assert _lines(path) == lines[:-1]
    assert main(["salvage", str(path)]) == 0  # salvaged: intact now
    assert capsys.readouterr().out.startswith(f"{path} is intact: {len(lines) - 1} record(s)")


@pytest.mark.parametrize("size", [0, 30])
def test_a_journal_cut_within_its_first_record_never_starts_a_new_study(grid, pristine, tmp_path, size):
    """Cut to nothing, or inside its first record: resuming would begin a new, empty study and
    overwrite the outputs of the one it held. It stops, naming the salvage command."""
    from slapo_tune.search import TuneConfig, Tuner

    results, budget = grid
    out = tmp_path / "out"
    out.mkdir()
    path = out / "study.journal"
    path.write_bytes(pristine.read_bytes()[:size])
    table = out / "trials.csv"
    table.write_text("trial,status\n0,ok\n1,oom\n")  # what the study's outputs listed
    with pytest.raises(UsageError) as refused:
        Tuner(TuneConfig(problem=grid_problem(SMALL, budget), out=out, trials=2, study=STUDY, confirm=0),
              ReplayRunner(results)).open()
    message = str(refused.value)
    assert "\n" not in message and f"slapo-tune salvage {path}" in message and f"{table} lists 2 trial(s)" in message
    assert table.read_text() == "trial,status\n0,ok\n1,oom\n"
    assert path.read_bytes() == pristine.read_bytes()[:size]


def test_building_a_tuner_touches_no_storage_and_opening_it_does(grid, pristine, tmp_path):
    """A Tuner's constructor only builds: neither a new journal nor an existing study's is written
    until the study is opened (by its first use, or :meth:`Tuner.open`), which registers the driver."""
    fresh = tmp_path / "new" / "study.journal"
    existing = _copy(pristine, tmp_path)
    before = existing.read_bytes()
    new_tuner, _ = _tuner(grid, fresh, 1)
    resumed, _ = _tuner(grid, existing, TRIALS + 1)
    assert not fresh.parent.exists() and existing.read_bytes() == before
    resumed.open()
    assert existing.read_bytes().startswith(before) and len(existing.read_bytes()) > len(before)
    assert any(k.startswith("driver:") for k in resumed.study.user_attrs)
    assert new_tuner.open() is new_tuner.study and fresh.is_file()


# ----------------------------------------------------------------------------- cut while a driver runs
def _cut(journal: Path) -> None:  # in the middle of a line
    with open(journal, "r+b") as f:
        f.truncate(journal.stat().st_size // 2 + 7)


def _overwritten(journal: Path) -> None:  # its last record, in place: the same size
    with open(journal, "r+b") as f:
        f.seek(-41, 2)
        f.write(b"x" * 40)


def _replaced(journal: Path) -> None:  # by a copy of itself, renamed over it (an editor, a restore)
    copy = journal.with_name("copy")
    copy.write_bytes(journal.read_bytes())
    copy.replace(journal)


class _ChangesTheJournal(ReplayRunner):
    """Replays the grid; while its third trial runs, ``change`` is done to the journal."""

    def __init__(self, results, journal: Path, change):
        super().__init__(results)
        self.journal, self.change, self.changed = journal, change, None

    def run(self, spec):
        if len(self.launched) == 2:
            self.change(self.journal)
            self.changed = self.journal.read_bytes()
        return super().run(spec)


def _stopped_under(grid, path: Path, change) -> bytes:
    """Run a driver whose journal gets ``change`` while it runs: it stops with one line naming
    the salvage command, having written nothing more. Returns the journal as it was changed."""
    results, _ = grid
    runner = _ChangesTheJournal(results, path, change)
    tuner, _ = _tuner(grid, path, TRIALS, runner=runner)
    with pytest.raises(UsageError) as stopped:
        tuner.run()
    _one_line_naming_the_salvage(stopped.value, path)
    assert "while this driver used it" in str(stopped.value)
    assert path.read_bytes() == runner.changed  # nothing written after the change
    return runner.changed


def test_a_driver_whose_journal_is_cut_under_it_stops_with_one_line_and_the_rerun_resumes(grid, tmp_path,
                                                                                        earlier_drivers_gone):
    path = tmp_path / "study.journal"
    kept = _stopped_under(grid, path, _cut).split(b"\n")[:-1]  # the whole records before the cut
    again, _ = _tuner(grid, path, TRIALS)  # re-run: the record cut in two is cut off, the study resumes
    summary = again.run()
    assert summary["study"] == STUDY and summary["launched"] == TRIALS
    assert _lines(path)[:len(kept)] == kept
    assert len(list(tmp_path.glob("study.journal.damaged-*"))) == 1


@pytest.mark.parametrize("change", [_overwritten, _replaced], ids=["overwritten", "replaced"])
def test_a_driver_whose_journal_is_overwritten_or_replaced_under_it_stops(grid, tmp_path, capsys,
                                                                          earlier_drivers_gone, change):
    path = tmp_path / "study.journal"
    changed = _stopped_under(grid, path, change)
    _salvage(capsys, path)  # (the overwritten record dropped; a replaced journal is intact)
    intact = [line for line in changed.split(b"\n")[:-1] if not line.endswith(b"x" * 40)]
    assert _lines(path) == intact
    summary = _tuner(grid, path, TRIALS)[0].run()
    assert summary["study"] == STUDY and summary["launched"] == TRIALS


def test_salvage_refuses_what_is_not_a_journal(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a journal\n")
    for argv, message in ((["salvage", str(tmp_path / "none.journal")], "no study journal at"),
                          (["salvage", "/dev/zero"], "/dev/zero is not a regular file"),
                          (["salvage", str(text)], "does not begin as a study journal does")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert text.read_text() == "not a journal\n" and not list(tmp_path.glob("*.damaged-*"))
