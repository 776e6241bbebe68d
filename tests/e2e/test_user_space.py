"""Knobs of one's own: a template written as ``schedule(sch, point)`` plus ``KNOBS`` in a user's
file (``--space my_space.py``) is listed by ``space``, checked by ``verify``, explored by ``tune``,
exported by path and content hash and trained by ``train``, which refuses the file once it changed."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import types
from pathlib import Path

import pytest

from slapo_tune.cli import main
from slapo_tune.errors import UsageError
from slapo_tune.problem import ProblemSpec

ROOT = Path(__file__).resolve().parents[2]

# a wrong schedule for logit_scale=2 (the logits doubled): only verify running it can tell
DOUBLED = '''BASE = "llama"
KNOBS = {"logit_scale": [1, 2]}


def schedule(sch, point):
    if point["logit_scale"] != 1:
        sch["lm_head"].mod.register_forward_hook(lambda mod, args, out: out * point["logit_scale"])
'''


def _readme_space() -> str:
    text = (ROOT / "docs" / "search-spaces.md").read_text()
    return re.search(r"### Knobs of your own\n.*?```python\n# my_space.py\n(.*?)```", text, re.S).group(1)


def _one_line_error(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_the_readme_knob_is_tuned_exported_and_trained(tmp_path, capfd, monkeypatch, no_leftover_children):
    """The documented file (docs/search-spaces.md), as written: ``tune`` explores its knob's two values (each trial a rank
    process of its own, loading the file by its path), the exported schedule names the file by
    path and SHA-256 (computed here with hashlib), ``train`` runs it (its one rank in this
    process), and refuses it in one line once the file changed or is gone."""
    import slapo_tune.cli.train as train_command

    code = _readme_space()
    assert len(code.strip().splitlines()) <= 30
    space = tmp_path / "my_space.py"
    space.write_text(code)
    out = tmp_path / "study"
    # every knob but the file's own held: the grid's two points are its two values
    assert main(["tune", "--model", "llama-tiny", "--world-size", "1", "--space", str(space),
                 "--knobs", "micro_batch=4,ckpt_ratio=0.0,attn=sdpa,fuse=off", "--strategy", "grid", "--trials", "2",
                 "--ray-address", "none", "--prune", "none", "--measured-steps", "1", "--confirm", "0",
                 "--global-batch", "4", "--seq-len", "16", "--out", str(out), "--quiet"]) == 0, capfd.readouterr()
    with open(out / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["sdpa_backend"] for r in rows) == ["auto", "math"] and {r["status"] for r in rows} == {"ok"}
    schedule = json.loads((out / "best_schedule.json").read_text())
    assert schedule["template"] == {"name": "my_space", "version": "1", "file": str(space.resolve()),
                                    "sha256": hashlib.sha256(space.read_bytes()).hexdigest()}
    assert schedule["knobs"]["sdpa_backend"] in ("auto", "math")

    capfd.readouterr()
    # the schedule only names the file: it runs when the user names it too
    err = _one_line_error(capfd, ["train", "--schedule", str(out / "best_schedule.json")])
    assert f"was made with the template file {space.resolve()}, which is Python" in err
    assert f"pass --space {space.resolve()}" in err
    with monkeypatch.context() as patch:
        patch.setattr(train_command, "launch", _in_process_launch)
        assert main(["train", "--schedule", str(out / "best_schedule.json"), "--space", str(space),
                     "--steps", "2"]) == 0
    assert re.search(r"^step 2/2 loss [0-9.]+", capfd.readouterr().out, re.M)

    space.write_text(code + "# edited\n")
    err = _one_line_error(capfd, ["train", "--schedule", str(out / "best_schedule.json"), "--space", str(space)])
    assert f"template file {space.resolve()} is not the one tuned with" in err
    space.unlink()
    err = _one_line_error(capfd, ["train", "--schedule", str(out / "best_schedule.json"), "--space", str(space)])
    assert f"template file {space.resolve()} does not exist" in err


def _in_process_launch(fn, world_size, args=(), **_):
    """``launch`` for one rank in this process (a one-rank gloo group), so ``verify`` runs here."""
    import torch.distributed as dist

    assert world_size == 1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return [fn(types.SimpleNamespace(rank=0, device="cpu"), *args)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scale, code, verdict", [(1, 0, "verify: OK"), (2, 1, "verify: FAILED")])
def test_verify_runs_the_files_schedule(tmp_path, capsys, monkeypatch, scale, code, verdict):
    import slapo_tune.cli.verify as verify_command

    monkeypatch.setattr(verify_command, "launch", _in_process_launch)
    space = tmp_path / "doubled.py"
    space.write_text(DOUBLED)
    assert main(["verify", "--model", "llama-tiny", "--world-size", "1", "--global-batch", "2", "--seq-len", "16",
                 "--space", str(space), "--knobs", f"logit_scale={scale}"]) == code
    out = capsys.readouterr().out
    assert f"template doubled v1 ({space.resolve()}" in out and out.rstrip().endswith(verdict), out


def test_a_file_without_a_base_searches_the_runtime_knobs_beside_its_own(tmp_path):
    space = tmp_path / "plain.py"
    space.write_text('NAME = "plain"\nKNOBS = {"eps": [1e-6, 1e-5]}\nCONSTRAINTS = [lambda p: '
                     '"eps=1e-5 wants micro_batch 2" if p["eps"] == 1e-5 and p["micro_batch"] != 2 else None]\n\n\n'
                     'def schedule(sch, point):\n    pass\n')
    problem = ProblemSpec("llama-tiny", 2, template=str(space), global_batch=4).resolve()
    domains = problem.space.domains()
    assert domains["tp"] == [1] and domains["pp"] == [1] and domains["ckpt_ratio"] == [0.0]
    assert domains["zero"] == [0, 1, 2, 3] and domains["attn"] == ["sdpa", "eager"] and domains["eps"] == [1e-6, 1e-5]
    assert all(p["micro_batch"] == 2 for p in problem.space.enumerate() if p["eps"] == 1e-5)
    assert problem.spec.template == str(space.resolve())
    assert problem.spec.template_sha256 == hashlib.sha256(space.read_bytes()).hexdigest()
    with pytest.raises(UsageError, match="tp=2 is not legal.*extends no template"):
        problem.plan("tp=2")
    assert problem.plan("micro_batch=2,eps=1e-05").extra == {"eps": 1e-5}  # typed from text like any knob
    # what a trial rank resolves: the study's file, or nothing
    space.write_text(space.read_text() + "\n")
    with pytest.raises(UsageError, match="is not the one tuned with"):
        problem.spec.resolve()


_BAD_FILES = [
    (None, "template file {path} does not exist"),
    ("KNOBS = {'x': [1, 2]\n", "cannot load template file {path}: SyntaxError"),
    ("X = 1\n", "{path} defines no schedule(sch, point) with KNOBS, no TEMPLATE"),
    ("KNOBS = {'x': [1, 2]}\n", "{path} declares KNOBS but no schedule(sch, point) function"),
    ("def schedule(sch, point):\n    pass\n", "{path} defines schedule() but no KNOBS dict"),
    ("KNOBS = {}\ndef schedule(sch):\n    pass\n", "{path}: schedule must take two arguments, (sch, point)"),
    ("KNOBS = {'x': [1, 'a']}\ndef schedule(sch, point):\n    pass\n", "knob 'x' values must all be ints, all floats"),
    ("KNOBS = {'x': []}\ndef schedule(sch, point):\n    pass\n", "knob 'x' needs a non-empty list of values"),
    ("KNOBS = {'tp': [1]}\ndef schedule(sch, point):\n    pass\n", "knob 'tp' is one every template has"),
    ("BASE = 'lama'\nKNOBS = {}\ndef schedule(sch, point):\n    pass\n", "BASE 'lama' is not a template"),
    ("from slapo_tune.space import Knob\nKNOBS = {'x': Knob('x', lambda p: [1], depends=('y',))}\n"
     "def schedule(sch, point):\n    pass\n", "knob 'x' depends on 'y', which is not a knob declared before it"),
]


@pytest.mark.parametrize("text, message", _BAD_FILES)
def test_a_bad_template_file_is_one_line_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "space.py"
    if text is not None:
        path.write_text(text)
    err = _one_line_error(capsys, ["space", "--model", "llama-tiny", "--world-size", "2", "--space", str(path)])
    assert message.format(path=path) in err, err
