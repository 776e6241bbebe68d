"""The training job: a tuned schedule trains like the unscheduled model, resumes exactly, runs
under torchrun, loads Hugging Face weights, and refuses bad schedule files in one line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as hs

import slapo_tune as st
from slapo_tune.apply import load_schedule
from slapo_tune.cli import main
from slapo_tune.data import TrainingData
from slapo_tune.models import ModelSpec, config_fingerprint, load_config
from slapo_tune.plan import Plan, Workload
from slapo_tune.schedule_file import make_schedule

from _helpers import schedule_file as _schedule
from _helpers import subprocess_env as _env

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step (\d+)/\d+ loss ([0-9.]+)", re.M)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slapo_tune", *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP.findall(stdout)}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> Path:
    """A schedule exported by a real (small) tuning run of gpt2-tiny on 2 ranks: one trial, the
    study's baseline (the out-of-the-box point), so that the point tested does not depend on which
    trial timed faster."""
    out = tmp_path_factory.mktemp("tuned")
    done = _cli("tune", "--model", "gpt2-tiny", "--world-size", "2", "--memory-budget", "64MiB", "--trials", "1",
                "--strategy", "grid", "--ray-address", "none", "--prune", "analytic", "--measured-steps", "1",
                "--global-batch", "8", "--seq-len", "32", "--out", str(out), "--quiet", timeout=600)
    trials = (out / "trials.csv").read_text() if (out / "trials.csv").exists() else ""
    assert done.returncode == 0 and (out / "best_schedule.json").is_file(), done.stdout + done.stderr + trials
    return out / "best_schedule.json"


def _reference_losses(preset: str, global_batch: int, seq_len: int, steps: int, lr: float = 1e-3,
                      autocast: torch.dtype | None = None) -> list[float]:
    """The same training with the unscheduled model in this process (16-bit: under torch's autocast)."""
    import contextlib

    model = st.build(st.create_schedule(st.build_model(preset)), seed=0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = TrainingData("synthetic", model.config.vocab_size, global_batch, seq_len, seed=0)
    losses = []
    for step in range(steps):
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            loss = model(**data.batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_tuned_schedule_trains_like_the_unscheduled_model(tuned, no_leftover_children):
    loaded = load_schedule(tuned)
    assert loaded.world_size == 2
    done = _cli("train", "--schedule", str(tuned), "--steps", "30")
    assert done.returncode == 0, done.stderr
    losses = _losses(done.stdout)
    assert sorted(losses) == list(range(1, 31))
    reference = _reference_losses("gpt2-tiny", loaded.workload.global_batch, loaded.workload.seq_len, 30)
    for step, expected in enumerate(reference, start=1):  # seen: within 1.4e-6 (the log prints 6 decimals)
        assert losses[step] == pytest.approx(expected, abs=2e-5), (step, loaded.plan)
    assert losses[30] < losses[1] - 0.2  # it learns (6.25 -> 5.90 here)


def test_a_bf16_schedule_trains_under_autocast(tmp_path, no_leftover_children):
    """A schedule tuned in bf16 trains in bf16: its losses follow the unscheduled model's under
    torch's autocast, and not the fp32 curve, from the first step on. (OPT: of the tiny presets the
    one whose first loss moves most under bf16, 5e-5; GPT-2's moves by 5e-6, below the log's
    resolution of the tolerance.)"""
    # one micro-batch: the reference runs the same batch in one pass
    path = _schedule(tmp_path / "amp-bf16.json", "opt-tiny", precision="amp-bf16", micro_batch=8)
    done = _cli("train", "--schedule", str(path), "--steps", "5")
    assert done.returncode == 0, done.stderr
    losses = _losses(done.stdout)
    reference = _reference_losses("opt-tiny", 8, 32, 5, autocast=torch.bfloat16)
    tolerance = 2e-5  # as for fp32 above
    assert [losses[s] for s in range(1, 6)] == pytest.approx(reference, abs=tolerance)
    assert abs(losses[1] - _reference_losses("opt-tiny", 8, 32, 1)[0]) > tolerance  # fp32's first loss


def _bf16_master_losses(preset: str, global_batch: int, seq_len: int, steps: int, lr: float = 1e-4) -> list[float]:
    """The unscheduled model trained by hand the way bf16 training keeps its weights: a bf16 copy
    computes, an fp32 copy is what AdamW steps, and the bf16 copy is rounded from it after each step."""
    master = st.build(st.create_schedule(st.build_model(preset)), seed=0)
    model = st.build(st.create_schedule(st.build_model(preset)), seed=0).to(torch.bfloat16)
    master.train()
    model.train()
    optimizer = torch.optim.AdamW(master.parameters(), lr=lr)
    data = TrainingData("synthetic", model.config.vocab_size, global_batch, seq_len, seed=0)
    losses = []
    for step in range(steps):
        loss = model(**data.batch(step)).loss
        loss.backward()
        for low, high in zip(model.parameters(), master.parameters(), strict=True):
            high.grad = low.grad.float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for low, high in zip(model.parameters(), master.parameters(), strict=True):
                low.copy_(high)
        losses.append(loss.item())
    return losses


def test_a_bf16_parameter_schedule_trains_with_fp32_masters_and_resumes(tmp_path, no_leftover_children):
    """bf16 parameters, fp32 master weights: the losses follow the hand-written bf16/fp32-master loop,
    not the autocast one; a job resumed from a checkpoint continues the same curve (the masters are
    saved, not the rounded bf16 weights)."""
    path = _schedule(tmp_path / "bf16.json", "opt-tiny", precision="bf16", micro_batch=8)
    whole = _cli("train", "--schedule", str(path), "--steps", "5", "--lr", "1e-3", "--save", str(tmp_path / "c"),
                 "--save-every", "3")
    assert whole.returncode == 0, whole.stderr
    losses = _losses(whole.stdout)
    reference = _bf16_master_losses("opt-tiny", 8, 32, 5, lr=1e-3)
    assert [losses[s] for s in range(1, 6)] == pytest.approx(reference, abs=2e-5)
    autocast = _reference_losses("opt-tiny", 8, 32, 5, autocast=torch.bfloat16)
    assert abs(losses[5] - autocast[4]) > 2e-5  # a different precision from amp-bf16
    (tmp_path / "c" / "latest").write_text("step-000003\n")  # resume from step 3 (5 was saved after it)
    resumed = _cli("train", "--schedule", str(path), "--steps", "5", "--lr", "1e-3", "--resume", str(tmp_path / "c"))
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(resumed.stdout) == {4: losses[4], 5: losses[5]}


def test_killed_job_resumes_to_the_same_weights(tmp_path, no_leftover_children):
    schedule = _schedule(tmp_path / "s.json", dp=2, zero=3, ckpt_ratio=0.5,  # sharded params and optimizer
                         measured={"samples_per_s": 123.4})
    started = time.monotonic()
    whole = _cli("train", "--schedule", str(schedule), "--steps", "16", "--save", str(tmp_path / "a"))
    wall = time.monotonic() - started
    assert whole.returncode == 0, whole.stderr
    # each step's printed throughput: more than the whole command's (start-up included), tokens = samples x 32
    rates = [(float(a), float(b)) for a, b in re.findall(r"([0-9.]+) samples/s ([0-9.]+) tokens/s", whole.stdout)]
    assert len(rates) == 16 and all(a > 8 / wall and b == pytest.approx(32 * a, rel=0.01, abs=1) for a, b in rates)
    # what a person reads: the set-up (spawning ranks included), elapsed and ETA per step, and a
    # summary whose mean is the steps' printed rates averaged over their time
    setup = float(re.search(r"^ready after ([0-9.]+) s of set-up", whole.stdout, re.M).group(1))
    assert 0 < setup < wall
    clocks = re.findall(r"\| elapsed (\d+):(\d\d):(\d\d), ETA (\d+):(\d\d):(\d\d)$", whole.stdout, re.M)
    assert len(clocks) == 16 and clocks[-1][3:] == ("0", "00", "00")
    seconds = [3600 * int(h) + 60 * int(m) + int(s) for h, m, s, *_ in clocks]
    assert seconds == sorted(seconds) and seconds[-1] <= wall - setup + 1
    mean = 16 * 8 / sum(8 / a for a, _ in rates)
    done = re.search(r"^done: 16 step\(s\) in \S+ after [0-9.]+ s of set-up, final loss ([0-9.]+); mean ([0-9.]+) "
                     r"samples/s, \d+ tokens/s, (\d+) % of the 123.4 samples/s it was tuned at$", whole.stdout, re.M)
    assert done, whole.stdout[-600:]
    assert float(done.group(1)) == _losses(whole.stdout)[16]
    assert float(done.group(2)) == pytest.approx(mean, rel=0.02)
    assert int(done.group(3)) == round(100 * float(done.group(2)) / 123.4)

    cmd = [sys.executable, "-m", "slapo_tune", "train", "--schedule", str(schedule), "--steps", "16",
           "--save", str(tmp_path / "b"), "--save-every", "4"]
    job = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           start_new_session=True)
    try:
        for line in job.stdout:
            if line.startswith("step 9/"):
                break
        job.send_signal(signal.SIGKILL)
    finally:
        job.kill()
        job.wait(timeout=60)
    assert (tmp_path / "b" / "latest").is_file()
    saved = {int(p.name.split("-")[1]) for p in (tmp_path / "b").glob("step-*")}
    assert saved and saved <= {4, 8}  # every 4 steps, nothing between
    resumed = _cli("train", "--schedule", str(schedule), "--steps", "16", "--resume", str(tmp_path / "b"),
                   "--save", str(tmp_path / "b"))
    assert resumed.returncode == 0, resumed.stderr
    start = int(re.search(r"resumed from .* at step (\d+)", resumed.stdout).group(1))
    assert 4 <= start <= 8
    expected, got = _losses(whole.stdout), _losses(resumed.stdout)
    assert got == {s: expected[s] for s in range(start + 1, 17)}  # the loss curve continues exactly
    for rank in range(2):
        a = torch.load(tmp_path / "a" / "step-000016" / f"rank-{rank:05d}.pt", weights_only=True)
        b = torch.load(tmp_path / "b" / "step-000016" / f"rank-{rank:05d}.pt", weights_only=True)
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        for name in a["optimizer"]:
            for key in a["optimizer"][name]:
                assert torch.equal(a["optimizer"][name][key], b["optimizer"][name][key]), (name, key)


def test_torchrun_runs_the_same_job(tmp_path, no_leftover_children):
    # sequence parallelism and the vocabulary-parallel loss: what the README's loop, which calls the
    # model as Hugging Face code does, must synchronise and gather itself
    schedule = _schedule(tmp_path / "s.json", tp=2, sp="on", loss_parallel="on", micro_batch=4)
    ours = _cli("train", "--schedule", str(schedule), "--steps", "3")
    assert ours.returncode == 0, ours.stderr
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "slapo_tune", "train",
                           "--schedule", str(schedule), "--steps", "3"], env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _losses(done.stdout) == _losses(ours.stdout) and len(_losses(ours.stdout)) == 3
    # the README's own-loop example (a Hugging Face-style loop), on the same schedule: the same losses
    text = (ROOT / "README.md").read_text()
    code = re.search(r"In your own training loop.*?```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "loop.py").write_text(code)
    loop = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(tmp_path / "loop.py"),
                           str(schedule)], env=_env(), capture_output=True, text=True, timeout=300)
    assert loop.returncode == 0, loop.stderr[-2000:]
    own = {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([0-9.]+)", loop.stdout, re.M)}
    assert len(own) == 5 and {s: own[s] for s in (1, 2, 3)} == _losses(ours.stdout)


def test_initial_weights_come_from_a_hugging_face_checkpoint(tmp_path, no_leftover_children):
    torch.manual_seed(123)
    hf = st.build_model("gpt2-tiny", device="cpu")
    hf.save_pretrained(tmp_path / "hf")
    schedule = _schedule(tmp_path / "s.json", tp=2)
    done = _cli("train", "--schedule", str(schedule), "--steps", "1", "--init-from", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    batch = TrainingData("synthetic", hf.config.vocab_size, 8, 32, seed=0).batch(0)
    with torch.no_grad():
        expected = hf(**batch).loss.item()
    assert _losses(done.stdout)[1] == pytest.approx(expected, abs=1e-5)  # not re-initialised
    initialised = st.build(st.create_schedule(st.build_model("gpt2-tiny")), seed=0)  # what no checkpoint gives
    with torch.no_grad():
        assert abs(initialised(**batch).loss.item() - expected) > 1e-3


# ------------------------------------------------------------------ bad input
def _edit(path: Path, **changes) -> Path:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "knobs":
            data["knobs"].update(value)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("truncated", "is not valid JSON"),
    ("version", "unsupported schedule version 3"),
    ("tampered", "tp=3 is not legal"),
    ("model", "was tuned for model 'gpt2-tiny'"),
    ("world", "is for 2 ranks but this job has 4"),
    ("template", "was made with the template os:system, which is Python"),
    ("precision", "precision 'banana' is not one of fp32, amp-bf16, bf16, fp8"),
    ("fp8", "--precision fp8: cpu has no FP8 tensor cores"),
    ("init-missing", "no such folder"),
    ("init-empty", "not a Hugging Face checkpoint folder"),
])
def test_bad_schedule_is_one_line_exit_2(tmp_path, capsys, case, message):
    path = _schedule(tmp_path / "s.json", tp=2)
    args = ["train", "--schedule", str(path)]
    if case == "missing":
        args[2] = str(tmp_path / "nope.json")
    elif case == "truncated":
        path.write_text(path.read_text()[:100])
    elif case == "version":
        _edit(path, version=3)
    elif case == "tampered":
        _edit(path, knobs={"tp": 3})
    elif case == "model":
        args += ["--model", "llama-tiny"]
    elif case == "world":
        args += ["--world-size", "4"]
    elif case == "template":
        _edit(path, template={"name": "os:system", "version": "1"})
    elif case == "precision":
        _edit(path, precision="banana")
    elif case == "fp8":  # a valid schedule file the runtime cannot run (here: no FP8 on a CPU)
        _edit(path, precision="fp8")
        args += ["--device", "cpu"]
    elif case == "init-missing":
        args += ["--init-from", str(tmp_path / "nope")]
    elif case == "init-empty":
        (tmp_path / "empty").mkdir()
        args += ["--init-from", str(tmp_path / "empty")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_model_mismatch_can_be_overridden(tmp_path):
    path = _schedule(tmp_path / "s.json", tp=2)
    loaded = load_schedule(path, model=ModelSpec("gpt2-tiny", {"n_layer": 2}),
                           allow_model_mismatch=True)
    assert loaded.overridden == ["model"] and loaded.plan.tp == 2


_JSON = hs.recursive(hs.none() | hs.booleans() | hs.integers(-2**70, 2**70) | hs.floats(allow_nan=True)
                     | hs.text(max_size=8) | hs.sampled_from(["fp32", "bf16", "gpt2", "1"]),
                     lambda c: hs.lists(c, max_size=3) | hs.dictionaries(hs.text(max_size=6), c, max_size=3),
                     max_leaves=6)
_ANY_OF_TYPE = {"layout": dict, "versions": dict, "measured": dict, "predicted": dict, "study": str,
                "created": str}  # fields nothing depends on: any value of their type
_OPTIONAL = ("versions", "measured", "predicted", "study", "created")


def _same(a, b) -> bool:
    """Equal JSON values of the same types (True is not 1; 1.0 is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _should_load(data, valid: dict) -> bool:
    """What a schedule file must be to be loaded, written out independently of the loader: every
    field the schedule depends on as in the valid file (or legal), the others of the right type."""
    if not isinstance(data, dict):
        return False
    for key, value in valid.items():
        if key not in data:
            if key in _OPTIONAL:
                continue
            return False
        got = data[key]
        if key in _ANY_OF_TYPE:
            ok = isinstance(got, _ANY_OF_TYPE[key])
        elif key == "precision":
            ok = got in ("fp32", "amp-bf16", "bf16")
        elif key == "device":  # where the ranks run
            ok = got in ("cpu", "cuda")
        elif key == "seq_len":  # any length the model has positions for
            ok = type(got) is int and 1 <= got <= 256
        elif key == "knobs":  # the same point; an integral float knob may be written as an int
            ok = isinstance(got, dict) and got.keys() == value.keys() and all(
                _same(got[k], v) or (type(v) is float and type(got[k]) is int and got[k] == v)
                for k, v in value.items())
        elif key == "template":  # extra fields are ignored, but for a template file's, which name no file here
            ok = (isinstance(got, dict) and all(_same(got.get(k), v) for k, v in value.items())
                  and "file" not in got and "sha256" not in got)
        elif key == "model":
            ok = (isinstance(got, dict) and _same(got.get("name"), value["name"])
                  and _same(got.get("overrides", {}), value["overrides"])
                  and ("fingerprint" not in got or _same(got["fingerprint"], value["fingerprint"])))
        else:
            ok = _same(got, value)
        if not ok:
            return False
    return True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=hs.lists(hs.tuples(hs.sampled_from(["drop", "set", "knob", "model", "template"]), hs.text(max_size=12),
                                _JSON), max_size=4),
       cut=hs.one_of(hs.none(), hs.integers(0, 2000)))
@example(edits=[("set", "00", "")], cut=None)  # a device that is none of cpu, cuda (found by a full run)
def test_malformed_schedule_files_are_refused_by_train_and_valid_ones_run(tmp_path, monkeypatch, capsys, edits, cut):
    """``slapo-tune train`` on an edited schedule file exits 2 with one line exactly when the file is
    not one it should run (by :func:`_should_load`), and starts the ranks (here: a stand-in) otherwise."""
    import slapo_tune.cli.train as train_command

    started = []
    monkeypatch.setattr(train_command, "launch", lambda fn, world, **kw: started.append(world) or [[5.0]])
    knobs = {"tp": 2, "pp": 1, "dp": 1, "zero": 0, "micro_batch": 2, "ckpt_ratio": 0.0, "pipeline_schedule": "1f1b",
             "attn": "sdpa", "fuse": "off"}
    valid = make_schedule(template={"name": "gpt2", "version": "1"}, plan=Plan.of(knobs, Workload(2, 8, 32)),
                          world_size=2, global_batch=8, seq_len=32, precision="fp32", device="cpu",
                          model={"name": "gpt2-tiny", "overrides": {},
                                 "fingerprint": config_fingerprint(load_config("gpt2-tiny"))})
    data = json.loads(json.dumps(valid))
    keys = sorted(data)
    for kind, key, value in edits:
        if kind == "drop":
            data.pop(keys[len(key) % len(keys)], None)
        elif kind == "set":
            data[keys[len(key) % len(keys)]] = value
        elif isinstance(data.get(kind if kind != "knob" else "knobs"), dict):
            target = data[kind if kind != "knob" else "knobs"]
            target[key or "tp"] = value
    text = json.dumps(data)
    whole = cut is None or cut >= len(text)
    path = tmp_path / "fuzz.json"
    path.write_text(text if whole else text[:cut])
    code = main(["train", "--schedule", str(path), "--steps", "1"])
    err = capsys.readouterr().err
    if whole and _should_load(data, valid):
        assert code == 0 and started == [2], (err, data)
    else:
        assert code == 2 and not started, data
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_training_data_from_text_and_token_files(tmp_path):
    import numpy as np

    (tmp_path / "a.txt").write_text("hello slapo-tune " * 20)
    text = TrainingData(str(tmp_path / "a.txt"), 512, 4, 16, seed=3)
    batch = text.batch(7)
    assert batch["input_ids"].shape == (4, 16) and int(batch["input_ids"].max()) < 256
    assert torch.equal(batch["input_ids"], TrainingData(str(tmp_path / "a.txt"), 512, 4, 16, seed=3).batch(7)["input_ids"])
    assert not torch.equal(batch["input_ids"], text.batch(8)["input_ids"])
    np.save(tmp_path / "t.npy", np.arange(100) % 50)
    tokens = TrainingData(str(tmp_path / "t.npy"), 64, 2, 8).batch(0)["input_ids"]
    assert torch.all((tokens[:, 1:] - tokens[:, :-1]) % 50 == 1)  # contiguous windows of the file
    for bad, message in [("nope.txt", "does not exist"), ("t.npy", "outside the vocabulary")]:
        with pytest.raises(st.UsageError, match=message):
            TrainingData(str(tmp_path / bad), 32, 2, 8)
    with pytest.raises(st.UsageError, match="at least 256"):
        TrainingData(str(tmp_path / "a.txt"), 128, 2, 8)
