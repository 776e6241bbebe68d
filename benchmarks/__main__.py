"""``python -m benchmarks [--quick]`` (``make bench``): every headline figure in one run, written to
``results/benchmarks/REPORT.md`` with its plots.

Sections: tuned vs out of the box (:mod:`benchmarks.headline`), search efficiency on the recorded
grid (:mod:`benchmarks.search_strategies`), cost-model accuracy
(:mod:`benchmarks.cost_model_accuracy`; the full 60-point grid alone takes about 50 minutes on 2
cores, so this run measures a smaller seeded sample unless ``--full-accuracy``), sequence
parallelism, selective recomputation and interleaving side by side (:mod:`benchmarks.techniques`),
the published tables (:mod:`benchmarks.paper_tables`) and published GPU runs with their
citations (:mod:`benchmarks.published_runs`), overheads (schedule language, pipeline, runners,
the driver at 1,000 trials), ``plan``'s wall time
at 1,024-3,072 ranks (:mod:`benchmarks.plan_speed`) and ``tune``'s start-up on such a space
(:mod:`benchmarks.search_startup`). ``--quick`` is a smoke run of
every section (under 10 minutes), not the reported figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone

from benchmarks._stats import results_dir


def _progress(done: int, total: int, started: float, label: str) -> None:
    width = 24
    filled = int(width * done / total)
    elapsed = time.monotonic() - started
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {elapsed / 60:5.1f} min  {label:<60}",
          end="" if done < total else "\n", file=sys.stderr, flush=True)


def sections(quick: bool, full_accuracy: bool) -> list[tuple[str, str, list[str]]]:
    """(title, module, argv) of every benchmark, in order."""
    if quick:
        return [
            ("tuned vs out of the box", "headline", ["--quick"]),
            ("search efficiency", "search_strategies", ["--seeds", "2"]),
            ("cost-model accuracy", "cost_model_accuracy", ["--points-per-world", "1", "--calibration-per-world", "1",
                                                            "--models", "gpt2-ref", "--worlds", "1,2"]),
            ("schedule-language overhead", "schedule_overhead", ["--steps", "5"]),
            ("runner overhead", "runner_overhead", ["--repeats", "1", "--worlds", "2"]),
            ("driver overhead", "driver_overhead", ["--trials", "200", "--strategies", "tpe"]),
            ("techniques side by side", "techniques", ["--quick"]),
            ("published tables", "paper_tables", ["--quick"]),
            ("published GPU runs", "published_runs", ["--quick"]),
            ("plan at scale", "plan_speed", ["--rounds", "1"]),
            ("tune start-up at scale", "search_startup", ["--rounds", "1"]),
        ]
    accuracy = [] if full_accuracy else ["--points-per-world", "2", "--calibration-per-world", "1"]
    return [
        ("tuned vs out of the box", "headline", []),
        ("search efficiency", "search_strategies", []),
        ("cost-model accuracy", "cost_model_accuracy", accuracy),
        ("schedule-language overhead", "schedule_overhead", ["--steps", "20"]),
        ("pipeline overhead", "pipeline_overhead", ["--steps", "10"]),
        ("runner overhead", "runner_overhead", ["--repeats", "2"]),
        ("driver overhead", "driver_overhead", []),
        ("techniques side by side", "techniques", []),
        ("published tables", "paper_tables", []),
        ("published GPU runs", "published_runs", []),
        ("plan at scale", "plan_speed", []),
        ("tune start-up at scale", "search_startup", []),
    ]


def _load(name: str) -> dict | None:
    try:
        return json.loads((results_dir() / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def _pct(x: float) -> str:
    return f"{x * 100:.2f} %"


MIN_RANKED = 5  # points below which a Spearman coefficient says nothing (two points give +-1)


def targets(mode: str, seconds: dict[str, float]) -> list[tuple[str, str, str, bool | None]]:
    """(figure, value, target, met) of every stated target the run's results can judge; ``met``
    is None where the run measured too little to judge it."""
    out: list[tuple[str, str, str, bool | None]] = []

    def check(figure: str, value: float | None, target: str, met: bool | None, fmt: str = "{:.3f}") -> None:
        out.append((figure, "-" if value is None else fmt.format(value), target, met))

    for label, e in (_load("headline") or {}).items():
        if "vs_optimum" in e:
            ratio = e["vs_optimum"]["ratio"]
            check(f"{label}: tuned / exhaustive optimum", ratio, ">= 0.97", ratio >= 0.97)
    search = _load("search_strategies")
    for grid, g in ((search or {}).get("grids") or {}).items():
        for name, target in (("guided/recorded/pruned", 3), ("guided/perturbed/pruned", 6)):
            s = g["strategies"].get(name)
            if s:
                median = s["median"]
                check(f"{grid} {name}: trials to 3 % (censored median, {s['runs']} run(s))", median,
                      f"<= {target}", median is not None and median <= target, "{:.0f}")
        s = g["strategies"].get("guided/recorded/pruned")
        if s:
            check(f"{grid} guided/recorded/pruned: worst trials to 3 %", s["worst"], "<= 8",
                  s["worst"] is not None and s["worst"] <= 8, "{:.0f}")
    acc = _load("cost_model_accuracy")
    if acc:
        a = acc["summary"]
        for mode_name, med, worst in (("exact", 0.01, 0.03), ("analytic", 0.05, 0.15)):
            m = a[mode_name]
            check(f"{mode_name} memory: median |error|", m["median"], f"<= {_pct(med)}", m["median"] <= med, "{:.2%}")
            check(f"{mode_name} memory: max |error|", m["max"], f"<= {_pct(worst)}", m["max"] <= worst, "{:.2%}")
        under = min(0.0, a["analytic"]["min_signed"])
        check("analytic memory: worst under-prediction", under, ">= -10 %", under >= -0.10, "{:.2%}")
        ranked = a["points"] >= MIN_RANKED
        check(f"time ranking: Spearman over {a['points']} points", a["time_spearman_all"] if ranked else None,
              ">= 0.8" + ("" if ranked else f" (needs >= {MIN_RANKED} points)"),
              a["time_spearman_all"] >= 0.8 if ranked else None)
    sched = _load("schedule_overhead")
    if sched:
        for key, label, limit in (("no_primitives", "no primitives / plain", 1.02),
                                  ("tp_vs_dtensor", "tensor-parallel block, ours / DTensor", 1.0)):
            r = sched[key]["ratio_of_medians"]
            check(label, r, f"<= {limit}", r <= limit)
    pipe = _load("pipeline_overhead")
    if pipe:
        check("pipeline, ours / hand-written", pipe["ratio_of_medians"], "<= 1.05", pipe["ratio_of_medians"] <= 1.05)
    for world, r in (_load("runner_overhead") or {}).items():
        if isinstance(r, dict) and "ray_over_local" in r:
            check(f"runner overhead {world}: Ray / local", r["ray_over_local"], "<= 1.5", r["ray_over_local"] <= 1.5)
    for label, r in ((_load("plan_speed") or {}).get("rows") or {}).items():
        if r["target_s"]:
            check(f"plan {label}: wall seconds (median of {r['rounds']})", r["wall_median"], f"< {r['target_s']:.0f}",
                  r["wall_median"] < r["target_s"], "{:.2f}")
    total, limit = sum(seconds.values()) / 60, 10 if mode == "quick" else 45
    check("run time (minutes)", total, f"< {limit}", total < limit, "{:.1f}")
    return out


def report(mode: str, seconds: dict[str, float], failures: dict[str, str]) -> str:
    lines = [f"# slapo-tune benchmark report ({mode})", "",
             f"Generated {datetime.now(timezone.utc).isoformat(timespec='seconds')} on this machine "
             "(CPU, gloo); every ratio was measured side by side in the same run, alternating the variants.", ""]
    for name, error in failures.items():
        lines += [f"**{name} failed:** `{error}`", ""]
    judged = targets(mode, seconds)
    missed = [t for t in judged if t[3] is False]
    lines += ["## Targets", "", f"{len(missed)} of {len(judged)} stated targets missed"
              + (" (a quick run measures too little to judge most figures)" if mode == "quick" else "") + ".", "",
              "| figure | value | target | |", "|---|---|---|---|"]
    lines += [f"| {figure} | {value} | {target} | {'met' if met else '**MISSED**' if met is False else 'not judged'} |"
              for figure, value, target, met in judged]
    lines.append("")
    head = _load("headline")
    if head:
        lines += ["## Tuned vs out of the box", "",
                  "| workload | tuned point | samples/s | vs out of the box | vs default made to fit | trials |",
                  "|---|---|---|---|---|---|"]
        for label, e in head.items():
            if "error" in e:
                lines.append(f"| {label} | {e['error']} | | | | |")
                continue
            cells = []
            for baseline in ("out of the box", "default made to fit"):
                c = e["comparisons"][baseline]
                cells.append(f"{c['speedup']:.2f}x (per round {c['per_round_median']:.2f}, "
                             f"p25 {c['per_round_p25']:.2f}, p75 {c['per_round_p75']:.2f})")
            lines.append(f"| {label} | `{e['points']['tuned']}` | {e['tuned']['samples_per_s']:.1f} | {cells[0]} | "
                         f"{cells[1]} | {e['trials']} |")
        for label, e in head.items():
            if "vs_optimum" in e:
                o = e["vs_optimum"]
                lines.append(f"\n{label}: tuned / exhaustive optimum **{o['ratio']:.3f}** (per round median "
                             f"{o['per_round_median']:.3f}, p25 {o['per_round_p25']:.3f}, p75 {o['per_round_p75']:.3f}"
                             f"); optimum `{o['point']}` ({o['optimum']}: the fastest of the tuned point and the "
                             f"best points of the recorded exhaustive search `{o['grid']}`, timed again in this run). "
                             f"The optimum was chosen on the first half of the rounds and the ratio measured on the "
                             f"other {o['rounds']}; chosen and measured on the same rounds, the ratio is "
                             f"{o['all_rounds_ratio']:.3f} ({o['all_rounds_optimum']}).")
        lines += ["", "Baselines: " + "; ".join(f"{k}: `{v}`" for k, v in next(
            (e for e in head.values() if "points" in e), {"points": {}})["points"].items() if k != "tuned"), ""]
    search = _load("search_strategies")
    if search and "grids" in search:
        lines += ["## Search efficiency (recorded grids, replayed)", "",
                  "Trials until a point within 3 % of the grid's optimum; `perturbed`: the time model's predictions "
                  "multiplied by a fixed, seeded factor between 1/2 and 2 per knob value (every seed another). A "
                  "search that never got within 3 % counts as a miss (worse than any that did): medians and "
                  "quartiles are censored, never taken over the successes only.", "",
                  "| grid | strategy | trials to 3 % (median, p25-p75) | worst | reached | "
                  "replayed time to 3 % (median) |",
                  "|---|---|---|---|---|---|"]

        def cell(x, unit=""):
            if x is None:
                return "miss"
            return f"{x:.1f}{unit}" if unit else f"{x:.0f}"

        for grid, g in search["grids"].items():
            for name, s in g["strategies"].items():
                lines.append(f"| {grid} | {name} | {cell(s['median'])} ({cell(s.get('p25'))}-{cell(s.get('p75'))}) | "
                             f"{cell(s.get('worst'))} | {s.get('reached', 0):.0%} of {s['runs']} | "
                             f"{cell(s.get('median_seconds'), ' s')} |")
        lines += ["", "Replayed time: each launched trial's warm-up and measured steps at its recorded step time "
                  "(an out-of-memory trial: one step), plus the driver's own time measured in this run."]
        lines.append("")
    acc = _load("cost_model_accuracy")
    if acc:
        s = acc["summary"]
        lines += ["## Cost-model accuracy", "",
                  f"{s['points']} points ({s['stage_rows']} stage rows), predicted vs measured peak tensor memory per rank:", "",
                  "| mode | median abs error | max abs error | worst under-prediction |", "|---|---|---|---|"]
        for mode in ("exact", "analytic", "analytic_uncalibrated"):
            m = s[mode]
            lines.append(f"| {mode} | {_pct(m['median'])} | {_pct(m['max'])} | {_pct(min(0.0, m['min_signed']))} |")
        ranking = (f"Time ranking: Spearman {s['time_spearman_all']:.3f} over all points; per model "
                   + ", ".join(f"{k} {v:.3f}" for k, v in s["time_spearman_per_model"].items())
                   if s["points"] >= MIN_RANKED else
                   f"Time ranking: not judged ({s['points']} points; a coefficient over fewer than {MIN_RANKED} "
                   "says nothing)")
        lines += ["", ranking
                  + f". Exact mode costs {s['exact_seconds_median']:.1f} s per point vs {s['trial_seconds_median']:.1f} s"
                  " for a measured point.", "", "![memory](cost_model_memory.png)", ""]
    tech = _load("techniques")
    if tech:
        from benchmarks.techniques import report_section

        lines += report_section(tech)
    papers = _load("paper_tables")
    if papers:
        from benchmarks.paper_tables import report_section as paper_section

        lines += paper_section(papers)
    runs = _load("published_runs")
    if runs:
        from benchmarks.published_runs import report_section as runs_section

        lines += runs_section(runs)
    plans = _load("plan_speed")
    if plans:
        from benchmarks.plan_speed import report_section as plan_section

        lines += plan_section(plans)
    lines += ["## Overheads", ""]
    sched = _load("schedule_overhead")
    if sched:
        for key, label in (("no_primitives", "schedule with no primitives / plain model"),
                           ("tp_vs_dtensor", "tensor-parallel block, ours / DTensor")):
            r = sched[key]
            lines.append(f"- {label}: {r['ratio_of_medians']:.3f} (per step median {r['per_round_median']:.3f}, "
                         f"p25 {r['per_round_p25']:.3f}, p75 {r['per_round_p75']:.3f})")
    pipe = _load("pipeline_overhead")
    if pipe:
        lines.append(f"- pipeline, ours / hand-written torch.distributed.pipelining: {pipe['ratio_of_medians']:.3f} "
                     f"(per step median {pipe['per_round_median']:.3f}, p25 {pipe['per_round_p25']:.3f}, "
                     f"p75 {pipe['per_round_p75']:.3f})")
    runner = _load("runner_overhead")
    if runner:
        for world, r in runner.items():
            if isinstance(r, dict) and "local" in r:
                lines.append(f"- runner overhead {world}: local {r['local']['overhead_median']:.2f} s, Ray "
                             f"{r['ray']['overhead_median']:.2f} s per trial (Ray / local {r['ray_over_local']:.2f})")
    driver = _load("driver_overhead")
    if driver:
        for strategy, r in driver["results"].items():
            lines.append(f"- driver at {driver['trials']} trials ({strategy}): "
                         f"{r['seconds_per_launched_trial'] * 1e3:.1f} ms per trial")
    lines += ["", "## Run", "", "| section | minutes |", "|---|---|"]
    lines += [f"| {k} | {v / 60:.1f} |" for k, v in seconds.items()]
    lines += [f"| total | {sum(seconds.values()) / 60:.1f} |", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    import importlib

    from slapo_tune._atomic import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of every section (under 10 minutes)")
    parser.add_argument("--full-accuracy", action="store_true", help="the cost-model issue's full 60-point grid")
    parser.add_argument("--only", default=None, help="comma-separated modules to run (the report uses all results)")
    args = parser.parse_args(argv)
    plan = sections(args.quick, args.full_accuracy)
    if args.only:
        plan = [s for s in plan if s[1] in args.only.split(",")]
    started = time.monotonic()
    seconds, failures = {}, {}
    for i, (title, module, module_args) in enumerate(plan):
        _progress(i, len(plan), started, title)
        t0 = time.monotonic()
        try:
            importlib.import_module(f"benchmarks.{module}").main(module_args)
        except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
            failures[title] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        seconds[title] = time.monotonic() - t0
    _progress(len(plan), len(plan), started, "report")
    path = results_dir() / "REPORT.md"
    atomic_write_text(path, report("quick" if args.quick else "full", seconds, failures))
    print(f"wrote {path} in {(time.monotonic() - started) / 60:.1f} min")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
