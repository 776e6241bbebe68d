"""``report.html``: the study for a person, self-contained (plots inlined as PNG, no script).

The best point as a table with the commands to train it and to reproduce the study; throughput by
knob as small multiples, each knob's values in natural order; peak memory by trial against the
budget, pruned points (predicted peaks) apart from measured ones; measured against predicted step
time; knob importance (``optuna.importance`` over the points that ran); a timeline of the trials;
the warnings once each; the trials as a table with units. Also what the tune command's summary
reads: the trials by status and the gain over the out-of-the-box schedule (:func:`out_of_the_box`,
in words :func:`gain_text`: the summary, the report and ``show`` say it alike).
"""

from __future__ import annotations

import base64
import html
import re
import shlex
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._atomic import atomic_write, atomic_write_text
from ..plan import SHORT_NAMES, TrialStatus, is_idle, readable
from ..space import point_key
from ..units import format_size, size_argument
from ._confirm import BASELINE, baseline_trial, recorded, side_by_side_gain
from ._known import trial_status
from ._storage import STORAGE_ENV, redact

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

    from ..problem import Problem

MiB = 2**20
COLORS = {"ok": "tab:green", "oom": "tab:red", "pruned": "tab:orange", "crash": "black", "timeout": "tab:gray",
          "invalid": "tab:brown", "lost": "tab:purple", "placement_timeout": "tab:pink", "interrupted": "tab:olive"}
MARKERS = {"ok": "o", "oom": "x", "pruned": "^"}  # pruned: hollow (a predicted peak, never measured)


def statuses(study: Study) -> dict[str, int]:
    """The study's trials by how they ended, repeats left out (answered from the study, never
    launched), in TrialStatus's order."""
    counts = {s.value: 0 for s in TrialStatus if s is not TrialStatus.DUPLICATE}
    for t in study.get_trials(deepcopy=False):
        status = trial_status(t)
        if status is not None and status is not TrialStatus.DUPLICATE:
            counts[status.value] += 1
    return {status: n for status, n in counts.items() if n}


def no_result_reason(study: Study) -> str:
    """Why no point of the study ran ok, in one clause with its figures: every launched trial
    failed (by how), the cost model pruned every point tried (the smallest peak it predicted,
    against the budget), or nothing was measured (how the trials that were told ended)."""
    counts = statuses(study)
    launched = {s: n for s, n in counts.items() if TrialStatus(s).launched}
    others = ", ".join(f"{n} {s}" for s, n in counts.items() if s not in launched)
    common = most_common_failure(study)
    if launched:
        return (f"every trial failed, {sum(launched.values())} launched ("
                + ", ".join(f"{n} {s}" for s, n in launched.items()) + ")" + (f"; {others}" if others else "")
                + (f"; most common: {common}" if common else ""))
    peaks = [(t.user_attrs.get("predicted") or {}).get("pruned_peak") for t in study.get_trials(deepcopy=False)
             if trial_status(t) is TrialStatus.PRUNED]
    if peaks:
        budget = (study.user_attrs.get("context") or {}).get("memory_budget")
        least = min((p for p in peaks if p is not None), default=None)
        return (f"nothing fits the memory budget{f' of {format_size(budget)} per rank' if budget else ''}: the "
                f"cost model pruned every point tried ({len(peaks)})"
                + (f", the smallest predicted peak {format_size(least)}" if least is not None else "")
                + "; raise --memory-budget")
    return "nothing was measured" + (f" ({others})" if others else "") + (f"; most common: {common}" if common else "")


# what to change for the failures whose cause a setting holds (the others' errors say theirs)
FAILURE_ADVICE = {TrialStatus.TIMEOUT: "a longer --trial-timeout (or fewer ranks per core) gives them time",
                  TrialStatus.OOM: "their measured peaks exceeded the budget: raise --memory-budget"}
ERROR_CHARS = 160  # of a failure's error in the one line that names it


def most_common_failure(study: Study) -> str | None:
    """The way most of the study's failed trials ended (crash, timeout, oom, invalid, lost, ...: the
    first in TrialStatus's order among equals), in one clause: how many, the error most of them
    gave (cut to :data:`ERROR_CHARS`) and, where a setting is the cause, which; None when no trial failed."""
    errors: dict[TrialStatus, list[str]] = {}
    for t in study.get_trials(deepcopy=False):
        status = trial_status(t)
        if status is not None and status not in (TrialStatus.OK, TrialStatus.PRUNED, TrialStatus.DUPLICATE,
                                                 TrialStatus.INTERRUPTED):
            errors.setdefault(status, []).append(((t.user_attrs.get("result") or {}).get("error") or "").strip())
    if not errors:
        return None
    order = list(TrialStatus)
    status = max(errors, key=lambda s: (len(errors[s]), -order.index(s)))
    said = [e for e in errors[status] if e]
    error = max(said, key=said.count) if said else ""  # (the first of the most frequent)
    if len(error) > ERROR_CHARS:
        error = error[:ERROR_CHARS - 3] + "..."
    return "; ".join(part for part in (f"{len(errors[status])} {status}" + (f" ({error})" if error else ""),
                                       FAILURE_ADVICE.get(status)) if part)


def out_of_the_box(study: Study, best: FrozenTrial | None, confirmed: dict[str, Any] | None) -> dict[str, Any] | None:
    """The crowned trial ``best`` (its ``confirmed`` figures where confirmed) against the baseline
    the tuner recorded (the out-of-the-box schedule, ``plan.OUT_OF_THE_BOX``, or the default made
    to fit: ``default`` then holds the out-of-the-box point). ``how`` the gain was had:

    - ``same``: the crowned point is the baseline (1.00x);
    - ``side by side``: both measured in the same confirmation rounds; ``low``/``high`` the range
      of the ratio round by round (``rounds`` of them);
    - ``trials``: the two trials' own figures, measured apart (``spreads``: their step spreads);
    - ``failed``: the baseline's trial ran but not ok (``status``), no gain;
    - ``predicted``: it never ran: the ratio of the cost model's predictions (None where it
      cannot fit).

    None before a point ran ok or where the space has no such point."""
    record = study.user_attrs.get(BASELINE)
    if record is None or best is None:
        return None
    out: dict[str, Any] = {"point": record["point"], "default": record.get("out_of_the_box"), "fits": record["fits"],
                           "trial": None, "status": None, "samples_per_s": None, "gain": None, "low": None,
                           "high": None, "rounds": 0, "spreads": None}
    figure = confirmed["samples_per_s"] if confirmed else best.values[0]
    trial = baseline_trial(study)
    if trial is not None:
        out.update(trial=trial.number, status=trial_status(trial).value)
    if point_key(best.user_attrs["point"]) == point_key(record["point"]):
        return {**out, "how": "same", "trial": best.number, "status": TrialStatus.OK.value, "samples_per_s": figure,
                "gain": 1.0, "low": 1.0, "high": 1.0}
    standing = recorded(study) if confirmed else None
    gain = side_by_side_gain(standing, best.number) if standing else None
    if gain is not None:
        baseline = standing["figures"][str(standing["baseline"])]
        return {**out, "how": "side by side", "trial": standing["baseline"], "status": TrialStatus.OK.value,
                "samples_per_s": baseline["samples_per_s"], "spreads": [confirmed["spread"], baseline["spread"]], **gain}
    if trial is not None and trial_status(trial) is TrialStatus.OK:
        ours = confirmed["spread"] if confirmed else (best.user_attrs.get("result") or {}).get("spread")
        return {**out, "how": "trials", "samples_per_s": trial.values[0], "gain": figure / trial.values[0],
                "spreads": [ours, (trial.user_attrs.get("result") or {}).get("spread")]}
    if trial is not None:
        return {**out, "how": "failed"}
    predicted, base = (best.user_attrs.get("predicted") or {}).get("throughput"), record["predicted"]["throughput"]
    return {**out, "how": "predicted", "gain": predicted / base if record["fits"] and predicted and base else None}


def gain_text(baseline: dict[str, Any] | None, knobs: list[str] | None = None) -> str:
    """:func:`out_of_the_box` in words (``knobs``: those a point shows; all when None)."""
    if baseline is None:
        return "no out-of-the-box point in this space"
    point = readable(baseline["point"], knobs)
    if baseline.get("default") is not None:  # the knobs the default was made to fit by
        changed = {k: v for k, v in baseline["point"].items() if baseline["default"].get(k) != v}
        point = f"{point} (out of the box made to fit: {readable(changed)})"
    how = baseline["how"]
    if how == "same":
        return f"1.00x: the crowned point is the baseline itself (trial {baseline['trial']}: {point})"
    if how in ("side by side", "trials"):
        spread = (baseline.get("spreads") or [None, None])[1]
        measured = (f"out of the box: trial {baseline['trial']}, {baseline['samples_per_s']:.2f} samples/s"
                    + ("" if spread is None else f", step spread {spread:.1%}") + f" ({point})")
    if how == "side by side":
        return (f"{baseline['gain']:.2f}x measured side by side (per round {baseline['low']:.2f}-"
                f"{baseline['high']:.2f}x, {baseline['rounds']} round(s)); {measured}")
    if how == "trials":
        return f"{baseline['gain']:.2f}x measured by the two trials apart, not side by side; {measured}"
    if how == "failed":
        return f"not measured: the out-of-the-box trial {baseline['trial']} ended {baseline['status']} ({point})"
    if not baseline["fits"]:
        return f"{point} does not fit the budget (predicted)"
    if baseline["gain"] is None:
        return f"{point} not measured"
    return f"~{baseline['gain']:.2f}x by the cost model's predictions ({point} not measured)"


def tune_command(config: Any) -> str:
    """The ``slapo-tune tune`` command that runs ``config`` (a ``TuneConfig``: not imported, the
    driver imports this module) again: on the same study it resumes it. Its storage as it was
    given: ``--storage-file PATH``; nothing, with a note, for ``$SLAPO_TUNE_STORAGE``; else
    ``--storage URL``, the URL's password shown as ``***`` (with a note: the user types it)."""
    p = config.problem
    args = ["slapo-tune", "tune", "--model", p.model, "--world-size", str(p.world_size),
            "--global-batch", str(p.global_batch), "--seq-len", str(p.seq_len), "--precision", p.precision,
            "--device", p.device, "--memory-budget", size_argument(p.memory_budget), "--strategy", config.strategy,
            "--trials", str(config.trials), "--objective", config.objective, "--prune", config.prune,
            "--seed", str(config.seed), "--measured-steps", str(config.measured_steps),
            "--trial-timeout", f"{config.trial_time_limit:g}s", "--confirm", str(config.confirm)]
    if p.template:
        args += ["--space", p.template]
    if config.knobs:
        args += ["--knobs", ",".join(f"{k}={v}" for k, v in config.knobs.items())]
    for flag, value in (("--hardware", config.hardware), ("--time-budget", config.time_budget and
                                                          f"{config.time_budget:g}s"),
                        ("--patience", config.patience), ("--study", config.study)):
        if value is not None:
            args += [flag, str(value)]
    notes = []
    if config.storage_file:
        args += ["--storage-file", config.storage_file]
    elif config.storage_from_environment:
        notes.append(f"with ${STORAGE_ENV} set to the study's storage")
    elif config.storage:
        shown = redact(config.storage, config.storage)
        args += ["--storage", shown]
        if shown != config.storage:
            notes.append("*** stands for the storage's password")
    args += ["--out", str(config.out)]
    command = shlex.join(args)
    if p.model_overrides:
        notes.append(f"with the model's config overridden: {p.model_overrides}")
    return command + (f"   # {'; '.join(notes)}" if notes else "")


def _varying(problem: Problem) -> list[str]:
    return [k for k in problem.space.names if len(problem.space.domain(k)) > 1]


# ---------------------------------------------------------------------------------------- plots
def _figures(frame, study: Study, problem: Problem, best: FrozenTrial | None) -> dict[str, Any]:
    """name -> (matplotlib figure, caption) of each plot there is something to draw for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = problem.spec.memory_budget
    ok = frame[frame.status == TrialStatus.OK] if len(frame) else frame
    figures: dict[str, Any] = {}
    if len(ok):
        fig, ax = plt.subplots(figsize=(5, 3.2), layout="constrained")
        launched = frame[frame.status.isin([s.value for s in TrialStatus if s.launched])].sort_values("trial")
        ax.step(range(1, len(launched) + 1), launched.samples_per_s.fillna(0).cummax(), where="post")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("trials launched")
        ax.set_ylabel("best samples/s")
        figures["best_so_far"] = (fig, "Best throughput so far")

        knobs = [k for k in _varying(problem) if ok[k].nunique() > 1]
        if knobs:
            figures["throughput_by_knob"] = (_by_knob(plt, ok, knobs, problem, best),
                                             "Throughput by knob (points that ran ok; the crowned one as a star)")

        timed = ok.dropna(subset=["predicted_step_s", "step_s_median"])
        if len(timed):
            fig, ax = plt.subplots(figsize=(4.6, 4), layout="constrained")
            ax.scatter(timed.predicted_step_s, timed.step_s_median, s=16, c="tab:blue")
            low = min(timed.predicted_step_s.min(), timed.step_s_median.min()) * 0.8
            high = max(timed.predicted_step_s.max(), timed.step_s_median.max()) * 1.25
            ax.plot([low, high], [low, high], "k--", lw=1, label="measured = predicted")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("predicted step time (s)")
            ax.set_ylabel("measured step time (s, median)")
            ax.legend(fontsize=8)
            ratio = statistics.median(timed.step_s_median / timed.predicted_step_s)
            figures["step_time"] = (fig, f"Step time, measured against the cost model's prediction (measured is "
                                         f"{ratio:.2f}x the prediction, median over {len(timed)} trial(s))")
    if len(frame):
        figures["memory"] = (_memory(plt, frame, budget), f"Peak memory per rank by trial, against the budget "
                                                          f"({format_size(budget)}); pruned points never ran: "
                                                          f"their peak is the cost model's")
        timeline = _timeline(plt, study)
        if timeline is not None:
            figures["timeline"] = (timeline, "Timeline of the trials (pruned ones take no time: marked |)")
    importance = _importance(plt, study, problem)
    if importance is not None:
        figures["importance"] = importance
    return figures


def _by_knob(plt, ok, knobs: list[str], problem: Problem, best: FrozenTrial | None):
    import numpy as np

    columns = min(4, len(knobs))
    rows = (len(knobs) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(2.6 * columns, 2.2 * rows), squeeze=False, sharey=True,
                             layout="constrained")
    jitter = np.random.default_rng(0).uniform(-0.12, 0.12, len(ok))
    best_point = best.user_attrs["point"] if best else None
    for ax, knob in zip(axes.flat, knobs):
        order = [v for v in problem.space.domain(knob)]  # natural order (Space.domains)
        where = {str(v): i for i, v in enumerate(order)}
        x = np.array([where.get(str(v), np.nan) for v in ok[knob]], dtype=float)
        ax.scatter(x + jitter, ok.samples_per_s, s=10, alpha=0.7, c="tab:blue")
        if best_point is not None and str(best_point.get(knob)) in where:
            ax.scatter([where[str(best_point[knob])]], [ok.samples_per_s.max()], marker="*", s=90, c="tab:red")
        ax.set_xticks(range(len(order)), [str(v) for v in order], fontsize=8)
        ax.set_title(SHORT_NAMES.get(knob, knob), fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes.flat[len(knobs):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("samples/s", fontsize=8)
    return fig


def _memory(plt, frame, budget: int):
    fig, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
    for status, part in frame.groupby("status"):
        measured = status != TrialStatus.PRUNED
        peak = part.peak_memory if measured else part.pruned_peak.fillna(part.predicted_peak)
        part = part.assign(peak=peak).dropna(subset=["peak"])
        if not len(part):
            continue
        color = COLORS.get(status, "tab:gray")
        marker = MARKERS.get(status, "s")
        style = {"facecolors": "none", "edgecolors": color} if not measured else {"c": color}
        ax.scatter(part.trial, part.peak / MiB, s=28, marker=marker,
                   label=f"{status} ({'predicted' if not measured else 'measured'})", **style)
    ax.axhline(budget / MiB, color="tab:red", ls="--", lw=1)
    ax.annotate(f"budget {format_size(budget)}", (0, budget / MiB), xycoords=("axes fraction", "data"),
                textcoords="offset points", xytext=(4, 4), fontsize=8, color="tab:red")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("trial")
    ax.set_ylabel("peak memory per rank (MiB)")
    if ax.get_legend_handles_labels()[0]:  # (no trial with a peak, all crashed: matplotlib would warn on stderr)
        ax.legend(fontsize=7, loc="best")
    return fig


def _timeline(plt, study: Study):
    trials = [(t, trial_status(t)) for t in study.get_trials(deepcopy=False)]
    trials = [(t, s) for t, s in trials if s is not None and s is not TrialStatus.DUPLICATE and t.datetime_start
              and t.datetime_complete]
    if not trials:
        return None
    start = min(t.datetime_start for t, _ in trials)
    fig, ax = plt.subplots(figsize=(6, 0.6 + 0.18 * len(trials)), layout="constrained")
    seen = set()
    for t, status in trials:
        left = (t.datetime_start - start).total_seconds()
        width = (t.datetime_complete - t.datetime_start).total_seconds()
        label = status.value if status.value not in seen else None
        seen.add(status.value)
        color = COLORS.get(status.value, "tab:gray")
        if status is TrialStatus.PRUNED:
            ax.scatter([left], [t.number], marker="|", s=40, c=color, label=label)
        else:
            ax.barh(t.number, max(width, 1e-3), left=left, height=0.7, color=color, label=label)
    ax.invert_yaxis()
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("seconds since the first trial")
    ax.set_ylabel("trial")
    ax.legend(fontsize=7, loc="lower right")
    return fig


def _importance(plt, study: Study, problem: Problem):
    """(figure, caption) of optuna.importance over the points that ran ok (the infeasible ones are
    told 0 and would make importance mean 'fits or not'), one bar per knob that varies among
    them; None with fewer than 3 such points."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    knobs = _varying(problem)
    trials = []
    for t in study.get_trials(deepcopy=False):
        point = t.user_attrs.get("point") or {}
        if trial_status(t) is not TrialStatus.OK or any(point.get(k) not in problem.space.domain(k) for k in knobs):
            continue  # (the point is read from the study: older studies named their parameters otherwise)
        trials.append(optuna.trial.create_trial(
            params={k: point[k] for k in knobs}, value=t.values[0],
            distributions={k: CategoricalDistribution(problem.space.domain(k)) for k in knobs}))
    knobs = [k for k in knobs if len({t.params[k] for t in trials}) > 1]
    if len(trials) < 3 or not knobs:
        return None
    copy = optuna.create_study(direction="maximize")
    copy.add_trials(trials)
    try:
        importance = optuna.importance.get_param_importances(copy, params=knobs)
    except (ValueError, RuntimeError):  # too few distinct results to tell anything apart
        return None
    names = list(importance)[::-1]
    fig, ax = plt.subplots(figsize=(4.6, 0.5 + 0.3 * len(names)), layout="constrained")
    ax.barh([SHORT_NAMES.get(k, k) for k in names], [importance[k] for k in names], color="tab:blue")
    ax.set_xlabel("importance for throughput (share)")
    return fig, f"Knob importance for throughput (optuna.importance, over the {len(trials)} points that ran ok)"


# ---------------------------------------------------------------------------------------- html
def _cell(value: Any, digits: str = ".4g") -> str:
    if value is None or value != value:  # None or NaN
        return ""
    return format(value, digits) if isinstance(value, float) else html.escape(str(value))


def _best_table(problem: Problem, best: FrozenTrial, confirmed: dict[str, Any] | None,
                baseline: dict[str, Any] | None) -> str:
    point = best.user_attrs["point"]
    result = best.user_attrs.get("result") or {}
    predicted = best.user_attrs.get("predicted") or {}
    rows = [(f"{knob}", html.escape(str(value)) + (" <span class='dim'>(does nothing here)</span>"
                                                    if is_idle(point, knob) else ""))
            for knob, value in point.items()]
    figure = confirmed["samples_per_s"] if confirmed else best.values[0]
    throughput = f"{figure:.2f} samples/s ({figure * problem.spec.seq_len:,.0f} tokens/s)"
    if confirmed:
        throughput += (f", confirmed: median of {len(confirmed['step_times'])} steps, spread "
                       f"{confirmed['spread']:.1%} (its trial measured {best.values[0]:.2f})")
    rows.append(("throughput", throughput))
    peaks = result.get("peak_memory") or []
    if peaks:
        rows.append(("peak memory per rank", f"{format_size(max(peaks))} of {format_size(problem.spec.memory_budget)}"
                                             + (f" (predicted {format_size(predicted['peak'])})"
                                                if predicted.get("peak") else "")))
    steps = result.get("step_times") or []
    if steps:
        rows.append(("step time", f"{statistics.median(steps):.4g} s (median of {len(steps)}; predicted "
                                  f"{_cell(predicted.get('step_s'))} s)"))
    if baseline is not None:
        rows.append(("over out of the box", html.escape(gain_text(baseline))))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table class='best'>{body}</table>"


TABLE_COLUMNS = [  # (frame column, heading, how the number is shown)
    ("samples_per_s", "samples/s", lambda v: f"{v:.2f}"),
    ("step_s_median", "step (s)", lambda v: f"{v:.4g}"),
    ("predicted_step_s", "predicted step (s)", lambda v: f"{v:.4g}"),
    ("peak_memory", "peak (MiB)", lambda v: f"{v / MiB:.1f}"),
    ("predicted_peak", "predicted peak (MiB)", lambda v: f"{v / MiB:.1f}"),
    ("wall_s", "wall (s)", lambda v: f"{v:.1f}"),
]


def _trials_table(frame, knobs: list[str]) -> str:
    head = ["#", "status", *(SHORT_NAMES.get(k, k) for k in knobs), *(h for _, h, _ in TABLE_COLUMNS), "note"]
    lines = ["<table class='trials'><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head)
             + "</tr></thead><tbody>"]
    for row in frame.sort_values("trial").to_dict("records"):
        cells = [str(row["trial"]), html.escape(row["status"])]
        cells += ["-" if is_idle(row, k) else _cell(row[k]) for k in knobs]
        for column, _, show in TABLE_COLUMNS:
            value = row.get(column)
            if column == "predicted_peak" and row["status"] == TrialStatus.PRUNED:
                value = row.get("pruned_peak") or value  # the peak it was pruned at
            cells.append("" if value is None or value != value else show(value))
        note = row.get("reason") or ""
        if row.get("retry_of") is not None and row["retry_of"] == row["retry_of"]:
            note = f"retry of #{int(row['retry_of'])}; {note}"
        cells.append(html.escape(str(note)))
        css = " class='crowned'" if row.get("crowned") else f" class='{html.escape(row['status'])}'"
        lines.append(f"<tr{css}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    lines.append("</tbody></table>")
    return "\n".join(lines)


def warning_kind(warning: str) -> str:
    """A warning with its figures masked: "threads waited 59 % of a step" and "... 85 % ..." are
    one kind, shown once."""
    return re.sub(r"\d+(\.\d+)?", "#", warning)


def _warnings(frame) -> str:
    """Each kind of warning once (its first text), with the trials it came from."""
    seen: dict[str, tuple[list[str], list[int]]] = {}
    for row in frame.to_dict("records"):
        for warning in filter(None, (row.get("warnings") or "").split("; ")):
            texts, trials = seen.setdefault(warning_kind(warning), ([], []))
            texts.append(warning)
            trials.append(row["trial"])
    if not seen:
        return ""
    items = "".join(f"<li>{html.escape(texts[0])} <span class='dim'>(trial(s) {', '.join(map(str, trials))}"
                    f"{'; the figures vary' if len(set(texts)) > 1 else ''})</span></li>"
                    for texts, trials in seen.values())
    return f"<h2>Warnings</h2><ul>{items}</ul>"


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222;max-width:1200px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
table.trials td{text-align:right}table.trials td:last-child{text-align:left;min-width:16em}table.trials th{background:#f4f4f4;position:sticky;top:0}
table.best th{background:#f4f4f4;width:14em}tr.crowned{background:#fff3c4;font-weight:bold}
tr.pruned,tr.oom{color:#8a5a00}tr.crash,tr.timeout{color:#a00}.dim{color:#888}
code{background:#f4f4f4;padding:4px 6px;display:block;white-space:pre-wrap;word-break:break-all;font-size:12px}
figure{margin:0 0 1.2em 0;display:inline-block;vertical-align:top;max-width:100%}
figure img{max-width:100%}figcaption{font-size:13px;color:#444;max-width:40em}"""


def write_report(out: Path, frame, problem: Problem, study: Study, strategy: str, best: FrozenTrial | None,
                 confirmed: dict[str, Any] | None = None, command: str | None = None) -> None:
    """Write ``out/report.html`` (and each plot beside it as PNG)."""
    import matplotlib.pyplot as plt

    spec = problem.spec
    counts = statuses(study)
    frame = frame[frame.status != TrialStatus.DUPLICATE] if len(frame) else frame  # answered from the study
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>slapo-tune report: "
             f"{html.escape(study.study_name)}</title><style>{STYLE}</style></head><body>",
             f"<h1>slapo-tune: {html.escape(spec.model)} on {spec.world_size} rank(s)</h1>",
             f"<p>study <b>{html.escape(study.study_name)}</b>; template {html.escape(problem.template.describe())}; "
             f"global batch {spec.global_batch}, sequence length {spec.seq_len}, {spec.precision} on {spec.device}; "
             f"budget {format_size(spec.memory_budget)} per rank; strategy {html.escape(strategy)}. Trials: "
             + (", ".join(f"{n} {html.escape(s)}" for s, n in counts.items()) or "none yet") + ".</p>",
             "<h2>Best point</h2>"]
    if best is None:
        parts.append("<p>No point ran ok yet.</p>")
    else:
        parts.append(_best_table(problem, best, confirmed, out_of_the_box(study, best, confirmed)))
        parts.append("<p>Train it:</p>" + f"<code>slapo-tune train --schedule {html.escape(shlex.quote(str(out / 'best_schedule.json')))}</code>")
    if command:
        parts.append("<p>Reproduce the study (run on the same study, it resumes it):</p>"
                     f"<code>{html.escape(command)}</code>")
    figures = _figures(frame, study, problem, best) if len(frame) else {}
    if figures:
        parts.append("<h2>Plots</h2>")
    for name, (fig, caption) in figures.items():
        path = out / f"{name}.png"
        atomic_write(path, lambda tmp, fig=fig: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    if len(frame):
        parts.append(_warnings(frame))
        parts.append("<h2>Trials</h2><p class='dim'>peaks per rank; a pruned point's predicted peak is the one it "
                     "was pruned at; <b>bold</b>: the crowned point; repeats are not listed.</p>")
        parts.append(_trials_table(frame, _varying(problem)))
    parts.append("</body></html>")
    atomic_write_text(out / "report.html", "\n".join(parts))
