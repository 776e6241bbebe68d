"""Tuned vs out of the box: how much faster the tuned schedule trains than what users run without
a tuner, on the CPU reference workloads, measured side by side in one run.

Per workload: ``slapo-tune``'s tuner (cost-model ranking, exact pruning, real trials on local
ranks) picks a schedule; it is then measured in one launch next to two baselines (and, where the
workload's exhaustive search was recorded, its fastest points), alternating them step by step:

- *out of the box*: full activation checkpointing, micro-batch 1, pure data parallelism (Slapo's
  baselines: what DeepSpeed/Megatron users start from);
- *default made to fit*: the same with the largest micro-batch whose predicted peak fits the budget.

Run: ``python -m benchmarks.headline [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slapo_tune.problem import ProblemSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks._stats import isolated_cache, median_iqr, round_orders, save_json  # noqa: E402
from search_spaces.gpt2 import GPT2Template  # noqa: E402

MiB = 2**20
GPT2_REF = ("gpt2", {"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 8192})
LLAMA_REF = ("llama-tiny", {"num_hidden_layers": 6, "hidden_size": 384, "num_attention_heads": 6,
                            "num_key_value_heads": 2, "intermediate_size": 1024, "vocab_size": 8192})
WORKLOADS = {  # label: (model, world size)
    "gpt2-ref w1": (GPT2_REF, 1),
    "gpt2-ref w2": (GPT2_REF, 2),
    "llama-ref w4": (LLAMA_REF, 4),
}
GLOBAL_BATCH, SEQ, BUDGET = 16, 128, 400 * MiB
# the exhaustive search, recorded once (``python -m benchmarks.record_grid --reference``)
EXHAUSTIVE = {"gpt2-ref w1": Path(__file__).with_name("data") / "gpt2_ref_w1.csv"}
# values the GPT-2 workloads hold of knobs that gained a value after that grid was recorded: the
# fused loss at tp=1 (loss_parallel=on), which would double a world-1 space the grid measured
RECORDED_PINS = {"loss_parallel": "off"}
RECORDED_TEMPLATE = "benchmarks.headline:RecordedGPT2"


class RecordedGPT2(GPT2Template):
    """The GPT-2 template with :data:`RECORDED_PINS` held: the space the reference grid measured."""

    def space(self, info, workload):
        return super().space(info, workload).pinned(RECORDED_PINS)
CONTENDERS = 3  # the recorded grid's fastest points, timed again beside the tuned one


def baselines(space, cost, budget: int) -> dict[str, dict]:
    """The out-of-the-box point and the default made to fit (largest micro-batch that fits)."""
    from slapo_tune.plan import OUT_OF_THE_BOX

    out_of_box = space.complete(OUT_OF_THE_BOX)
    same = ("tp", "pp", "dp", "zero", "ckpt_ratio", "pipeline_schedule", "attn", "fuse")
    fitting = [p for p in space.enumerate() if all(p[k] == out_of_box[k] for k in same)
               and cost.verdict(p, budget, exact=True).fits]
    made_to_fit = max(fitting, key=lambda p: p["micro_batch"]) if fitting else out_of_box
    return {"out of the box": out_of_box, "default made to fit": made_to_fit}


def exhaustive_best(label: str, space, count: int = CONTENDERS) -> list[dict]:
    """The fastest points of the recorded exhaustive search of a workload (none if not recorded).
    Recorded times come from another run: the contenders are timed again beside the tuned point."""
    import csv

    path = EXHAUSTIVE.get(label)
    if path is None or not path.exists():
        return []
    by_key = {tuple(str(p[k]) for k in space.names): p for p in space.enumerate()}
    with open(path) as f:  # points over the budget were measured for memory only (no step time)
        rows = sorted((r for r in csv.DictReader(f) if r["step_s"]), key=lambda r: float(r["step_s"]))
    return [by_key[key] for key in (recorded_key(r, space.names) for r in rows[:count]) if key in by_key]


def recorded_key(row: dict, names: list[str]) -> tuple[str, ...]:
    """A recorded row's knob values in ``names`` order; a knob added after the recording takes the
    value that was all there was then (:data:`slapo_tune.plan.KNOB_DEFAULTS`)."""
    from slapo_tune.plan import KNOB_DEFAULTS

    return tuple(row[k] if k in row else str(KNOB_DEFAULTS[k]) for k in names)


def versus_optimum(times: dict[str, list[float]], points: dict[str, dict], grid: str) -> dict:
    """Tuned / exhaustive optimum, free of the winner's curse: the optimum is chosen among the
    tuned point and the grid's best on the first half of the rounds, and the ratio is measured on
    the second half. (Choosing and measuring on the same rounds would favour whichever of several
    equally fast points drew the luckiest timings.)"""
    from slapo_tune.space import format_point

    half = len(times["tuned"]) // 2
    names = ["tuned", *(k for k in times if k.startswith("exhaustive"))]
    best = min(names, key=lambda k: statistics.median(times[k][:half]))
    held_out = {k: v[half:] for k, v in times.items()}
    per_round = [b / t for t, b in zip(held_out["tuned"], held_out[best])]
    naive = min(names, key=lambda k: statistics.median(times[k]))
    med, lo, hi = median_iqr(per_round)
    return {"optimum": best, "point": format_point(points[best]), "grid": grid, "rounds": len(held_out["tuned"]),
            "ratio": statistics.median(held_out[best]) / statistics.median(held_out["tuned"]),
            "per_round_median": med, "per_round_p25": lo, "per_round_p75": hi,
            # the same figure chosen and measured on all rounds, for comparison
            "all_rounds_optimum": naive,
            "all_rounds_ratio": statistics.median(times[naive]) / statistics.median(times["tuned"])}


def problem_spec(model: tuple, world: int, memory_budget: int | None = None) -> ProblemSpec:
    """A workload's problem: ``model`` on ``world`` ranks, the headline's global batch and sequence
    length."""
    from slapo_tune.problem import ProblemSpec

    return ProblemSpec(model[0], world, dict(model[1]), global_batch=GLOBAL_BATCH, seq_len=SEQ,
                       memory_budget=memory_budget, template=RECORDED_TEMPLATE if model is GPT2_REF else None)


def tune(model: tuple, world: int, trials: int, out: Path) -> dict:
    from runners import LocalRunner
    from slapo_tune.search import TuneConfig, Tuner

    # (no baseline trial: this benchmark times the baselines itself, beside the tuned point)
    config = TuneConfig(problem=problem_spec(model, world, BUDGET), out=out, trials=trials, strategy="model",
                        prune="exact", seed=0, baseline=False)
    runner = LocalRunner()
    try:
        tuner = Tuner(config, runner)
        started = time.monotonic()
        summary = tuner.run()
        summary["wall_seconds"] = time.monotonic() - started
    finally:
        runner.close()
    return {"summary": summary, "tuner": tuner}


def side_by_side_rank(ctx, spec: ProblemSpec, points: dict, rounds: int, warmup: int) -> dict:
    """All points realised on these ranks; one optimizer step of each per round, in a shuffled order."""
    import torch.distributed as dist

    from slapo_tune.session import Session

    problem = spec.resolve()
    sessions = {name: Session(problem, problem.plan(point), seed=0) for name, point in points.items()}
    batch = sessions[next(iter(sessions))].synthetic_batch()
    times = {name: [] for name in points}
    for i, order in enumerate(round_orders(list(sessions), warmup + rounds)):  # the same orders on every rank
        for name in order:
            session = sessions[name]
            dist.barrier()
            t0 = time.perf_counter()
            float(session.train_step(batch))  # reading the loss waits for the step
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def measure(model: tuple, world: int, points: dict, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    from slapo_tune.launch import launch

    return launch(side_by_side_rank, world, args=(problem_spec(model, world), points, rounds, warmup),
                  timeout=3600)[0]


def run(labels: list[str], trials: int, rounds: int, progress=print) -> dict:
    """Tune and measure each workload; a workload with a recorded exhaustive search gets twice the
    rounds (half choose its optimum, half measure the ratio to it)."""
    from slapo_tune.space import format_point

    results = {}
    for label in labels:
        model, world = WORKLOADS[label]
        progress(f"headline {label}: tuning ({trials} trials)")
        with tempfile.TemporaryDirectory() as tmp:
            tuned = tune(model, world, trials, Path(tmp) / label.replace(" ", "-"))
        tuner, summary = tuned["tuner"], tuned["summary"]
        if summary["best_point"] is None:
            results[label] = {"error": "no trial succeeded"}
            continue
        points = {"tuned": summary["best_point"], **baselines(tuner.space, tuner.cost, BUDGET)}
        contenders = [p for p in exhaustive_best(label, tuner.space) if p != summary["best_point"]]
        points.update({f"exhaustive #{i + 1}": p for i, p in enumerate(contenders)})
        n = 2 * rounds if contenders else rounds
        progress(f"headline {label}: measuring tuned vs baselines side by side ({n} rounds)")
        times = measure(model, world, points, n)
        entry = {"points": {k: format_point(p) for k, p in points.items()}, "trials": summary["launched"],
                 "pruned": summary["pruned"], "tuning_seconds": summary["wall_seconds"], "comparisons": {}}
        for name, values in times.items():
            med, lo, hi = median_iqr(values)
            entry[name] = {"step_median": med, "step_p25": lo, "step_p75": hi,
                           "samples_per_s": GLOBAL_BATCH / med}
        for baseline in ("out of the box", "default made to fit"):
            per_round = [b / t for t, b in zip(times["tuned"], times[baseline])]
            med, lo, hi = median_iqr(per_round)
            entry["comparisons"][baseline] = {
                "speedup": statistics.median(times[baseline]) / statistics.median(times["tuned"]),
                "per_round_median": med, "per_round_p25": lo, "per_round_p75": hi}
        if contenders:
            entry["vs_optimum"] = versus_optimum(times, points, str(EXHAUSTIVE[label].name))
        results[label] = entry
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the GPT-2 world-1 workload only, fewer trials and rounds")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    isolated_cache()  # no calibration or measurement from a user's cache
    labels = ["gpt2-ref w1"] if args.quick else list(WORKLOADS)
    trials = args.trials or (4 if args.quick else 6)
    rounds = args.rounds or (2 if args.quick else 5)
    results = run(labels, trials, rounds)
    save_json("headline", results)
    for label, entry in results.items():
        if "error" in entry:
            print(f"{label}: {entry['error']}")
            continue
        print(f"{label}: tuned {entry['points']['tuned']} ({entry['tuned']['samples_per_s']:.1f} samples/s, "
              f"{entry['trials']} trials)")
        for baseline, c in entry["comparisons"].items():
            print(f"  vs {baseline} ({entry['points'][baseline]}): {c['speedup']:.2f}x "
                  f"(per round median {c['per_round_median']:.2f}, p25 {c['per_round_p25']:.2f}, "
                  f"p75 {c['per_round_p75']:.2f})")
        if "vs_optimum" in entry:
            o = entry["vs_optimum"]
            print(f"  tuned / exhaustive optimum ({o['optimum']}: {o['point']}): {o['ratio']:.3f} "
                  f"(per round median {o['per_round_median']:.3f}, {o['rounds']} held-out rounds; chosen and "
                  f"measured on all rounds: {o['all_rounds_ratio']:.3f})")
    return results


if __name__ == "__main__":
    main()
