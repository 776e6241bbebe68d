"""The GPU check: numerics, memory-model accuracy and a small tuning run on one CUDA device.

Needs only torch and transformers (no Ray, no Optuna, no network); run from the repository root
with ``bash benchmarks/gpu_check.sh`` (sized for under 8 minutes on one GPU). Three parts:

1. every template's tiny preset, scheduled (checkpointing, fusion, SDPA), against the unscheduled
   model on CUDA at world 1: loss, outputs and gradients (``verify``);
2. predicted vs measured peak memory (``torch.cuda.max_memory_allocated``) of real steps of a
   GPT-2 (124M) in bf16: exact mode (fake step) and the analytic model;
3. micro-batch x checkpointing x attention kernel for a ~350M GPT-2 (gpt2-medium) in bf16 under a
   real memory budget: points ranked by the cost model, the best few trained for real; the tuned
   throughput and MFU next to the untuned default (micro-batch 1, full checkpointing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slapo_tune.problem import Problem

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

GiB = 2**30
DEVICE = "cuda"


def check_numerics() -> list[dict]:
    import slapo_tune as st
    from slapo_tune.problem import ProblemSpec

    out = []
    for preset in ("gpt2-tiny", "llama-tiny", "bert-tiny", "opt-tiny"):
        problem = ProblemSpec(preset, 1).resolve()
        config, template = problem.config, problem.template
        point = {"tp": 1, "pp": 1, "ckpt_ratio": 0.5, "attn": "sdpa" if preset != "bert-tiny" else "eager",
                 "fuse": "on" if template.has_fusion else "off"}
        reference = st.build_model(preset)  # meta: verify gives it the scheduled model's initial weights
        model = st.build(template.schedule(st.build_model(preset), point), device=DEVICE, seed=0)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, config.vocab_size, (4, 64), generator=g).to(DEVICE)
        report = st.verify(model, reference, {"input_ids": ids, "labels": ids}, raise_on_failure=False)
        out.append({"preset": preset, "point": point, "ok": str(report).startswith("verify: OK"),
                    "report": str(report).splitlines()[0]})
        print(f"numerics {preset}: {out[-1]['report']}", flush=True)
    return out


def _problem(model: str, global_batch: int, seq: int, budget: int) -> Problem:
    """One model on this CUDA device at world 1 in bf16 under ``budget`` bytes (resolved)."""
    from slapo_tune.problem import ProblemSpec

    return ProblemSpec(model, 1, global_batch=global_batch, seq_len=seq, precision="bf16", device=DEVICE,
                       memory_budget=budget).resolve()


def _trial(problem: Problem, knobs: dict, steps: int = 3):
    from runners import run_trial
    from runners.trial import TrialSpec

    spec = TrialSpec(problem.spec, knobs, warmup_steps=1, measured_steps=steps, time_limit=240, name="gpu-check")
    return run_trial(spec)


def check_memory(budget: int) -> list[dict]:
    from slapo_tune.cost_model import CostModel, hardware

    problem = _problem("gpt2", 16, 512, budget)
    space = problem.space
    cost = CostModel(problem, hardware("h200"))
    rows = []
    for knobs in ({"micro_batch": 4, "ckpt_ratio": 0.0, "attn": "sdpa"}, {"micro_batch": 8, "ckpt_ratio": 0.5, "attn": "sdpa"},
                  {"micro_batch": 2, "ckpt_ratio": 1.0, "attn": "eager"}, {"micro_batch": 16, "ckpt_ratio": 1.0, "attn": "sdpa"}):
        point = space.complete({"tp": 1, "pp": 1, **knobs})
        result = _trial(problem, point)
        measured = max(result.peak_memory) if result.peak_memory else None
        exact = max(b.total for b in cost.exact(point).values())
        analytic = cost.memory(point).peak
        row = {"point": point, "status": result.status, "measured": measured, "exact": exact, "analytic": analytic}
        if measured:
            row["exact_error"], row["analytic_error"] = exact / measured - 1, analytic / measured - 1
        rows.append(row)
        print(f"memory {knobs}: measured {measured and measured / GiB:.2f} GiB, exact {exact / GiB:.2f}, "
              f"analytic {analytic / GiB:.2f} ({result.status})", flush=True)
    return rows


def tune_350m(budget: int, tries: int) -> dict:
    from slapo_tune.cost_model import CostModel, hardware

    problem = _problem("gpt2-medium", 32, 1024, budget)
    space, workload = problem.space, problem.workload
    cost = CostModel(problem, hardware("h200", memory=budget))
    candidates = [p for p in space.enumerate({"tp": 1, "pp": 1}) if cost.verdict(p, budget).fits]
    ranked = sorted(candidates, key=lambda p: -cost.time(p).throughput(workload))
    default = space.complete({"tp": 1, "pp": 1, "micro_batch": 1, "ckpt_ratio": 1.0})
    tried = []
    for point in [default, *[p for p in ranked if p != default][:tries]]:
        result = _trial(problem, point)
        step = min(result.step_times) if result.step_times else None
        mfu = cost.mfu(step, 1) if step else None
        tried.append({"point": point, "status": result.status, "samples_per_s": result.samples_per_s,
                      "mfu": mfu, "peak": max(result.peak_memory) if result.peak_memory else None})
        print(f"tune {point}: {result.status} {result.samples_per_s or 0:.1f} samples/s"
              + (f", MFU {mfu:.1%}" if mfu else ""), flush=True)
    ok = [t for t in tried[1:] if t["status"] == "ok"]
    best = max(ok, key=lambda t: t["samples_per_s"]) if ok else None
    base = tried[0]
    return {"default": base, "best": best, "tried": tried, "candidates": len(candidates),
            "speedup": best["samples_per_s"] / base["samples_per_s"] if best and base["samples_per_s"] else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=40.0, help="memory budget of the tuning run")
    parser.add_argument("--tries", type=int, default=6, help="cost-model-ranked points trained in part 3")
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    started = time.monotonic()
    budget = int(args.budget_gib * GiB)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, fn in (("numerics", check_numerics), ("memory", lambda: check_memory(budget)),
                     ("tune", lambda: tune_350m(budget, args.tries))):
        t0 = time.monotonic()
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001 - report every part, even after a failure
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
        result[f"{name}_seconds"] = time.monotonic() - t0
    result["seconds"] = time.monotonic() - started
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    tune = result.get("tune", {})
    if isinstance(tune, dict) and tune.get("best"):
        print(f"tuned {tune['best']['point']}: {tune['best']['samples_per_s']:.1f} samples/s, MFU "
              f"{(tune['best']['mfu'] or 0):.1%}; default {tune['default']['samples_per_s'] or 0:.1f} samples/s; "
              f"speedup {tune['speedup'] or 0:.2f}x")
    print(f"gpu_check: done in {result['seconds']:.0f} s, wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
