"""Cost-model accuracy on the CPU reference grid.

For GPT-2- and Llama-style models sized so that activations dominate, at world sizes 1, 2 and 4,
a seeded sample of legal points (tp, pp, zero, checkpointing, micro-batch, attention, fusion) is
run for real: peak tensor memory per rank (the same tensor-level tracker on real tensors) and step
time. Compared with the exact mode (fake step per stage) and the analytic mode (calibrated on a
*separate* sample of exact points, and uncalibrated), and the time model's ranking (Spearman),
its weights fitted to the calibration points' measured steps.

Writes ``results/benchmarks/cost_model_points.csv``, ``cost_model_memory.png`` and a JSON summary.
Run: ``python -m benchmarks.cost_model_accuracy [--points-per-world 10] [--quick]``.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slapo_tune.problem import Problem

from benchmarks._stats import isolated_cache, results_dir, save_json, spearman  # noqa: E402

MODELS = {
    "gpt2-ref": ("gpt2", {"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 8192}),
    "llama-ref": ("llama-tiny", {"num_hidden_layers": 6, "hidden_size": 384, "num_attention_heads": 6,
                                 "num_key_value_heads": 2, "intermediate_size": 1024, "vocab_size": 8192}),
}
GLOBAL_BATCH, SEQ = 16, 128


def _sample(space, n, seed, exclude=()):
    points = [p for p in space.enumerate() if p not in exclude]
    return random.Random(seed).sample(points, min(n, len(points)))


def _problem(label: str, world: int) -> Problem:
    """One model on ``world`` ranks at the grid's global batch and sequence length (resolved)."""
    from slapo_tune.problem import ProblemSpec

    preset, overrides = MODELS[label]
    return ProblemSpec(preset, world, dict(overrides), global_batch=GLOBAL_BATCH, seq_len=SEQ).resolve()


def _points(label: str, problem: Problem, points_per_world: int, calibration_per_world: int):
    """(evaluated points, calibration points disjoint from them) of one model and world: seeded, so
    a rescore sees exactly the points of the run it re-predicts."""
    world = problem.workload.world_size
    evaluated = _sample(problem.space, points_per_world, f"{label}-{world}-eval")
    return evaluated, _sample(problem.space, calibration_per_world, f"{label}-{world}-cal", evaluated)


def run(points_per_world: int, calibration_per_world: int, worlds=(1, 2, 4), timed_steps: int = 3,
        models: tuple[str, ...] = tuple(MODELS)) -> dict:
    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.cost_model.measure import measure_points_rank
    from slapo_tune.launch import launch
    from slapo_tune.space import format_point

    device = hardware("cpu")
    rows, summary = [], {}
    for label in models:
        problems = {world: _problem(label, world) for world in worlds}
        calibration_points, evaluated = [], {}
        for world in worlds:
            evaluated[world], calibration = _points(label, problems[world], points_per_world, calibration_per_world)
            calibration_points.append((world, calibration))
        # calibrate the analytic weights on exact points disjoint from the evaluated ones
        samples_points, samples_peaks = [], []
        t0 = time.perf_counter()
        for world, pts in calibration_points:
            model = CostModel(problems[world], device)
            for p in pts:
                samples_points.append((world, p))
                samples_peaks.append({s: b.total for s, b in model.exact(p).items()})
        calibration_seconds = time.perf_counter() - t0
        from slapo_tune.cost_model import calibration as cal
        from slapo_tune.cost_model.analytic import memory_terms, time_terms

        fit_samples = []
        for (world, p), peaks in zip(samples_points, samples_peaks):
            model = CostModel(problems[world], device)
            # the collective backend's temporaries (gloo's reduce-scatter copy) are part of the peak
            for st in memory_terms(model.layout, p, problems[world].workload, model.backend):
                fit_samples.append((st.events, peaks[st.stage]))
        calibration = cal.fit(fit_samples)
        # the time model's weights from the calibration points' measured steps (disjoint from the evaluated)
        time_samples = []
        for world, pts in calibration_points:
            problem = problems[world]
            measured = launch(measure_points_rank, world, args=(problem.spec, pts, timed_steps), timeout=7200)
            model = CostModel(problem, device, calibration=calibration)
            for i, p in enumerate(pts):
                time_samples.append((time_terms(model.layout, p, problem.workload, device),
                                     statistics.median(measured[0][i]["step_times"])))
        calibration.time_weights = cal.fit_time(time_samples)
        calibration.time_points = len(time_samples)
        for world in worlds:
            problem = problems[world]
            model = CostModel(problem, device, calibration=calibration)
            default = CostModel(problem, device, calibration=cal.Calibration(), layout=model.layout)
            pts = evaluated[world]
            t0 = time.perf_counter()
            measured = launch(measure_points_rank, world, args=(problem.spec, pts, timed_steps), timeout=7200)
            measure_seconds = time.perf_counter() - t0
            for i, p in enumerate(pts):
                t1 = time.perf_counter()
                exact = {s: b.total for s, b in model.exact(p).items()}
                exact_seconds = time.perf_counter() - t1
                analytic = model.memory(p).per_stage
                plain = default.memory(p).per_stage
                per_rank = [r[i] for r in measured]
                step = statistics.median(per_rank[0]["step_times"])
                predicted_step = model.time(p).step
                uncalibrated_step = default.time(p).step
                for stage in range(p["pp"]):
                    peaks = [r["total"] for r in per_rank if r["stage"] == stage]
                    rows.append({
                        "model": label, "world": world, "point": format_point(p), "stage": stage,
                        "measured": max(peaks), "exact": exact[stage], "analytic": analytic[stage],
                        "analytic_uncalibrated": plain[stage],
                        "exact_error": exact[stage] / max(peaks) - 1, "analytic_error": analytic[stage] / max(peaks) - 1,
                        "uncalibrated_error": plain[stage] / max(peaks) - 1,
                        "step_seconds": step, "predicted_step_seconds": predicted_step,
                        "uncalibrated_step_seconds": uncalibrated_step,
                        "exact_seconds": exact_seconds, "trial_seconds": measure_seconds / len(pts),
                    })
            print(f"{label} world {world}: {len(pts)} points measured in {measure_seconds:.0f} s", flush=True)
        summary[label] = {"calibration": calibration.as_dict(), "calibration_points": len(samples_points),
                          "calibration_seconds": calibration_seconds}
    return {"rows": rows, "models": summary}


def rescore(points_per_world: int, calibration_per_world: int, worlds=(1, 2, 4)) -> dict:
    """The predictions of the current code against the ground truth of the last full run: the
    measured peaks and step times are read back from its CSV; exact mode runs again, the analytic
    model is re-calibrated on the same calibration points (exact mode, no training), and the time
    model keeps the weights that run fitted to measured steps."""
    import json

    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.cost_model import calibration as cal
    from slapo_tune.cost_model.analytic import DEFAULT_TIME_WEIGHTS, memory_terms
    from slapo_tune.space import format_point

    out = results_dir()
    with open(out / "cost_model_points.csv") as f:
        old_rows = list(csv.DictReader(f))
    previous = json.loads((out / "cost_model_accuracy.json").read_text())["models"]
    device = hardware("cpu")
    rows, summary = [], {}
    for label in MODELS:
        problems = {world: _problem(label, world) for world in worlds}
        fit_samples, evaluated = [], {}
        t0 = time.perf_counter()
        for world in worlds:
            problem = problems[world]
            evaluated[world], calibration = _points(label, problem, points_per_world, calibration_per_world)
            model = CostModel(problem, device)
            for p in calibration:
                peaks = {s: b.total for s, b in model.exact(p).items()}
                fit_samples += [(st.events, peaks[st.stage])
                                for st in memory_terms(model.layout, p, problem.workload, model.backend)]
        calibration = cal.fit(fit_samples)
        # the weights that run fitted, where they are for today's time terms: weights of another
        # set of terms (the model gained or lost one since) would mix fitted and default weights
        fitted = previous[label]["calibration"]["time_weights"] or {}
        kept = set(fitted) == set(DEFAULT_TIME_WEIGHTS)
        if kept:
            calibration.time_weights = fitted
            calibration.time_points = previous[label]["calibration"]["time_points"]
        for world in worlds:
            model = CostModel(problems[world], device, calibration=calibration)
            default = CostModel(problems[world], device, calibration=cal.Calibration(), layout=model.layout)
            for p in evaluated[world]:
                analytic, plain = model.memory(p).per_stage, default.memory(p).per_stage
                t1 = time.perf_counter()
                exact = {s: b.total for s, b in model.exact(p).items()}
                exact_seconds = time.perf_counter() - t1
                for old in (r for r in old_rows if r["model"] == label and int(r["world"]) == world
                            and r["point"] == format_point(p)):
                    stage, measured = int(old["stage"]), int(old["measured"])
                    row = {**old, "exact": exact[stage], "exact_error": exact[stage] / measured - 1,
                           "exact_seconds": exact_seconds,
                           "analytic": analytic[stage], "analytic_uncalibrated": plain[stage],
                           "analytic_error": analytic[stage] / measured - 1,
                           "uncalibrated_error": plain[stage] / measured - 1,
                           "predicted_step_seconds": model.time(p).step,
                           "uncalibrated_step_seconds": default.time(p).step}
                    for key in ("measured", "world", "stage"):
                        row[key] = int(old[key])
                    for key in ("step_seconds", "trial_seconds"):
                        row[key] = float(old[key])
                    rows.append(row)
        summary[label] = {"calibration": calibration.as_dict(), "calibration_points": len(fit_samples),
                          "calibration_seconds": time.perf_counter() - t0, "rescored": True,
                          "time_weights_kept": kept}
    return {"rows": rows, "models": summary}


def report(result: dict) -> dict:
    rows = result["rows"]

    def stats(key):
        errs = [abs(r[key]) for r in rows]
        return {"median": statistics.median(errs), "max": max(errs), "min_signed": min(r[key] for r in rows)}

    points = {(r["model"], r["world"], r["point"]): r for r in rows}  # one per point (time ranking)
    per_model, per_model_uncalibrated = {}, {}
    for label in sorted({r["model"] for r in rows}):
        pts = [r for r in points.values() if r["model"] == label]
        per_model[label] = spearman([r["predicted_step_seconds"] for r in pts], [r["step_seconds"] for r in pts])
        per_model_uncalibrated[label] = spearman([r["uncalibrated_step_seconds"] for r in pts],
                                                 [r["step_seconds"] for r in pts])
    summary = {
        "points": len(points), "stage_rows": len(rows),
        "exact": stats("exact_error"), "analytic": stats("analytic_error"),
        "analytic_uncalibrated": stats("uncalibrated_error"),
        "time_spearman_all": spearman([r["predicted_step_seconds"] for r in points.values()],
                                      [r["step_seconds"] for r in points.values()]),
        "time_spearman_per_model": per_model,
        "time_spearman_per_model_uncalibrated": per_model_uncalibrated,
        "exact_seconds_median": statistics.median(r["exact_seconds"] for r in points.values()),
        "trial_seconds_median": statistics.median(r["trial_seconds"] for r in points.values()),
    }
    return summary


def write_outputs(result: dict, summary: dict) -> None:
    out = results_dir()
    with open(out / "cost_model_points.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(result["rows"][0]))
        writer.writeheader()
        writer.writerows(result["rows"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 6))
        measured = [r["measured"] / 2**20 for r in result["rows"]]
        ax.scatter(measured, [r["exact"] / 2**20 for r in result["rows"]], s=14, label="exact (fake step)")
        ax.scatter(measured, [r["analytic"] / 2**20 for r in result["rows"]], s=14, marker="x", label="analytic (calibrated)")
        lo, hi = min(measured) * 0.9, max(measured) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", lw=1)
        ax.set_xlabel("measured peak tensor memory per rank (MiB)")
        ax.set_ylabel("predicted (MiB)")
        ax.set_title("Cost model: predicted vs measured memory (CPU grid)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "cost_model_memory.png", dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover - matplotlib is a dev dependency
        pass
    save_json("cost_model_accuracy", {"summary": summary, "models": result["models"]})


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points-per-world", type=int, default=10)
    parser.add_argument("--calibration-per-world", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="fewer points (a smoke run, not the reported figures)")
    parser.add_argument("--rescore", action="store_true",
                        help="re-predict the last full run's measured points with the current code (no training)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes")
    args = parser.parse_args(argv)
    isolated_cache()  # no calibration or measurement from a user's cache
    models = tuple(args.models.split(","))
    worlds = tuple(int(w) for w in args.worlds.split(","))
    if args.quick:
        args.points_per_world, args.calibration_per_world = 3, 3
    if args.rescore:
        result = rescore(args.points_per_world, args.calibration_per_world)
    else:
        result = run(args.points_per_world, args.calibration_per_world, worlds, models=models)
    summary = report(result)
    write_outputs(result, summary)
    s = summary
    print(f"points: {s['points']} ({s['stage_rows']} stage rows)")
    for mode in ("exact", "analytic", "analytic_uncalibrated"):
        m = s[mode]
        print(f"  {mode:<22} median |error| {m['median'] * 100:5.2f} %, max {m['max'] * 100:5.2f} %, "
              f"worst under-prediction {min(0.0, m['min_signed']) * 100:5.2f} %")
    print(f"  time ranking: Spearman {s['time_spearman_all']:.3f} over all points; per model "
          + ", ".join(f"{k} {v:.3f}" for k, v in s["time_spearman_per_model"].items())
          + " (uncalibrated: " + ", ".join(f"{k} {v:.3f}" for k, v in s["time_spearman_per_model_uncalibrated"].items())
          + ")")
    print(f"  cost: exact mode {s['exact_seconds_median']:.1f} s per point vs a real trial {s['trial_seconds_median']:.1f} s")
    return summary


if __name__ == "__main__":
    main()
