"""Cost-model accuracy on the CPU reference grid.

For GPT-2- and Llama-style models sized so that activations dominate, at world sizes 1, 2 and 4,
a seeded sample of legal points (tp, pp, zero, checkpointing, micro-batch, attention, fusion) is
run for real: peak tensor memory per rank (the same tensor-level tracker on real tensors) and step
time. Compared with the exact mode (fake step per stage) and the analytic mode (calibrated on a
*separate* sample of exact points, and uncalibrated), and the time model's ranking (Spearman),
its weights fitted to the calibration points' measured steps.

Writes ``results/benchmarks/cost_model_points.csv``, ``cost_model_memory.png`` and a JSON summary
(``cost_model_accuracy.json``) that records the points measured. Run:
``python -m benchmarks.cost_model_accuracy [--points-per-world 10] [--quick]``.

``--points FILE`` measures the points a JSON file lists instead of a seeded sample: the seeded
sample is drawn from the space, so a space that gained choices draws other points, and two
versions of the code would be compared on different points. The file is a previous run's
``cost_model_accuracy.json`` (copy it first: this run overwrites it), or any JSON object of the
same ``points`` shape: ``{"points": {MODEL: {WORLD: {"evaluated": [POINT, ...], "calibration":
[POINT, ...]}}}}``, a POINT an object with one value per knob of the space. The file's models and
worlds are the run's. A point not legal in this space (a knob it lacks or does not have, a value
the rules now refuse) is dropped with a line saying why, and counted in the summary; a malformed
file, one over 1 MiB or 1,000 points, a calibration point that is also evaluated, or a model left
without a calibration point is one line on stderr and exit status 2. ``--rescore --points FILE``
re-predicts those points of the last run's CSV.
"""

from __future__ import annotations

import argparse
import csv
import functools
import random
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slapo_tune.problem import Problem

from benchmarks._stats import isolated_cache, results_dir, save_json, spearman  # noqa: E402

MODELS = {
    "gpt2-ref": ("gpt2", {"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 8192}),
    "llama-ref": ("llama-tiny", {"num_hidden_layers": 6, "hidden_size": 384, "num_attention_heads": 6,
                                 "num_key_value_heads": 2, "intermediate_size": 1024, "vocab_size": 8192}),
}
GLOBAL_BATCH, SEQ = 16, 128
# a --points file: a full run lists 84 points (60 evaluated, 24 calibration) in about 20 KiB
MAX_POINTS_BYTES, MAX_POINTS = 2**20, 1000
MAX_WORLD = 8  # one CPU process per rank, all on this machine

# model -> world -> (evaluated points, calibration points disjoint from them)
Selection = dict[str, dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]]]


def _sample(space, n, seed, exclude=()):
    points = [p for p in space.enumerate() if p not in exclude]
    return random.Random(seed).sample(points, min(n, len(points)))


@functools.cache  # resolved once: choosing the points and measuring them need the same problems
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


def sampled_points(models: tuple[str, ...], worlds: tuple[int, ...], points_per_world: int,
                   calibration_per_world: int) -> Selection:
    """The seeded sample of every model and world."""
    return {label: {world: _points(label, _problem(label, world), points_per_world, calibration_per_world)
                    for world in worlds} for label in models}


def _illegal(space, point: dict[str, Any]) -> str | None:
    """Why ``point`` is not a point of ``space`` (None: it is)."""
    from slapo_tune.errors import UsageError

    missing, unknown = [n for n in space.names if n not in point], [n for n in point if n not in space.names]
    if missing or unknown:
        return "; ".join(f"{what} {', '.join(names)}" for what, names in
                         (("no value for the knob(s)", missing), ("unknown knob(s)", unknown)) if names)
    for name, value in point.items():
        # equal is not the same: True == 1 and 1 == 1.0, yet a point of True or 1.0 for a knob of
        # ints would be built and recorded as given
        spelled = next((v for v in space.domain(name) if v == value), value)
        if type(spelled) is not type(value):
            return f"{name}={value!r} is a {type(value).__name__}, the space's {name}={spelled!r} a {type(spelled).__name__}"
    try:
        space.complete(point)  # every knob given: it raises unless each value is legal given the others
    except UsageError as exc:
        return str(exc)
    return None


def read_points(path: str) -> tuple[Selection, list[dict[str, Any]]]:
    """The points a ``--points`` file lists (module docstring), their knobs in this space's order, and
    those dropped as not legal in this space (model, world, role, point, reason). A malformed
    file is a one-line :class:`UsageError`."""
    from slapo_tune._inputs import read_json_file
    from slapo_tune.errors import UsageError
    from slapo_tune.space import format_point

    data = read_json_file(path, "points file", limit=MAX_POINTS_BYTES)
    listed = data.get("points") if isinstance(data, dict) else None
    if not isinstance(listed, dict) or not listed:
        raise UsageError(f"points file {path}: no 'points' object (model -> world -> evaluated, calibration)")
    entries = []
    for label, per_world in listed.items():
        if label not in MODELS:
            raise UsageError(f"points file {path}: unknown model '{label}' (models: {', '.join(MODELS)})")
        if not isinstance(per_world, dict) or not per_world:
            raise UsageError(f"points file {path}: {label} lists no world (world -> evaluated, calibration)")
        for key, lists in per_world.items():
            if not (key.isascii() and key.isdigit() and 1 <= int(key) <= MAX_WORLD):
                raise UsageError(f"points file {path}: {label}'s world '{key}' is not a world size from 1 to {MAX_WORLD}")
            if not isinstance(lists, dict) or set(lists) != {"evaluated", "calibration"} or not all(
                    isinstance(pts, list) and all(isinstance(p, dict) and all(
                        isinstance(v, (str, int, float, bool, type(None))) for v in p.values()) for p in pts)
                    for pts in lists.values()):
                raise UsageError(f"points file {path}: {label} world {key} is not {{\"evaluated\": [point, ...], "
                                 f"\"calibration\": [point, ...]}}")
            entries.append((label, int(key), lists))
    if sum(len(pts) for *_, lists in entries for pts in lists.values()) > MAX_POINTS:
        raise UsageError(f"points file {path} lists over {MAX_POINTS} points: refused")
    selection: Selection = {}
    dropped = []
    for label, world, lists in entries:
        space = _problem(label, world).space
        kept: dict[str, list[dict[str, Any]]] = {"evaluated": [], "calibration": []}
        for role in kept:  # evaluated first: a calibration point is checked against them
            for point in lists[role]:
                reason = _illegal(space, point)
                if reason is not None:
                    dropped.append({"model": label, "world": world, "role": role, "point": point, "reason": reason})
                    continue
                point = {name: point[name] for name in space.names}  # the space's knob order (format_point)
                if point in kept["evaluated"] or point in kept[role]:
                    # calibrated on an evaluated point, the analytic model would be scored on its fit
                    raise UsageError(f"points file {path}: {label} world {world} lists {format_point(point)} twice "
                                     "(a calibration point must not also be an evaluated one)")
                kept[role].append(point)
        selection.setdefault(label, {})[world] = (kept["evaluated"], kept["calibration"])
    for label, per_world in selection.items():
        if not any(calibration for _, calibration in per_world.values()):
            raise UsageError(f"points file {path}: no calibration point of {label} is legal in this space")
    if not any(evaluated for per_world in selection.values() for evaluated, _ in per_world.values()):
        raise UsageError(f"points file {path}: no evaluated point is legal in this space")
    return selection, dropped


def points_record(selection: Selection) -> dict[str, Any]:
    """``selection`` as a ``--points`` file lists it."""
    return {label: {str(world): {"evaluated": evaluated, "calibration": calibration}
                    for world, (evaluated, calibration) in per_world.items()}
            for label, per_world in selection.items()}


def run(selection: Selection, timed_steps: int = 3) -> dict:
    """Measure ``selection``'s points, calibrate on its calibration points, predict its evaluated ones."""
    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.cost_model.measure import measure_points_rank
    from slapo_tune.launch import launch
    from slapo_tune.space import format_point

    device = hardware("cpu")
    rows, summary = [], {}
    for label, per_world in selection.items():
        worlds = tuple(per_world)
        problems = {world: _problem(label, world) for world in worlds}
        evaluated = {world: pts for world, (pts, _) in per_world.items()}
        calibration_points = [(world, pts) for world, (_, pts) in per_world.items() if pts]
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
            if not pts:  # a --points file's world of calibration points only
                continue
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
    return {"rows": rows, "models": summary, "points": points_record(selection)}


def rescore(selection: Selection) -> dict:
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
    for label, per_world in selection.items():
        worlds = tuple(per_world)
        problems = {world: _problem(label, world) for world in worlds}
        fit_samples, evaluated = [], {}
        t0 = time.perf_counter()
        for world in worlds:
            problem = problems[world]
            evaluated[world], calibration = per_world[world]
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
    return {"rows": rows, "models": summary, "points": points_record(selection)}


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
        "points": len(points), "stage_rows": len(rows), "dropped_points": len(result.get("dropped_points", [])),
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
    save_json("cost_model_accuracy", {"summary": summary, "models": result["models"], "points": result["points"],
                                      "dropped_points": result["dropped_points"]})


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points-per-world", type=int, default=None, help="evaluated points per world (default 10)")
    parser.add_argument("--calibration-per-world", type=int, default=None, help="calibration points per world (default 4)")
    parser.add_argument("--quick", action="store_true", help="fewer points (a smoke run, not the reported figures)")
    parser.add_argument("--rescore", action="store_true",
                        help="re-predict the last full run's measured points with the current code (no training)")
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--worlds", default=None, help="comma-separated world sizes (default 1,2,4)")
    parser.add_argument("--points", metavar="FILE", default=None,
                        help="measure the points this file lists (a previous run's cost_model_accuracy.json) "
                             "instead of a seeded sample; its models and worlds are the run's")
    args = parser.parse_args(argv)
    sampling = {"--points-per-world": args.points_per_world, "--calibration-per-world": args.calibration_per_world,
                "--quick": args.quick or None, "--models": args.models, "--worlds": args.worlds}
    if args.points is not None and any(v is not None for v in sampling.values()):
        parser.error(f"--points lists its own models, worlds and points: not with "
                     f"{', '.join(k for k, v in sampling.items() if v is not None)}")
    isolated_cache()  # no calibration or measurement from a user's cache
    if args.points is not None:
        from slapo_tune.errors import UsageError

        try:
            selection, dropped = read_points(args.points)
        except UsageError as exc:
            print(f"cost_model_accuracy: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        for d in dropped:
            print(f"dropped {d['model']} world {d['world']} {d['role']} point {d['point']}: {d['reason']}", flush=True)
    else:
        per_world, calibration = (3, 3) if args.quick else (10, 4)
        models = tuple(args.models.split(",")) if args.models else tuple(MODELS)
        worlds = tuple(int(w) for w in args.worlds.split(",")) if args.worlds else (1, 2, 4)
        selection = sampled_points(models, worlds, per_world if args.points_per_world is None else args.points_per_world,
                                   calibration if args.calibration_per_world is None else args.calibration_per_world)
        dropped = []
    result = rescore(selection) if args.rescore else run(selection)
    result["dropped_points"] = dropped
    summary = report(result)
    write_outputs(result, summary)
    s = summary
    print(f"points: {s['points']} ({s['stage_rows']} stage rows)"
          + (f"; {s['dropped_points']} of the file's points dropped (not legal in this space)" if dropped else ""))
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
