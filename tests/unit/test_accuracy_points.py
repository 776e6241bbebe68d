"""The cost-model accuracy benchmark measures a given list of points (``--points FILE``): the
legal ones, as the space spells them; a malformed file is one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import cost_model_accuracy as acc

LABEL, WORLD = "gpt2-ref", 2


@pytest.fixture(scope="module")
def legal() -> list[dict]:
    """Every point of the benchmark's GPT-2 at world 2, as the space lists them (the ground truth
    of legality: enumeration walks the knobs and checks the rules, not ``Space.complete``)."""
    return list(acc._problem(LABEL, WORLD).space.enumerate())


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    # main() points the cost model's cache at a fresh folder; monkeypatch puts the variable back
    monkeypatch.setenv("SLAPO_TUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SLAPO_BENCH_DIR", str(tmp_path / "out"))


def _write(path: Path, evaluated: list, calibration: list, extra: dict | None = None) -> str:
    points = {LABEL: {str(WORLD): {"evaluated": evaluated, "calibration": calibration}}, **(extra or {})}
    path.write_text(json.dumps({"points": points}))
    return str(path)


def test_a_points_file_keeps_its_legal_points_in_the_spaces_knob_order_and_says_why_it_dropped_the_others(
        legal, tmp_path):
    kept = legal[:3]
    tp1, tp2 = [p for p in legal[3:] if p["tp"] == 1], [p for p in legal if p["tp"] == 2]
    unequal = {
        "a value no rule allows": {**tp1[0], "tp": 3},
        "legal values, an illegal combination": {**tp2[0], "pp": 2},  # tp * pp = 4 ranks on a world of 2
        "a knob missing (an older space's point)": {k: v for k, v in tp1[1].items() if k != "cp"},
        "an unknown knob": {**tp1[2], "experts": 2},
    }
    equal = {  # equal to a legal point (1.0 == 1, True == 1), yet not how the space spells it
        "a float for a knob of ints": {**tp1[3], "micro_batch": float(tp1[3]["micro_batch"])},
        "True for a knob of ints": {**tp1[4], "tp": True},
    }
    assert not any(p in legal for p in unequal.values()) and all(p in legal for p in equal.values())
    illegal = {**unequal, **equal}
    shuffled = [dict(reversed(list(p.items()))) for p in kept]  # the file's knob order is not the space's
    path = _write(tmp_path / "p.json", shuffled[:2] + list(illegal.values()), [shuffled[2]])

    selection, dropped = acc.read_points(path)

    assert selection == {LABEL: {WORLD: (kept[:2], [kept[2]])}}
    for point in selection[LABEL][WORLD][0]:
        assert list(point) == acc._problem(LABEL, WORLD).space.names  # format_point: the CSV's spelling
    assert [d["point"] for d in dropped] == list(illegal.values())
    reasons = {why: d["reason"] for why, d in zip(illegal, dropped)}
    assert "tp=3" in reasons["a value no rule allows"]
    assert "pp=2" in reasons["legal values, an illegal combination"]
    assert "cp" in reasons["a knob missing (an older space's point)"]
    assert "experts" in reasons["an unknown knob"]
    assert "float" in reasons["a float for a knob of ints"]
    assert "bool" in reasons["True for a knob of ints"]


def _stub_run(seen: list):
    """``run`` without training: records the selection it was given, one row per evaluated point."""
    def run(selection):
        seen.append(selection)
        rows = [{"model": label, "world": world, "point": str(p), "stage": 0, "measured": 100 + i, "exact": 101,
                 "analytic": 99, "exact_error": 0.01, "analytic_error": -0.01, "uncalibrated_error": 0.1,
                 "step_seconds": 1.0 + i, "predicted_step_seconds": 1.0 + i, "uncalibrated_step_seconds": 2.0,
                 "exact_seconds": 0.1, "trial_seconds": 1.0}
                for label, per_world in selection.items() for world, (pts, _) in per_world.items()
                for i, p in enumerate(pts)]
        return {"rows": rows, "models": {}, "points": acc.points_record(selection)}
    return run


def test_a_runs_recorded_points_fed_back_select_the_same_points(monkeypatch, tmp_path):
    seen: list = []
    monkeypatch.setattr(acc, "run", _stub_run(seen))
    acc.main(["--points-per-world", "2", "--calibration-per-world", "1", "--models", LABEL, "--worlds", "1,2"])
    recorded = tmp_path / "out" / "cost_model_accuracy.json"
    copy = tmp_path / "points.json"
    copy.write_text(recorded.read_text())  # the run overwrites its own JSON

    summary = acc.main(["--points", str(copy)])

    assert seen[1] == seen[0] == acc.sampled_points((LABEL,), (1, 2), 2, 1)
    assert summary["dropped_points"] == 0
    assert json.loads(recorded.read_text())["points"] == json.loads(copy.read_text())["points"]


def _refuse_to_train(selection):
    raise AssertionError("a malformed points file was measured")


def _exit_line(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        acc.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    return err.splitlines()[-1]


@pytest.mark.parametrize("case, expected", [
    ("not JSON", "not valid JSON"),
    ("no points", "no 'points' object"),
    ("unknown model", "unknown model 'gpt9'"),
    ("world 0", "world '0' is not a world size from 1 to 8"),
    ("world 16", "world '16' is not a world size"),
    ("a list for a point", "is not {\"evaluated\""),
    ("a list in a point", "is not {\"evaluated\""),
    ("no calibration key", "is not {\"evaluated\""),
    ("a calibration point also evaluated", "must not also be an evaluated one"),
    ("a point twice", "twice"),
    ("no legal calibration point", "no calibration point of gpt2-ref is legal"),
    ("over 1,000 points", "over 1000 points"),
    ("over 1 MiB", "over the 1 MiB"),
])
def test_a_malformed_points_file_is_one_line_and_exit_status_2(case, expected, legal, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(acc, "run", _refuse_to_train)
    path = tmp_path / "p.json"
    one, two = legal[0], legal[1]
    if case == "not JSON":
        path.write_text("{points")
    elif case == "no points":
        path.write_text(json.dumps({"summary": {}}))
    elif case == "unknown model":
        _write(path, [one], [two], {"gpt9": {"1": {"evaluated": [], "calibration": []}}})
    elif case.startswith("world "):
        path.write_text(json.dumps({"points": {LABEL: {case.split()[1]: {"evaluated": [one], "calibration": [two]}}}}))
    elif case == "a list for a point":
        _write(path, [list(one.values())], [two])
    elif case == "a list in a point":
        _write(path, [{**one, "tp": [1]}], [two])
    elif case == "no calibration key":
        path.write_text(json.dumps({"points": {LABEL: {str(WORLD): {"evaluated": [one]}}}}))
    elif case == "a calibration point also evaluated":
        _write(path, [one, two], [two])
    elif case == "a point twice":
        _write(path, [one, two, one], [legal[2]])
    elif case == "no legal calibration point":
        _write(path, [one], [{**two, "tp": 3}])
    elif case == "over 1,000 points":
        _write(path, legal[2:acc.MAX_POINTS + 2], [two])  # 1,001
    else:
        path.write_text(json.dumps({"points": {}}) + " " * acc.MAX_POINTS_BYTES)
    line = _exit_line(["--points", str(path)], capsys)
    assert line.startswith("cost_model_accuracy: points file") and expected in line, line


def test_points_with_a_sampling_option_is_refused(tmp_path, capsys):
    line = _exit_line(["--points", str(tmp_path / "p.json"), "--quick"], capsys)
    assert "--points lists its own models, worlds and points: not with --quick" in line
