"""The output folder, rewritten (atomically) after every trial, from the study alone: a killed
driver loses nothing that was told, and a resumed one rewrites the same files.

- ``trials.csv`` (and ``trials.parquet`` where pyarrow is installed): one row per trial;
- ``best_schedule.json``: the crowned point as a schedule file (the fastest confirmed one where the
  study's confirmation stands, see ``._confirm``; else the fastest trial);
- ``report.html`` (self-contained, images inlined) with the PNGs beside it.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._atomic import atomic_write, atomic_write_text
from ..plan import TrialStatus
from ..schedule_file import make_schedule, write_schedule
from ..space import point_key
from ._confirm import crowned, recorded
from ._known import trial_status

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

    from ..problem import Problem

LAUNCHED = [s.value for s in TrialStatus if s.launched]
PLOTS = ("best_so_far", "throughput_by_knob", "memory_predicted_vs_measured", "pruned_region")


def trial_rows(study: Study, knob_names: list[str]) -> list[dict[str, Any]]:
    """One row per trial; ``confirmed_*`` from the standing confirmation (its candidates only) and
    ``crowned`` on the trial ``best_schedule.json`` holds."""
    record = recorded(study)
    figures = record["figures"] if record else {}
    best, _ = crowned(study)
    rows = []
    budget = (study.user_attrs.get("context") or {}).get("memory_budget")  # per rank, what pruning held points to
    for t in study.get_trials(deepcopy=False):
        status = trial_status(t)
        point = t.user_attrs.get("point")
        if point is None or status is None:
            continue
        result = t.user_attrs.get("result") or {}
        predicted = t.user_attrs.get("predicted") or {}
        peaks = result.get("peak_memory") or []
        row = {"trial": t.number, "status": status.value, **{k: point.get(k) for k in knob_names},
               "samples_per_s": result.get("samples_per_s"), "tokens_per_s": result.get("tokens_per_s"),
               "step_s_median": _median(result.get("step_times")), "step_spread": result.get("spread"),
               "peak_memory": max(peaks) if peaks else None,
               "peak_reserved": max(result.get("peak_reserved") or [0]) or None,  # CUDA only
               "peak_rss": max(result.get("peak_rss") or [0]) or None,
               "predicted_peak": predicted.get("peak"), "predicted_step_s": predicted.get("step_s"),
               # a pruned point's peak by the mode that pruned it (exact mode's, where analytic let it through)
               "pruned_peak": predicted.get("pruned_peak"), "memory_budget": budget,
               "wait_fraction": result.get("wait_fraction"), "wall_s": result.get("wall_seconds"),
               "overhead_s": result.get("overhead_seconds"),
               "reason": t.user_attrs.get("reason") or result.get("error") or "",
               "warnings": "; ".join(result.get("warnings") or []), "retry_of": t.user_attrs.get("retry_of"),
               "confirmed_throughput": figures.get(str(t.number), {}).get("samples_per_s"),
               "confirmed_spread": figures.get(str(t.number), {}).get("spread"),
               "crowned": best is not None and t.number == best.number}
        rows.append(row)
    return rows


def statuses(study: Study) -> dict[str, int]:
    """The study's trials by how they ended, repeats left out (answered from the study, never
    launched), in TrialStatus's order."""
    counts = {s.value: 0 for s in TrialStatus if s is not TrialStatus.DUPLICATE}
    for t in study.get_trials(deepcopy=False):
        status = trial_status(t)
        if status is not None and status is not TrialStatus.DUPLICATE:
            counts[status.value] += 1
    return {status: n for status, n in counts.items() if n}


def out_of_the_box(study: Study, best: FrozenTrial | None, confirmed: dict[str, Any] | None) -> dict[str, Any] | None:
    """The crowned point against the out-of-the-box schedule the tuner recorded (``plan.OUT_OF_THE_BOX``):
    measured where the study ran that point, else the ratio of the cost model's predictions
    (``how``); None before a point ran ok or where the space has no such point."""
    record = study.user_attrs.get("out_of_the_box")
    if record is None or best is None:
        return None
    key = point_key(record["point"])
    ran = next((t for t in study.get_trials(deepcopy=False) if trial_status(t) is TrialStatus.OK
                and point_key(t.user_attrs["point"]) == key), None)
    if ran is not None:
        figure = confirmed["samples_per_s"] if confirmed else best.values[0]
        return {"point": record["point"], "fits": True, "how": "measured", "samples_per_s": ran.values[0],
                "gain": figure / ran.values[0]}
    predicted, base = (best.user_attrs.get("predicted") or {}).get("throughput"), record["predicted"]["throughput"]
    return {"point": record["point"], "fits": record["fits"], "how": "predicted", "samples_per_s": None,
            "gain": predicted / base if record["fits"] and predicted and base else None}


def _median(values):
    import statistics

    return statistics.median(values) if values else None


REPORT_INTERVAL = 15.0  # seconds between report redraws while a study runs (plots cost ~1 s)
REPORT_SHARE = 0.05


class Outputs:
    """The output folder, as an Optuna-style callback: ``outputs(study, trial)`` after a told trial
    rewrites the tables and the best schedule, and the report (plots) at most every
    ``REPORT_INTERVAL`` seconds; :meth:`finish` writes them all, the report included."""

    def __init__(self, out: Path, problem: Problem, strategy: str) -> None:
        self.out, self.problem, self.strategy = out, problem, strategy
        self._schedule_written: tuple | None = None  # the trial best_schedule.json holds, and its confirmed figures
        self._report_written: float | None = None  # when (time.monotonic) the report was last drawn
        self._report_seconds = 0.0  # how long drawing it took

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        self._write(study, final=False)  # the whole table: a trial's row is not all that changes (best, repeats)

    def finish(self, study: Study) -> None:
        self._write(study, final=True)

    def _write(self, study: Study, final: bool) -> None:
        import time

        import pandas as pd

        self.out.mkdir(parents=True, exist_ok=True)
        frame = pd.DataFrame(trial_rows(study, self.problem.space.names))
        atomic_write(self.out / "trials.csv", lambda tmp: frame.to_csv(tmp, index=False))
        try:
            import pyarrow  # noqa: F401

            atomic_write(self.out / "trials.parquet", lambda tmp: frame.to_parquet(tmp, index=False))
        except ImportError:
            pass
        best, confirmed = crowned(study)
        if best is not None and self._schedule_written != (best.number, confirmed):
            write_schedule(self.out / "best_schedule.json", schedule_of(self.problem, study.study_name, best, confirmed))
            self._schedule_written = (best.number, confirmed)
        now = time.monotonic()
        # at most REPORT_SHARE of the driver's time on plots, however fast trials come back
        interval = max(REPORT_INTERVAL, self._report_seconds / REPORT_SHARE)
        if final or self._report_written is None or now - self._report_written >= interval:
            write_report(self.out, frame, self.problem, study.study_name, self.strategy, best, confirmed)
            self._report_written, self._report_seconds = now, time.monotonic() - now


def schedule_of(problem: Problem, study_name: str, trial: FrozenTrial,
                confirmed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The schedule file of ``trial``'s point; its measured figures are the confirmation's
    (``confirmed``: the median of every confirmed step, their spread, and the trial's own figure
    beside them) where it was confirmed."""
    from ..models import config_fingerprint

    plan = problem.plan(trial.user_attrs["point"])
    result = trial.user_attrs.get("result") or {}
    predicted = trial.user_attrs.get("predicted") or {}
    p = problem.spec
    measured = {"samples_per_s": result.get("samples_per_s"), "tokens_per_s": result.get("tokens_per_s"),
                "peak_memory": result.get("peak_memory"), "peak_reserved": result.get("peak_reserved"),
                "step_times": result.get("step_times"), "spread": result.get("spread"), "trial": trial.number}
    if confirmed is not None:
        measured.update(samples_per_s=confirmed["samples_per_s"], tokens_per_s=confirmed["samples_per_s"] * p.seq_len,
                        step_times=confirmed["step_times"], spread=confirmed["spread"], confirmed=True,
                        trial_samples_per_s=result.get("samples_per_s"))
    return make_schedule(
        template={"name": problem.template.name, "version": str(problem.template.version)}, plan=plan,
        world_size=p.world_size, global_batch=p.global_batch, seq_len=p.seq_len, precision=p.precision, device=p.device,
        model={"name": p.model, "overrides": dict(p.model_overrides),
               "fingerprint": config_fingerprint(problem.config)},
        measured=measured,
        predicted={"peak_memory": predicted.get("peak"), "step_seconds": predicted.get("step_s")},
        study=study_name,
    )


def _plots(out: Path, frame, knob_names: list[str], budget: int) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    ok = frame[frame.status == TrialStatus.OK] if len(frame) else frame

    def save(fig, name):
        path = out / f"{name}.png"
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
        plt.close(fig)
        made.append(name)

    if len(ok):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        launched = frame[frame.status.isin(LAUNCHED)].sort_values("trial")
        best = launched.samples_per_s.fillna(0).cummax()
        ax.step(range(1, len(best) + 1), best, where="post")
        ax.set_xlabel("launched trials")
        ax.set_ylabel("best samples/s")
        ax.set_title("Best so far")
        fig.tight_layout()
        save(fig, "best_so_far")

        varied = [k for k in knob_names if ok[k].nunique() > 1]
        if varied:
            fig, axes = plt.subplots(1, len(varied), figsize=(2.4 * len(varied), 2.8), squeeze=False)
            for ax, knob in zip(axes[0], varied):
                ax.scatter(ok[knob].astype(str), ok.samples_per_s, s=12)
                ax.set_title(knob, fontsize=9)
                ax.tick_params(labelsize=7)
            axes[0][0].set_ylabel("samples/s")
            fig.tight_layout()
            save(fig, "throughput_by_knob")

        fig, ax = plt.subplots(figsize=(4, 4))
        ax.scatter(ok.peak_memory / 2**20, ok.predicted_peak / 2**20, s=12)
        lim = [0, max(ok.peak_memory.max(), ok.predicted_peak.max()) / 2**20 * 1.1]
        ax.plot(lim, lim, "k--", lw=1)
        ax.set_xlabel("measured peak (MiB)")
        ax.set_ylabel("predicted peak (MiB)")
        ax.set_title("Memory: predicted vs measured")
        fig.tight_layout()
        save(fig, "memory_predicted_vs_measured")
    if len(frame):
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        colors = {TrialStatus.OK: "tab:green", TrialStatus.OOM: "tab:red", TrialStatus.PRUNED: "tab:orange",
                  TrialStatus.CRASH: "k", TrialStatus.TIMEOUT: "tab:gray"}
        for status, part in frame[frame.status.isin([s.value for s in colors])].groupby("status"):
            # every template has these two knobs (plan.KNOBS), so the table has their columns
            ax.scatter(part.micro_batch, part.ckpt_ratio, s=20, c=colors[status], label=status, alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("checkpoint ratio")
        ax.set_title(f"Pruned region (budget {budget / 2**20:.0f} MiB)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save(fig, "pruned_region")
    return made


def write_report(out: Path, frame, problem: Problem, study_name: str, strategy: str,
                 best: FrozenTrial | None, confirmed: dict[str, Any] | None = None) -> None:
    budget = problem.spec.memory_budget
    plots = _plots(out, frame, problem.space.names, budget)
    statuses = [TrialStatus(s) for s in frame.status] if len(frame) else []
    launched, pruned = sum(s.launched for s in statuses), statuses.count(TrialStatus.PRUNED)
    failed = sum(s.failed for s in statuses)
    infrastructure = sum(s.infrastructure for s in statuses)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>slapo-tune report</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:48%;margin:4px}</style></head><body>",
        f"<h1>slapo-tune: {html.escape(problem.spec.model)} on {problem.spec.world_size} rank(s)</h1>",
        f"<p>study <b>{html.escape(study_name)}</b>, template {html.escape(problem.template.describe())}, "
        f"strategy {html.escape(strategy)}, budget {budget / 2**20:.0f} MiB per rank; "
        f"{launched} launched, {pruned} pruned, {failed} failed, {infrastructure} infrastructure failure(s).</p>",
        f"<p>best: <b>{html.escape(str(best.user_attrs['point']))}</b> at {best.values[0]:.2f} samples/s</p>"
        if best and not confirmed else
        f"<p>crowned: <b>{html.escape(str(best.user_attrs['point']))}</b> at {confirmed['samples_per_s']:.2f} "
        f"samples/s confirmed ({len(confirmed['step_times'])} steps, spread {confirmed['spread']:.1%}; the "
        f"trial measured {best.values[0]:.2f})</p>" if best else "<p>no point ran ok yet</p>",
    ]
    for name in plots:
        data = base64.b64encode((out / f"{name}.png").read_bytes()).decode()
        parts.append(f"<img alt='{name}' src='data:image/png;base64,{data}'>")
    parts.append(frame.to_html(index=False, na_rep="", float_format=lambda x: f"{x:.4g}") if len(frame) else "")
    parts.append("</body></html>")
    text = "\n".join(parts)
    atomic_write_text(out / "report.html", text)
