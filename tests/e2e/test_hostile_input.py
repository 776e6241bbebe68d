"""Input as an attacker or a careless user writes it: a schedule file or a study that names code,
sizes no run has, files that are not files, configs no transformer has. Each is refused with one
line on stderr and exit code 2, within seconds, before anything runs or is written; nothing a
schedule or a study names is imported or run unless the user names it on the command line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from slapo_tune.cli import main
from slapo_tune.models import config_fingerprint, load_config
from slapo_tune.plan import Plan, Workload
from slapo_tune.schedule_file import make_schedule, write_json_atomic
from slapo_tune.space import divisors

ROOT = Path(__file__).resolve().parents[2]


def _one_line(capfd, argv: list[str]) -> str:
    """Run the command line in this process: exit code 2 and exactly one line on stderr, no traceback."""
    started = time.monotonic()
    code = main(argv)
    out, err = capfd.readouterr()
    assert code == 2, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert time.monotonic() - started < 30  # refused, not read or run for a while first
    return err


def _schedule(path: Path, *, preset: str = "gpt2-tiny", template: dict | None = None, **changes) -> Path:
    """A valid schedule file of ``preset`` (one rank), with ``changes`` written over its fields."""
    knobs = {"tp": 1, "pp": 1, "dp": 1, "zero": 0, "micro_batch": 2, "ckpt_ratio": 0.0, "attn": "sdpa", "fuse": "off",
             "pipeline_schedule": "1f1b"}
    data = make_schedule(template=template or {"name": "gpt2", "version": "1"},
                         plan=Plan.of(knobs, Workload(1, 4, 16)), world_size=1, global_batch=4, seq_len=16,
                         precision="fp32", model={"name": preset, "overrides": {},
                                                  "fingerprint": config_fingerprint(load_config(preset))},
                         device="cpu")
    data.update(changes)
    write_json_atomic(path, data)
    return path


# ------------------------------------------------------------------------ code named by data
MARKER_CODE = "from pathlib import Path\nPath({marker!r}).write_text('ran')\n"


def _marking_template(tmp_path: Path) -> tuple[Path, Path, str]:
    """A template file that leaves a marker file when it runs, the marker's path and its SHA-256."""
    marker = tmp_path / "ran.txt"
    space = tmp_path / "my_space.py"
    space.write_text(MARKER_CODE.format(marker=str(marker)) + "BASE = 'llama'\nKNOBS = {'extra': [1, 2]}\n\n\n"
                     "def schedule(sch, point):\n    pass\n")
    return space, marker, hashlib.sha256(space.read_bytes()).hexdigest()


def test_a_schedule_naming_a_template_file_runs_it_only_when_the_user_names_it(tmp_path, capfd):
    """The file's hash comes with the schedule, so a hash proves nothing about who chose the file:
    the user must name it. Named, it runs (and is checked against the hash before it does)."""
    space, marker, sha256 = _marking_template(tmp_path)
    schedule = _schedule(tmp_path / "s.json", preset="llama-tiny",
                         template={"name": "my_space", "version": "1", "file": str(space), "sha256": sha256})
    err = _one_line(capfd, ["train", "--schedule", str(schedule), "--save", str(tmp_path / "ckpt")])
    assert f"pass --space {space}" in err and not marker.exists() and not (tmp_path / "ckpt").exists()
    # named by the user: it runs, and the schedule is checked against it (here: the file's knob is missing)
    err = _one_line(capfd, ["train", "--schedule", str(schedule), "--space", str(space)])
    assert marker.exists() and "knobs extra missing (template my_space has" in err
    # another file named: refused on its hash, before it runs
    marker.unlink()
    other = tmp_path / "other.py"
    other.write_text(space.read_text() + "# another\n")
    err = _one_line(capfd, ["train", "--schedule", str(schedule), "--space", str(other)])
    assert "is not the one tuned with" in err and not marker.exists()


def test_a_module_reference_in_a_schedule_is_never_imported(tmp_path, capfd, monkeypatch):
    marker = tmp_path / "imported.txt"
    (tmp_path / "hostile_module_x.py").write_text(MARKER_CODE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    for template in ({"name": "gpt2", "version": "1", "file": "hostile_module_x:run", "sha256": "0" * 64},
                     {"name": "hostile_module_x:run", "version": "1"}):
        err = _one_line(capfd, ["train", "--schedule", str(_schedule(tmp_path / "s.json", template=template))])
        assert "template" in err
    assert "hostile_module_x" not in sys.modules and not marker.exists()


def test_a_relative_or_malformed_template_file_is_one_line(tmp_path, capfd):
    for template, message in (
            ({"name": "x", "version": "1", "file": "my_space.py", "sha256": "0" * 64}, "absolute path of a .py file"),
            ({"name": "x", "version": "1", "file": "/abs/x.py", "sha256": "abc"}, "64 hexadecimal digits")):
        err = _one_line(capfd, ["train", "--schedule", str(_schedule(tmp_path / "s.json", template=template))])
        assert message in err


def test_a_study_naming_a_template_file_runs_it_only_when_the_user_names_it(tmp_path, capfd):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from slapo_tune.search._outputs import OUTPUTS_ATTR

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space, marker, sha256 = _marking_template(tmp_path)
    journal = tmp_path / "study.journal"
    study = optuna.create_study(study_name="shared", storage=JournalStorage(JournalFileBackend(str(journal))))
    study.set_user_attr(OUTPUTS_ATTR, {"problem": {"model": "llama-tiny", "world_size": 1, "template": str(space),
                                                   "template_sha256": sha256, "global_batch": 4, "seq_len": 16,
                                                   "memory_budget": 2**30},
                                       "strategy": "grid", "command": None})
    for command in (["export", "--out", str(tmp_path / "out")], ["show"]):
        err = _one_line(capfd, [*command, "--storage", str(journal)])
        assert f"study 'shared' in {journal} was made with the template file {space}" in err
        assert f"pass --space {space}" in err and not marker.exists()
    assert not (tmp_path / "out").exists()
    # named, it runs: the study's outputs are written (it ran no trial: the code of a study without a result)
    assert main(["export", "--storage", str(journal), "--out", str(tmp_path / "out"), "--space", str(space)]) == 3
    assert marker.exists() and (tmp_path / "out" / "trials.csv").is_file()


@pytest.mark.parametrize("change,message", [
    ({"world_size": "2"}, "world_size is str, not int"), ({"memory_budget": None}, "has no memory budget"),
    ({"colour": "red"}, "unknown field 'colour'"), ({"model": None}, "no model name"),
    ({"template": ["a"]}, "template is list, not str or NoneType")])
def test_a_study_whose_recorded_problem_is_malformed_is_one_line(change, message):
    from dataclasses import asdict

    from slapo_tune.errors import UsageError
    from slapo_tune.problem import ProblemSpec

    record = asdict(ProblemSpec("gpt2-tiny", 2, memory_budget=2**24))  # what the tuner records
    assert ProblemSpec.from_record(dict(record), "study") == ProblemSpec(**record)
    with pytest.raises(UsageError, match=message):
        ProblemSpec.from_record({**record, **change}, "study")


# ------------------------------------------------------------------------ sizes
@given(hs.integers(1, 10**12))
def test_divisors_are_those_of_the_definition(n):
    found = divisors(n)
    assert found == sorted(found) and all(n % d == 0 for d in found)
    # every divisor, checked against its co-divisor (the brute force of the definition is O(n))
    assert {n // d for d in found} == set(found) and (n < 10**5 or len(found) < 7000)
    if n < 10**5:
        assert found == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("argv,message", [
    (["space", "--model", "gpt2-tiny", "--world-size", "1048577"], "expected a positive integer of at most 1048576"),
    (["tune", "--world-size", "99999999999999999999"], "expected a positive integer of at most 1048576"),
    (["tune", "--world-size", "9" * 5000], "(5000 characters)"),
    (["plan", "--model", "gpt2-tiny", "--world-size", "2", "--memory-budget", "1GiB", "--seq-len", str(2**24 + 1)],
     "expected a positive integer of at most 16777216"),
    (["tune", "--trial-timeout", "0"], "a duration must be above 0"),
    (["tune", "--time-budget", "99999999h"], "at most 366 days"),
    (["tune", "--memory-budget", "9999999999TiB"], "size must be from 1 byte"),
    (["tune", "--concurrency", "0"], "expected a positive integer, got 0"),
    (["tune", "--patience", "-3"], "expected a positive integer, got -3"),
    (["tune", "--seed", "-1"], "expected an integer of 0 or more, got -1"),
    (["tune", "--seed", str(2**64)], "of at most 4294967295"),
    (["train", "--schedule", "s.json", "--lr", "nan"], "expected a positive learning rate, got nan"),
    (["train", "--schedule", "s.json", "--timeout", "inf"], "unparsable duration 'inf'"),
    (["train", "--schedule", "s.json", "--keep", "0"], "expected a positive integer, got 0"),
    (["verify", "--model", "gpt2-tiny", "--world-size", "64"], "64 cpu ranks on this machine's"),
])
def test_sizes_beyond_any_run_are_one_line(tmp_path, capfd, monkeypatch, argv, message):
    from slapo_tune import device

    monkeypatch.setattr(device, "usable_cores", lambda: [0, 1])  # the CI machine's two cores, wherever this runs
    out = tmp_path / "out"
    if "s.json" in argv:  # a schedule that trains: only the option is wrong
        argv = [str(_schedule(tmp_path / "s.json")) if a == "s.json" else a for a in argv]
    assert message in _one_line(capfd, [*argv, *_NOTHING_STARTED.get(argv[0], ()), *(["--out", str(out)]
                                                                                   if argv[0] == "tune" else [])])
    assert not out.exists()  # nothing written


# (had the option been taken, the command would have started: with no Ray head, no ranks, to show it)
_NOTHING_STARTED = {"tune": ("--ray-address", "none", "--trials", "1")}


def test_a_billion_ranks_is_refused_at_once_not_enumerated():
    """In a process of its own: on a main that took it, the divisors of 10^9 ran for minutes."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "slapo_tune", "space", "--model", "gpt2-tiny", "--world-size",
                           "1000000000"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "at most 1048576" in done.stderr and time.monotonic() - started < 60


def test_the_largest_world_lists_its_space_in_seconds(capfd):
    started = time.monotonic()
    assert main(["space", "--model", "gpt2-tiny", "--world-size", str(2**20)]) == 0
    assert "legal points:" in capfd.readouterr().out and time.monotonic() - started < 20


# ------------------------------------------------------------------------ files that are not files
@pytest.fixture
def special_files(tmp_path):
    """A device, a FIFO (opening it for reading would wait for a writer for ever), a link to a device."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    return [Path("/dev/zero"), Path("/dev/urandom"), fifo, link]


def test_special_files_are_refused_without_reading(tmp_path, capfd, special_files):
    for special in special_files:
        err = _one_line(capfd, ["train", "--schedule", str(special)])
        assert "is not a regular file" in err
        folder = tmp_path / f"model-{special.name}"
        folder.mkdir()
        (folder / "config.json").symlink_to(special)
        assert "is not a regular file" in _one_line(capfd, ["space", "--model", str(folder), "--world-size", "2"])
        space = tmp_path / f"space-{special.name}.py"
        space.symlink_to(special)
        assert "is not a regular file" in _one_line(capfd, ["space", "--model", "gpt2-tiny", "--world-size", "2",
                                                            "--space", str(space)])


def test_a_schedule_over_the_size_limit_is_refused_unread(tmp_path, capfd):
    """Valid JSON padded past 4 MiB: a size limit, not a parse error, refuses it."""
    path = _schedule(tmp_path / "s.json")
    path.write_text(path.read_text() + " " * (4 * 2**20))
    assert "over the 4 MiB a schedule file may have" in _one_line(capfd, ["train", "--schedule", str(path)])


# ------------------------------------------------------------------------ shapes no run has
@pytest.mark.parametrize("depth", [33, 100_000])
def test_deeply_nested_json_is_one_line(tmp_path, capfd, depth):
    path = tmp_path / "s.json"
    path.write_text("[" * depth + "]" * depth)
    assert "nests deeper than 32 levels" in _one_line(capfd, ["train", "--schedule", str(path)])
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"a":' * depth + "1" + "}" * depth)
    assert "nests deeper than 32 levels" in _one_line(capfd, ["space", "--model", str(tmp_path / "model"),
                                                              "--world-size", "2"])
    assert "expected package, a .whl file or a JSON object" in _one_line(
        capfd, ["tune", "--runtime-env", "[" * depth + "]" * depth, *_NOTHING_STARTED["tune"],
                "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def _config_dir(tmp_path: Path, name: str, values: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(values))
    return str(folder)


GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 512, "n_positions": 128}
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 128}


@pytest.mark.parametrize("values,message", [
    ({**GPT2, "n_layer": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ({**GPT2, "n_embd": 65}, "hidden size 65 is not divisible by its 4 attention heads"),
    ({**GPT2, "vocab_size": -5}, "vocab_size must be a positive integer, got -5"),
    ({**LLAMA, "num_attention_heads": 3, "num_key_value_heads": 3}, "not a multiple of the number of attention heads"),
    ({**LLAMA, "num_key_value_heads": 3}, "its 4 attention heads are not divisible by its 3 key/value heads"),
])
@pytest.mark.parametrize("command", [["space"], ["plan", "--memory-budget", "1GiB"]])
def test_a_config_no_transformer_has_is_one_line(tmp_path, capfd, values, message, command):
    model = _config_dir(tmp_path, "model", values)
    assert message in _one_line(capfd, [command[0], "--model", model, "--world-size", "2", *command[1:]])


def test_config_overrides_in_a_schedule_are_checked_like_a_config(tmp_path, capfd):
    path = _schedule(tmp_path / "s.json")
    data = json.loads(path.read_text())
    data["model"]["overrides"] = {"n_layer": 0}
    path.write_text(json.dumps(data))
    assert "num_hidden_layers must be a positive integer, got 0" in _one_line(capfd, ["train", "--schedule", str(path)])


def test_a_schedule_for_a_device_slapo_tune_does_not_know_is_refused(tmp_path, capfd):
    path = _schedule(tmp_path / "s.json", device="tpu")
    assert "device 'tpu' is not one of cpu, cuda" in _one_line(capfd, ["train", "--schedule", str(path)])
