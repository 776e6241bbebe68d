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
    (["--knobs", "foo=1"], "unknown knob 'foo' (knobs: tp, pp, sp, dp, zero, micro_batch"),
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
    (["verify", "--model", "gpt2-tiny", "--world-size", "3"], "no legal schedule for gpt2-tiny on 3 ranks"),
    (["verify", "--model", "gpt5", "--world-size", "2"], "unknown model 'gpt5'"),
    (["verify", "--model", "gpt2-tiny", "--world-size", "0"], "expected a positive integer, got 0"),
    (["space", "--world-size", "2"], "the following arguments are required: --model"),
    (["tune-everything"], "invalid choice: 'tune-everything'"),
    (["tune", "--confirm", "-1"], "expected an integer of 0 or more, got -1"),
    (["tune", "--confirm", "three"], "expected an integer of 0 or more, got 'three'"),
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


def test_verify_command_passes_and_prints_differences(capsys):
    code, out, _ = _run(capsys, "verify", "--model", "llama-tiny", "--world-size", "2",
                        "--knobs", "tp=2,ckpt_ratio=0.5,fuse=on", "--seq-len", "16")
    assert code == 0, out
    assert "rank 1 (stage 0): loss" in out and "max relative error" in out and out.endswith("verify: OK\n")
