"""The GPU check: numerics, memory-model accuracy per precision, and the command line end to end
with its defaults, on one CUDA device.

Needs torch and transformers, and Optuna for the tuning run: ``bash benchmarks/gpu_check.sh``
installs Optuna from wheels carried in ``.whl/`` when it is missing (``python -m
benchmarks.gpu_wheels`` puts them there; nothing is downloaded on the GPU machine, no Ray, no
network). Run from the repository root; sized for under 8 minutes on one GPU. Three parts, run in
the order 1, 3, 2, 4 (the command line first), and one JSON summary, rewritten after each part so
that a run stopped by its time limit keeps what it did:

1. every template's tiny preset, scheduled (checkpointing, fusion, SDPA), against the unscheduled
   model at world 1: loss, outputs and gradients (``verify``);
2. predicted vs measured peak memory (``torch.cuda.max_memory_allocated``; on CPU ``MemTracker``)
   of real steps of a GPT-2 (124M) at world 1 in each precision (fp32, amp-bf16, bf16): exact mode
   (fake step) and the analytic model;
3. ``slapo-tune tune --ray-address none`` with its defaults (device cuda, precision bf16 there, the
   hardware detected from the GPU, the budget its memory less the reserve) on a ~350M GPT-2
   (gpt2-medium) for a few trials, then ``slapo-tune train`` on the exported ``best_schedule.json``
   for a few steps; the tuned throughput and its MFU;
4. ``--precision fp8`` (the plan only): the linear layers of a Llama-3-8B block in bf16 and in
   FP8 through torchao's float8 training (carried as a wheel), forward and backward side by side,
   the measured speed-up beside the time model's (on a GPU with FP8 tensor cores; the reason it
   was skipped otherwise).

``--device cpu --smoke`` runs the same path on CPU with gpt2-tiny, one memory point and one trial
(under a minute on 2 idle cores; a test runs it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

GiB = 2**30
PRECISIONS = ("fp32", "amp-bf16", "bf16")
# the memory comparison's points (GPT-2 124M at world 1, global batch 16, seq 512); --smoke takes the first
MEMORY_POINTS = ({"micro_batch": 4, "ckpt_ratio": 0.0, "attn": "sdpa"}, {"micro_batch": 8, "ckpt_ratio": 0.5, "attn": "sdpa"},
                 {"micro_batch": 2, "ckpt_ratio": 1.0, "attn": "eager"}, {"micro_batch": 16, "ckpt_ratio": 1.0, "attn": "sdpa"})


def check_numerics(device: str, presets=("gpt2-tiny", "llama-tiny", "bert-tiny", "opt-tiny")) -> list[dict]:
    import slapo_tune as st
    from slapo_tune.problem import ProblemSpec

    out = []
    for preset in presets:
        problem = ProblemSpec(preset, 1).resolve()
        config, template = problem.config, problem.template
        point = {"tp": 1, "pp": 1, "ckpt_ratio": 0.5, "attn": "sdpa" if preset != "bert-tiny" else "eager",
                 "fuse": "on" if template.has_fusion else "off"}
        reference = st.build_model(preset)  # meta: verify gives it the scheduled model's initial weights
        model = st.build(template.schedule(st.build_model(preset), point), device=device, seed=0)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, config.vocab_size, (4, 64), generator=g).to(device)
        report = st.verify(model, reference, {"input_ids": ids, "labels": ids}, raise_on_failure=False)
        out.append({"preset": preset, "point": point, "ok": str(report).startswith("verify: OK"),
                    "report": str(report).splitlines()[0]})
        print(f"numerics {preset}: {out[-1]['report']}", flush=True)
    return out


def _problem(model: str, global_batch: int, seq: int, precision: str, device: str):
    """One model at world 1 on ``device`` in ``precision`` (resolved)."""
    from slapo_tune.problem import ProblemSpec

    return ProblemSpec(model, 1, global_batch=global_batch, seq_len=seq, precision=precision, device=device).resolve()


def memory_rank(ctx, cases: list) -> list[dict]:
    """Rank function: the measured peak of one real step of each (problem spec, point), one after
    the other in this process (a trial each would start a process per point)."""
    from slapo_tune.cost_model.measure import measure_point_rank

    out = []
    for spec, point in cases:
        measured = measure_point_rank(ctx, spec, point, timed_steps=0, warmup_steps=1, tracked_steps=1)
        out.append({"total": measured["total"], "reserved": measured.get("reserved", 0)})
        gc.collect()  # the last point's model and optimizer state, before the next is measured
        if torch.device(ctx.device).type == "cuda":
            torch.cuda.empty_cache()
    return out


def check_memory(setup, hw, model: str, global_batch: int, seq: int, points) -> list[dict]:
    """Predicted (exact mode, analytic) vs measured peak per precision at world 1."""
    from slapo_tune.cost_model import CostModel
    from slapo_tune.launch import launch

    cases, predicted = [], []
    for precision in PRECISIONS:
        problem = _problem(model, global_batch, seq, precision, setup.kind)
        cost = CostModel(problem, hw)
        for knobs in points:
            point = problem.space.complete({"tp": 1, "pp": 1, **knobs})
            cases.append((problem.spec, point))
            predicted.append((precision, knobs, max(b.total for b in cost.exact(point).values()),
                              cost.memory(point).peak))
    measured = launch(memory_rank, 1, args=(cases,), timeout=400, backend=setup.backend)[0]
    rows = []
    for (precision, knobs, exact, analytic), m in zip(predicted, measured):
        row = {"precision": precision, "point": knobs, "measured": m["total"], "reserved": m["reserved"],
               "exact": exact, "analytic": analytic,
               "exact_error": exact / m["total"] - 1, "analytic_error": analytic / m["total"] - 1}
        rows.append(row)
        print(f"memory {precision} {knobs}: measured {m['total'] / GiB:.3f} GiB (reserved {m['reserved'] / GiB:.3f}), "
              f"exact {exact / GiB:.3f} ({row['exact_error']:+.1%}), analytic {analytic / GiB:.3f} "
              f"({row['analytic_error']:+.1%})", flush=True)
    return rows


# the linear layers of a Llama-3-8B block, over 8 sequences of 1,024 tokens: (tokens, in, out)
FP8_LINEARS = ((8192, 4096, 6144), (8192, 4096, 4096), (8192, 4096, 28672), (8192, 14336, 4096))


def fp8_skip_reason(setup) -> str | None:
    """Why the FP8 part cannot run on ``setup`` (None: it can): FP8 tensor cores (compute
    capability 8.9: Ada, 9.0: Hopper) and torchao's float8 training, carried as a wheel."""
    if not setup.cuda:
        return "needs a CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} has no FP8 tensor cores (8.9 and up: Ada, Hopper)"
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        return f"torchao's float8 training cannot be imported ({exc}): carry its wheel (python -m benchmarks.gpu_wheels)"
    return None


def _fwd_bwd_ms(layer, x, repeats: int = 10) -> float:
    """Median milliseconds of a forward and backward of ``layer`` on ``x`` (CUDA events)."""
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x).sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_fp8(setup, hw) -> dict:
    """``--precision fp8`` as the plan models it (FP8 matrix products of the linear layers at the
    preset's ``fp8_flops``, bf16 elsewhere) against torchao's float8 training (tensorwise scaling,
    what the plan names): each linear layer of a Llama-3-8B block, forward and backward, bf16 and
    FP8 side by side, the measured speed-up beside the time model's for the same products."""
    reason = fp8_skip_reason(setup)
    if reason is not None:
        print(f"fp8: skipped: {reason}", flush=True)
        return {"skipped": reason}
    from torchao.float8 import convert_to_float8_training

    from slapo_tune.cost_model.analytic import gemm_seconds

    rows = []
    for tokens, k, n in FP8_LINEARS:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        timed = {}
        for mode in ("bf16", "fp8"):
            layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to("cuda", torch.bfloat16)
            if mode == "fp8":
                convert_to_float8_training(layer)
            timed[mode] = _fwd_bwd_ms(layer, x)
        # forward and backward: three products of the layer's shape (output, input and weight gradients)
        predicted = {fp8: sum(gemm_seconds(hw, *dims, 2, fp8=fp8) for dims in ((tokens, k, n), (tokens, n, k),
                                                                                (k, tokens, n)))
                     for fp8 in (False, True)}
        rows.append({"shape": [tokens, k, n], "bf16_ms": timed["bf16"], "fp8_ms": timed["fp8"],
                     "measured_speedup": timed["bf16"] / timed["fp8"],
                     "predicted_speedup": predicted[False] / predicted[True]})
        print(f"fp8 linear {tokens}x{k}->{n}: bf16 {timed['bf16']:.2f} ms, fp8 {timed['fp8']:.2f} ms "
              f"(x{rows[-1]['measured_speedup']:.2f}; plan x{rows[-1]['predicted_speedup']:.2f})", flush=True)
    return {"rows": rows, "measured_speedup_median": statistics.median(r["measured_speedup"] for r in rows),
            "predicted_speedup_median": statistics.median(r["predicted_speedup"] for r in rows)}


def _cli(argv: list[str], timeout: float) -> tuple[int, str, str, float]:
    """``slapo-tune ARGV`` as a user runs it: (exit code, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "slapo_tune.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def cli_end_to_end(work: Path, model: str, trials: int, steps: int, device_args: list[str],
                   tune_args: list[str]) -> dict:
    """``slapo-tune tune --ray-address none`` with its defaults (but ``device_args`` and
    ``tune_args``), then ``slapo-tune train`` (with ``device_args``) on the schedule it exported."""
    from slapo_tune.apply import load_schedule
    from slapo_tune.cost_model import CostModel, hardware_for
    from slapo_tune.device import device_setup

    out = work / "tune"
    tune_argv = ["tune", "--ray-address", "none", "--model", model, "--world-size", "1", "--trials", str(trials),
                 "--out", str(out), *device_args, *tune_args]
    code, stdout, stderr, seconds = _cli(tune_argv, timeout=300)
    banner = next((line for line in stderr.splitlines() if line.startswith("slapo-tune: ")), "")
    tune = {"argv": tune_argv, "returncode": code, "seconds": seconds, "banner": banner, "stdout": _tail(stdout),
            "stderr": _tail(stderr) if code else ""}
    print(f"tune: exit {code} in {seconds:.0f} s; {banner}", flush=True)
    schedule = out / "best_schedule.json"
    result = {"tune": tune, "schedule": None, "train": None}
    if not schedule.is_file():
        return result
    data = json.loads(schedule.read_text())
    loaded = load_schedule(schedule)
    steps_s = (data.get("measured") or {}).get("step_times") or []
    step = statistics.median(steps_s) if steps_s else None
    hw = hardware_for(device_setup(data["device"], here=False))[0]
    mfu = CostModel(loaded.problem, hw).mfu(step, loaded.world_size) if step else None
    result["schedule"] = {"path": str(schedule), "knobs": data["knobs"], "device": data["device"],
                          "precision": data.get("precision"), "measured": data.get("measured"), "mfu": mfu,
                          "hardware": hw.name}
    print(f"tuned {data['knobs']}: {(data.get('measured') or {}).get('samples_per_s') or 0:.1f} samples/s"
          + (f", MFU {mfu:.1%} of {hw.name}" if mfu else ""), flush=True)
    train_argv = ["train", "--schedule", str(schedule), "--steps", str(steps), *device_args]
    code, stdout, stderr, seconds = _cli(train_argv, timeout=240)
    losses = [float(line.split(" loss ")[1].split()[0]) for line in stdout.splitlines() if line.startswith("step ")]
    result["train"] = {"argv": train_argv, "returncode": code, "seconds": seconds, "steps": len(losses),
                       "losses": losses, "stdout": _tail(stdout), "stderr": _tail(stderr) if code else ""}
    print(f"train: exit {code} in {seconds:.0f} s, {len(losses)} step(s), losses {losses}", flush=True)
    return result


def _write(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (the GPU check) or cpu (with --smoke: the same path, for the tests)")
    parser.add_argument("--smoke", action="store_true", help="gpt2-tiny, one memory point, 1 trial: about a minute")
    parser.add_argument("--tune-trials", type=int, default=None, help="trials of the tuning run (default: 4; smoke 1)")
    parser.add_argument("--train-steps", type=int, default=None, help="steps of the training run (default: 5; smoke 2)")
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)
    from slapo_tune.cost_model import hardware_for
    from slapo_tune.device import device_setup
    from slapo_tune.errors import UsageError

    try:
        setup = device_setup(args.device)
    except UsageError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    hw, hardware_line = hardware_for(setup)
    print(f"device: {setup.name} ({setup.kind}), {hardware_line}, torch {torch.__version__}", flush=True)
    started = time.monotonic()
    result = {"device": setup.name, "kind": setup.kind, "hardware": hw.name, "torch": torch.__version__,
              "smoke": args.smoke}
    # on a GPU the command line runs with its own defaults (device, precision, hardware, budget all
    # detected); elsewhere the device is said, as the default could be another one
    device_args = [] if setup.cuda and not args.smoke else ["--device", setup.kind]
    if args.smoke:  # the same path on a tiny model
        numerics = partial(check_numerics, setup.kind, ("gpt2-tiny",))
        memory = partial(check_memory, setup, hw, "gpt2-tiny", 8, 32, MEMORY_POINTS[:1])
        # no confirmation rounds (tests/unit/test_confirm.py covers them): the suite's time
        model, tune_args = "gpt2-tiny", ["--global-batch", "4", "--seq-len", "32", "--measured-steps", "1",
                                         "--confirm", "0"]
        trials, steps = args.tune_trials or 1, args.train_steps or 2
    else:
        numerics = partial(check_numerics, setup.kind)
        memory = partial(check_memory, setup, hw, "gpt2", 16, 512, MEMORY_POINTS)
        # the best point confirmed on the GPU (3 rounds), not up to 3 candidates: the device's minutes are few
        model, tune_args = "gpt2-medium", ["--confirm", "1"]
        trials, steps = args.tune_trials or 4, args.train_steps or 5
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        cli = partial(cli_end_to_end, Path(work), model, trials, steps, device_args, tune_args)
        fp8 = partial(check_fp8, setup, hw)
        for name, fn in (("numerics", numerics), ("cli", cli), ("memory", memory), ("fp8", fp8)):
            t0 = time.monotonic()
            try:
                result[name] = fn()
            except Exception as exc:  # noqa: BLE001 - report every part, even after a failure
                result[name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            result[f"{name}_seconds"] = time.monotonic() - t0
            result["seconds"] = time.monotonic() - started
            _write(args.out, result)  # after every part: a run stopped by the time limit keeps what it did
    print(f"gpu_check: done in {result['seconds']:.0f} s, wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
