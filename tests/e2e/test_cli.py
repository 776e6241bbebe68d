"""The command line: one clear line and exit code 2 for bad input, never a traceback."""

import json
import subprocess
import sys

import pytest

from slapo_tune.cli import main
from slapo_tune.problem import ProblemSpec


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv,message", [
    (["--knobs", "foo=1"], "unknown knob 'foo' (knobs: tp, pp, cp, sp, dp, zero, micro_batch"),
    (["--knobs", "tp=2,tp=4"], "knob 'tp' is given twice"),
    (["--knobs", "tp=3"], "tp=3 is not legal for this model and world; legal values: 1, 2, 4"),
    (["--knobs", "tp=2,pp=4"], "pp=4 is not legal for this model and world with tp=2; legal values: 1, 2"),
    (["--knobs", "ckpt_ratio=half"], "ckpt_ratio=half: not a valid float"),
    (["--knobs", "tp"], "knobs must be NAME=VALUE"),
    (["--space", "nope"], "unknown space/template 'nope'"),
])
def test_verify_bad_knobs(capsys, argv, message):
    code, out, err = _run(capsys, "verify", "--model", "gpt2-tiny", "--world-size", "4", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    # (3 ranks are legal since uneven stages: pp=3 cuts 1, 2, 1 blocks; 5 exceed the 4 blocks)
    (["verify", "--model", "gpt2-tiny", "--world-size", "5"], "no legal schedule for gpt2-tiny on 5 ranks"),
    (["verify", "--model", "gpt5", "--world-size", "2"], "unknown model 'gpt5'"),
    (["verify", "--model", "gpt2-tiny", "--world-size", "0"], "expected a positive integer, got 0"),
    (["space", "--world-size", "2"], "the following arguments are required: --model"),
    (["tune-everything"], "invalid choice: 'tune-everything'"),
    (["tune", "--confirm", "-1"], "expected an integer of 0 or more, got -1"),
    (["tune", "--confirm", "three"], "expected an integer of 0 or more, got 'three'"),
    (["tune", "--ray-address", "none", "--keep-dashboard"], "--keep-dashboard keeps the head of --ray-address local"),
    (["tune", "--runtime-env", "[1]"], "--runtime-env '[1]': expected package, a .whl file or a JSON object"),
    (["export", "--out", "x"], "give the study's storage: --storage URL, --storage-file PATH or $SLAPO_TUNE_STORAGE"),
    (["export", "--storage", "/nowhere/study.journal", "--out", "x"], "no study journal at /nowhere/study.journal"),
    (["show", "results/x", "--study", "s"], "give a results folder or --storage/--storage-file (with --study)"),
])
def test_other_bad_input(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and message in err


def test_space_prints_sizes_of_real_models(capsys):
    code, out, _ = _run(capsys, "space", "--model", "llama-7b", "--world-size", "64")
    walked = sum(1 for _ in ProblemSpec("llama-7b", 64).resolve().space.enumerate())  # not the count's shortcut
    assert code == 0 and "template llama v1, world 64" in out and f"legal points: {walked}" in out
    code, out, _ = _run(capsys, "space", "--model", "llama-70b", "--world-size", "64", "--json")
    data = json.loads(out)
    assert code == 0 and data["legal_points"] > 1000 and data["seconds"] < 5


def test_space_lists_domains(capsys):
    code, out, _ = _run(capsys, "space", "--model", "gpt2-tiny", "--world-size", "2", "--domains")
    assert code == 0
    assert "tp                 1, 2" in out and "fuse               off, on" in out


def test_a_real_process_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "slapo_tune.cli", "verify", "--model", "gpt2-tiny",
                           "--world-size", "4", "--knobs", "pp=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "slapo-tune: error: pp=3 is not legal for this model and world with tp=1; legal values: 1, 2, 4"]


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """``slapo-tune plan ... | head``: once the reader has gone, the command stops without a traceback."""
    # --json with a budget many points miss: about 16 MB of pruned examples, far more than a pipe holds
    proc = subprocess.Popen([sys.executable, "-m", "slapo_tune.cli", "plan", "--model", "llama-7b", "--world-size", "4",
                             "--seq-len", "128", "--global-batch", "32", "--memory-budget", "24GiB", "--top", "100000",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.read(1) == "{"
        proc.stdout.close()  # megabytes of rows are still to come
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 1
    finally:
        proc.kill()
        proc.wait()
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_verify_command_passes_and_prints_differences(capsys):
    code, out, _ = _run(capsys, "verify", "--model", "llama-tiny", "--world-size", "2",
                        "--knobs", "tp=2,ckpt_ratio=0.5,fuse=on", "--seq-len", "16")
    assert code == 0, out
    assert "rank 1 (stage 0): loss" in out and "max relative error" in out and out.endswith("verify: OK\n")


def test_every_option_says_what_it_does_and_its_default():
    """``--help`` of every command: each option has a help line, and each default that is not
    "nothing" (None, off) is shown in it."""
    import argparse

    from slapo_tune.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            text = action.help or ""
            where = f"{name} {(action.option_strings or [action.dest])[0]}"
            if not text.strip():
                missing.append(f"{where}: no help")
            elif action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
                missing.append(f"{where}: default {action.default!r} not shown")
    assert not missing, missing


def test_version_is_the_package_version(capsys):
    import slapo_tune

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"slapo-tune {slapo_tune.__version__}"


def test_demo_runs_another_template_and_refuses_a_world_it_cannot_split(capsys):
    code, out, _ = _run(capsys, "demo", "--model", "llama-tiny", "--world-size", "2")
    assert code == 0 and "(llama template)" in out and "verify: OK" in out, out
    # 3 ranks split it since uneven stages (pp=3: 1, 2, 1 blocks); 5 exceed its 4 blocks
    code, out, err = _run(capsys, "demo", "--model", "llama-tiny", "--world-size", "5")
    assert code == 2 and not out
    assert len(err.splitlines()) == 1 and err.startswith("slapo-tune: error: no legal schedule for llama-tiny on 5 ranks")
    assert "tp must divide 8 heads, 4 KV heads" in err, err


def _small_study():
    """A problem and a study of three told trials (two ok, one pruned), as the tuner tells them."""
    import optuna

    problem = ProblemSpec("gpt2-tiny", 2, global_batch=8, seq_len=32, memory_budget=16 * 2**20).resolve()
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("context", {"memory_budget": 16 * 2**20})
    reason = "predicted peak 44.0 MiB (at least 40.0 MiB) on stage 0 > budget 16.0 MiB, and more words " * 2
    for knobs, rate, peak in (("tp=1,micro_batch=1", 50.0, 9 * 2**20), ("tp=2,sp=on,micro_batch=2", 80.0, 12 * 2**20),
                              ("pp=2,micro_batch=4,ckpt_ratio=0.5", None, 44 * 2**20)):
        point = dict(problem.plan(knobs))
        attrs = {"point": point, "status": "ok" if rate else "pruned", "predicted": {"peak": peak, "step_s": 0.1}}
        if rate:
            attrs["result"] = {"samples_per_s": rate, "peak_memory": [peak, peak - 1], "step_times": [0.1, 0.11]}
        else:
            attrs["reason"] = reason
        state = optuna.trial.TrialState.COMPLETE if rate else optuna.trial.TrialState.PRUNED
        study.add_trial(optuna.trial.create_trial(state=state, value=rate, user_attrs=attrs))
    return problem, study


def test_the_report_is_drawn_once_the_study_has_run_a_while_and_at_its_end(tmp_path, monkeypatch):
    """Plots take seconds: told trials rewrite the tables at once, but the report only once the
    study has run ``REPORT_INTERVAL`` seconds (a short study draws it once, at its end), then at
    most every interval; ``finish`` always draws it."""
    import time

    from slapo_tune.search import _outputs

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    drawn = []
    monkeypatch.setattr(_outputs, "write_report", lambda *args: drawn.append(clock[0]))
    problem, study = _small_study()
    outputs = _outputs.Outputs(tmp_path, problem, "guided")
    trial = study.trials[0]
    for seconds in (1.0, 5.0, _outputs.REPORT_INTERVAL - 7.0):  # told within the first interval
        clock[0] += seconds
        outputs(study, trial)
    assert (tmp_path / "trials.csv").is_file() and drawn == []
    clock[0] += 2.0  # the study has run the interval
    outputs(study, trial)
    assert drawn == [clock[0]]
    clock[0] += 1.0
    outputs(study, trial)  # not again within an interval
    outputs.finish(study)
    assert drawn == [clock[0] - 1.0, clock[0]]


def test_show_fits_100_columns_marks_the_best_and_names_units(tmp_path, capsys):
    """A study's folder as the tuner writes it (trials.csv, best_schedule.json): ``show`` prints one
    line per trial within 100 columns, the varying knobs only ("-" where a knob does nothing), sizes
    with units against the budget, the best row marked; ``--csv`` is the table itself."""
    import csv as csv_module

    from slapo_tune.search._outputs import Outputs

    problem, study = _small_study()
    Outputs(tmp_path, problem, "guided").finish(study)

    assert main(["show", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    header, rows = lines[0].split(), {line.split()[1 if line.startswith("*") else 0]: line for line in lines[1:4]}
    assert "peak/16.0" in header and "MiB" in header and {"tp", "pp", "sp", "mb", "ckpt"} <= set(header)
    assert rows["1"].startswith("*") and "80.0" in rows["1"] and "12.0 MiB" in rows["1"]
    assert not rows["0"].startswith("*") and "9.0 MiB" in rows["0"]
    assert "~44.0 MiB" in rows["2"] and rows["2"].endswith("…")  # a prediction, the reason cut to fit
    assert " - " in rows["0"]  # sp does nothing at tp=1
    assert "nan" not in "\n".join(lines).lower()
    assert any(line.startswith("best (*): trial 1 at 80.00 samples/s") for line in lines[4:])  # (wrapped to fit)

    assert main(["show", str(tmp_path), "--csv"]) == 0
    with open(tmp_path / "trials.csv", newline="") as f:
        assert capsys.readouterr().out == f.read()
    with open(tmp_path / "trials.csv", newline="") as f:
        assert {r["trial"]: r["memory_budget"] for r in csv_module.DictReader(f)} == {str(i): str(16 * 2**20) for i in range(3)}


def test_export_names_what_is_wrong_with_the_study_asked_for(tmp_path, capsys):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    journal = tmp_path / "study.journal"
    storage = JournalStorage(JournalFileBackend(str(journal)))
    for name in ("a", "b"):
        optuna.create_study(study_name=name, storage=storage)
    code, _, err = _run(capsys, "export", "--storage", str(journal), "--out", str(tmp_path / "o"))
    assert code == 2 and err.strip().endswith("holds 2 studies (a, b): name one with --study"), err
    code, _, err = _run(capsys, "show", "--storage", str(journal), "--study", "c")
    assert code == 2 and err.strip().endswith("no study 'c' in " + str(journal) + " (it holds: a, b)"), err
    code, _, err = _run(capsys, "export", "--storage", str(journal), "--study", "a", "--out", str(tmp_path / "o"))
    assert code == 2 and "study 'a' in " in err and "was not written by slapo-tune tune" in err, err


PLAN_CASES = {  # the command, and one model of each other template (generic: llama-7b's config)
    "llama-70b": ["--model", "llama-70b", "--world-size", "64", "--hardware", "h100-80gb", "--precision", "bf16",
                  "--seq-len", "4096", "--global-batch", "1024"],
    "gpt2-xl": ["--model", "gpt2-xl", "--world-size", "8", "--hardware", "a100-40gb"],
    "bert-large": ["--model", "bert-large", "--world-size", "8", "--hardware", "a100-40gb"],
    "opt-1.3b": ["--model", "opt-1.3b", "--world-size", "16", "--hardware", "v100-32gb", "--top", "8"],
    "generic": ["--model", "llama-7b", "--space", "generic", "--world-size", "8", "--seq-len", "1024",
                "--global-batch", "64"],
}


@pytest.mark.parametrize("argv", PLAN_CASES.values(), ids=PLAN_CASES)
def test_plan_fits_100_columns_and_keeps_what_it_found(capsys, argv):
    """``plan``'s text: every line within 100 columns (a point was one 150-column ``k=v,...``
    string, its memory a 300-column line), and nothing of what ``--json`` holds lost: the counts,
    each shown point's number, knobs (a table under short names, with a legend; the knobs every
    row shares on a line above it), peak, step time and each part of its peak."""
    from slapo_tune.plan import SHORT_NAMES
    from slapo_tune.units import format_size

    code, out, _ = _run(capsys, "plan", *argv, "--json")
    data = json.loads(out)
    assert code == 0
    code, out, _ = _run(capsys, "plan", *argv)
    lines = out.splitlines()
    assert code == 0 and max(map(len, lines)) <= 100, max(lines, key=len)
    assert f"{data['points']} point(s), {data['feasible']} fit, {data['pruned']} pruned" in lines[0]
    shared = next(line for line in lines if line.startswith(("every row: ", "knobs: ")))
    header = next(line.split() for line in lines if line.split()[0] == "#")
    columns = header[1:header.index("peak")]
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0].isdigit()}
    assert len(rows) == len(data["top"])
    for number, top in enumerate(data["top"], 1):
        cells = rows[str(number)]
        assert dict(zip(columns, cells[1:])) == {SHORT_NAMES.get(k, k): str(v) for k, v in top["point"].items()
                                                 if SHORT_NAMES.get(k, k) in columns}
        assert " ".join(cells[len(columns) + 1:len(columns) + 4]) == f"{format_size(top['peak'])} {top['step_s']:.3f}"
        details = out.split(f"\n{number:>3}. ")[1].split(f"\n{number + 1:>3}. ")[0]
        assert f"peak {format_size(top['peak'])} (stage {top['stage']}; up to {format_size(top['upper'])}" in details
        assert all(f"{k} {format_size(v)}" in details for k, v in top["breakdown"].items() if v >= 2**20)
    best = data["top"][0]["point"]
    named = {**dict(zip(columns, rows["1"][1:])), **dict(item.split("=") for item in shared.split(": ", 1)[1].split())}
    assert named == {SHORT_NAMES.get(k, k): str(v) for k, v in best.items()}  # every knob of the best point
    legend = " ".join(lines)
    assert all(f"{short} = {k}" in legend for k, short in SHORT_NAMES.items() if short in named)


def test_a_table_wider_than_100_columns_continues_below_with_its_row_numbers():
    from slapo_tune.cli._common import WIDTH, table

    header = ["#", *(f"knob{i:02}" for i in range(20))]
    rows = [header, *([str(n), *(f"v{n}.{i}" for i in range(20))] for n in (1, 2, 10))]
    lines = table(rows, right={0})
    assert max(map(len, lines)) <= WIDTH and len(lines) == 4 * 2  # two blocks of 4 lines
    assert [line.split()[0] for line in lines] == ["#", "1", "2", "10"] * 2
    assert lines[3].startswith("10 ") and lines[1].startswith(" 1 ")  # the numbers right-aligned
    for row in rows:  # each cell once, beside its row's number
        assert [c for line in lines if line.split()[0] == row[0] for c in line.split()[1:]] == row[1:]
