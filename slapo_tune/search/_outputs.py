"""The output folder, rewritten (atomically) after every trial, from the study alone: a killed
driver loses nothing that was told, and a resumed one rewrites the same files.

- ``trials.csv`` (and ``trials.parquet`` where pyarrow is installed): one row per trial;
- ``best_schedule.json``: the best measured point as a schedule file;
- ``report.html`` (self-contained, images inlined) with the PNGs beside it.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from .._atomic import atomic_write, atomic_write_text
from ..schedule_file import make_schedule, write_schedule

PLOTS = ("best_so_far", "throughput_by_knob", "memory_predicted_vs_measured", "pruned_region")


def trial_rows(study, knob_names: list[str]) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        status = t.user_attrs.get("status")
        point = t.user_attrs.get("point")
        if point is None or status is None:
            continue
        result = t.user_attrs.get("result") or {}
        predicted = t.user_attrs.get("predicted") or {}
        peaks = result.get("peak_memory") or []
        row = {"trial": t.number, "status": status, **{k: point.get(k) for k in knob_names},
               "samples_per_s": result.get("samples_per_s"), "tokens_per_s": result.get("tokens_per_s"),
               "step_s_median": _median(result.get("step_times")), "step_spread": result.get("spread"),
               "peak_memory": max(peaks) if peaks else None,
               "peak_rss": max(result.get("peak_rss") or [0]) or None,
               "predicted_peak": predicted.get("peak"), "predicted_step_s": predicted.get("step_s"),
               "wait_fraction": result.get("wait_fraction"), "wall_s": result.get("wall_seconds"),
               "overhead_s": result.get("overhead_seconds"),
               "reason": t.user_attrs.get("reason") or result.get("error") or "",
               "warnings": "; ".join(result.get("warnings") or []), "retry_of": t.user_attrs.get("retry_of")}
        rows.append(row)
    return rows


def _median(values):
    import statistics

    return statistics.median(values) if values else None


def best_trial(study):
    """The fastest trial that ran ``ok``, or None."""
    best = None
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("status") == "ok" and t.values and (best is None or t.values[0] > best.values[0]):
            best = t
    return best


REPORT_INTERVAL = 15.0  # seconds between report redraws while a study runs (plots cost ~1 s)
REPORT_SHARE = 0.05


def write_outputs(tuner, final: bool = False) -> None:
    """Tables and the best schedule after every trial; the report (plots) at most every
    ``REPORT_INTERVAL`` seconds, and always when ``final``."""
    import time

    import pandas as pd

    out: Path = tuner.config.out
    out.mkdir(parents=True, exist_ok=True)
    rows = trial_rows(tuner.study, tuner.space.names)
    frame = pd.DataFrame(rows)
    atomic_write(out / "trials.csv", lambda tmp: frame.to_csv(tmp, index=False))
    try:
        import pyarrow  # noqa: F401

        atomic_write(out / "trials.parquet", lambda tmp: frame.to_parquet(tmp, index=False))
    except ImportError:
        pass
    best = best_trial(tuner.study)
    if best is not None and getattr(tuner, "_schedule_written", None) != best.number:
        write_schedule(out / "best_schedule.json", schedule_of(tuner, best))
        tuner._schedule_written = best.number
    now = time.monotonic()
    # at most REPORT_SHARE of the driver's time on plots, however fast trials come back
    interval = max(REPORT_INTERVAL, getattr(tuner, "_report_seconds", 0.0) / REPORT_SHARE)
    if final or now - getattr(tuner, "_report_written", -interval) >= interval:
        write_report(out, frame, tuner)
        tuner._report_written, tuner._report_seconds = now, time.monotonic() - now


def schedule_of(tuner, trial) -> dict[str, Any]:
    from ..models import config_fingerprint
    from ..template import accumulation

    point = trial.user_attrs["point"]
    result = trial.user_attrs.get("result") or {}
    predicted = trial.user_attrs.get("predicted") or {}
    c = tuner.config
    return make_schedule(
        template={"name": tuner.template.name, "version": str(tuner.template.version)}, knobs=point,
        world_size=c.world_size, global_batch=tuner.workload.global_batch, seq_len=tuner.workload.seq_len,
        dtype=c.dtype, device=c.device, accumulation=accumulation(point, tuner.workload),
        model={"name": c.model, "overrides": dict(c.model_overrides),
               "fingerprint": config_fingerprint(tuner.spec.config())},
        measured={"samples_per_s": result.get("samples_per_s"), "tokens_per_s": result.get("tokens_per_s"),
                  "peak_memory": result.get("peak_memory"), "step_times": result.get("step_times"),
                  "trial": trial.number},
        predicted={"peak_memory": predicted.get("peak"), "step_seconds": predicted.get("step_s")},
        study=tuner.study.study_name,
    )


def _plots(out: Path, frame, knob_names: list[str], budget: int) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    ok = frame[frame.status == "ok"] if len(frame) else frame

    def save(fig, name):
        path = out / f"{name}.png"
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
        plt.close(fig)
        made.append(name)

    if len(ok):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        launched = frame[frame.status.isin(["ok", "oom", "crash", "timeout"])].sort_values("trial")
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
    if len(frame) and {"micro_batch", "ckpt_ratio"} <= set(frame.columns):
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        colors = {"ok": "tab:green", "oom": "tab:red", "pruned": "tab:orange", "crash": "k", "timeout": "tab:gray"}
        for status, part in frame[frame.status.isin(list(colors))].groupby("status"):
            ax.scatter(part.micro_batch, part.ckpt_ratio, s=20, c=colors[status], label=status, alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("checkpoint ratio")
        ax.set_title(f"Pruned region (budget {budget / 2**20:.0f} MiB)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        save(fig, "pruned_region")
    return made


def write_report(out: Path, frame, tuner) -> None:
    plots = _plots(out, frame, tuner.space.names, tuner.config.memory_budget)
    p = tuner.progress
    best = p.best_point
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>slapo-tune report</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ccc;padding:2px 6px}img{max-width:48%;margin:4px}</style></head><body>",
        f"<h1>slapo-tune: {html.escape(tuner.config.model)} on {tuner.config.world_size} rank(s)</h1>",
        f"<p>study <b>{html.escape(tuner.study.study_name)}</b>, template {html.escape(tuner.template.describe())}, "
        f"strategy {html.escape(tuner.config.strategy)}, budget {tuner.config.memory_budget / 2**20:.0f} MiB per rank; "
        f"{p.launched} launched, {p.pruned} pruned, {p.failed} failed.</p>",
        f"<p>best: <b>{html.escape(str(best))}</b> at {p.best or 0:.2f} samples/s</p>" if best else "<p>no point ran ok yet</p>",
    ]
    for name in plots:
        data = base64.b64encode((out / f"{name}.png").read_bytes()).decode()
        parts.append(f"<img alt='{name}' src='data:image/png;base64,{data}'>")
    parts.append(frame.to_html(index=False, na_rep="", float_format=lambda x: f"{x:.4g}") if len(frame) else "")
    parts.append("</body></html>")
    text = "\n".join(parts)
    atomic_write_text(out / "report.html", text)
