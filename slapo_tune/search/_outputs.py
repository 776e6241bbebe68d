"""The output folder, rewritten (atomically) after every trial, from the study alone: a killed
driver loses nothing that was told, and a resumed one rewrites the same files.

- ``trials.csv`` (and ``trials.parquet`` where pyarrow is installed): one row per trial;
- ``best_schedule.json``: the crowned point as a schedule file (the fastest confirmed one where the
  study's confirmation stands, see ``._confirm``; else the fastest trial), with the baseline's
  measured figure beside its own and the gain over it (``._report.out_of_the_box``);
- ``report.html`` (self-contained, images inlined; see ``._report``) with the PNGs beside it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from search_spaces import recorded_template

from .._atomic import atomic_write
from .._partition import rank_block_counts
from ..errors import UsageError
from ..models import config_fingerprint
from ..plan import TrialStatus, knob_value
from ..problem import Problem, ProblemSpec
from ..schedule_file import make_schedule, write_schedule
from ._confirm import crowned, recorded
from ._known import trial_status
from ._report import out_of_the_box, write_report
from ._storage import is_journal, open_storage, redact

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

LAUNCHED = [s.value for s in TrialStatus if s.launched]
# the study attribute holding what rebuilds the outputs from the study alone: the problem (its
# settings, resolved), the strategy and the command that resumes the study (password hidden)
OUTPUTS_ATTR = "outputs"


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
               # where each rank ran, in rank order (see TrialResult.nodes)
               "nodes": " ".join(result.get("nodes") or []),
               "reason": t.user_attrs.get("reason") or result.get("error") or "",
               "warnings": "; ".join(result.get("warnings") or []), "retry_of": t.user_attrs.get("retry_of"),
               "confirmed_throughput": figures.get(str(t.number), {}).get("samples_per_s"),
               "confirmed_spread": figures.get(str(t.number), {}).get("spread"),
               "crowned": best is not None and t.number == best.number}
        rows.append(row)
    return rows


def _median(values):
    import statistics

    return statistics.median(values) if values else None


REPORT_INTERVAL = 15.0  # seconds between report redraws while a study runs (plots cost ~1 s)
REPORT_SHARE = 0.05


class Outputs:
    """The output folder, as an Optuna-style callback: ``outputs(study, trial)`` after a told trial
    rewrites the tables and the best schedule, and the report (plots) at most every
    ``REPORT_INTERVAL`` seconds, the first time once the study has run that long (a short study's
    plots, seconds to draw, are drawn once, at its end); :meth:`finish` writes them all, the
    report included."""

    def __init__(self, out: Path, problem: Problem, strategy: str, command: str | None = None) -> None:
        self.out, self.problem, self.strategy, self.command = out, problem, strategy, command
        # the trial best_schedule.json holds, its confirmed figures and the baseline's
        self._schedule_written: tuple | None = None
        self._report_written = time.monotonic()  # when the report was last drawn (or the outputs began)
        self._report_seconds = 0.0  # how long drawing it took

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        self._write(study, final=False)  # the whole table: a trial's row is not all that changes (best, repeats)

    def finish(self, study: Study, report: bool = True) -> None:
        """Write every output (``report``: the report and its plots too)."""
        self._write(study, final=True, report=report)

    def _write(self, study: Study, final: bool, report: bool = True) -> None:
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
        baseline = out_of_the_box(study, best, confirmed)
        if best is not None and self._schedule_written != (best.number, confirmed, baseline):
            write_schedule(self.out / "best_schedule.json",
                           schedule_of(self.problem, study.study_name, best, confirmed, baseline))
            self._schedule_written = (best.number, confirmed, baseline)
        now = time.monotonic()
        # at most REPORT_SHARE of the driver's time on plots, however fast trials come back
        interval = max(REPORT_INTERVAL, self._report_seconds / REPORT_SHARE)
        if report and (final or now - self._report_written >= interval):
            write_report(self.out, frame, self.problem, study, self.strategy, best, confirmed, self.command)
            self._report_written, self._report_seconds = now, time.monotonic() - now


MEASURED_GAINS = ("same", "side by side", "trials")  # out_of_the_box's ``how`` where the baseline was measured


def schedule_of(problem: Problem, study_name: str, trial: FrozenTrial, confirmed: dict[str, Any] | None = None,
                baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """The schedule file of ``trial``'s point; its measured figures are the confirmation's
    (``confirmed``: the median of every confirmed step, their spread, and the trial's own figure
    beside them) where it was confirmed; beside them the ``baseline``'s (``._report.out_of_the_box``)
    where it was measured: ``baseline_samples_per_s``, its trial and knobs, ``gain`` and how it
    was had (``gain_how``; side by side: ``gain_low``-``gain_high`` round by round)."""
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
    if baseline is not None and baseline["how"] in MEASURED_GAINS:
        measured.update(baseline_samples_per_s=baseline["samples_per_s"], baseline_trial=baseline["trial"],
                        baseline_knobs=baseline["point"], baseline_spread=(baseline["spreads"] or [None, None])[1],
                        gain=baseline["gain"], gain_how=baseline["how"])
        if baseline["default"] is not None:  # made to fit: the out-of-the-box point it was made from
            measured.update(baseline_made_from=baseline["default"])
        if baseline["how"] == "side by side":
            measured.update(gain_low=baseline["low"], gain_high=baseline["high"], gain_rounds=baseline["rounds"])
    return make_schedule(
        template=problem.template.record(), plan=plan,
        world_size=p.world_size, global_batch=p.global_batch, seq_len=p.seq_len, precision=p.precision, device=p.device,
        model={"name": p.model, "overrides": dict(p.model_overrides),
               "fingerprint": config_fingerprint(problem.config)},
        measured=measured,
        predicted={"peak_memory": predicted.get("peak"), "step_seconds": predicted.get("step_s")},
        study=study_name, stage_blocks=rank_block_counts(problem.info.layers, plan.pp, knob_value(plan, "vpp")),
    )


def baseline_of(measured: dict[str, Any]) -> dict[str, Any] | None:
    """A schedule's ``measured`` baseline figures (written by :func:`schedule_of`) as
    ``._report.out_of_the_box`` gives them (for ``._report.gain_text``); None where it has none."""
    if measured.get("baseline_samples_per_s") is None or measured.get("gain") is None:
        return None
    return {"point": measured.get("baseline_knobs") or {}, "default": measured.get("baseline_made_from"), "fits": True,
            "trial": measured.get("baseline_trial"), "status": TrialStatus.OK.value,
            "samples_per_s": measured["baseline_samples_per_s"], "gain": measured["gain"],
            "low": measured.get("gain_low"), "high": measured.get("gain_high"), "rounds": measured.get("gain_rounds"),
            "how": measured.get("gain_how"), "spreads": [measured.get("spread"), measured.get("baseline_spread")]}


def export(storage: str | None, study_name: str | None, out: Path, report: bool = True,
           space: str | None = None) -> Study:
    """Write ``trials.csv``, ``best_schedule.json`` (and with ``report`` the report) of the study
    ``study_name`` in ``storage`` into ``out``, from the study alone: a study run anywhere (a Ray
    Job, another driver's machine) read back here. ``study_name`` None: the storage's only study.
    Returns the study; UsageError when there is no such study or it was not written by the tuner.
    The study is data: a template file or module it names is loaded only as the user names it
    (``space``, their ``--space``; see :func:`search_spaces.recorded_template`)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    shown = redact(storage or "", storage)
    if storage is None:
        raise UsageError("give the study's storage: --storage URL, --storage-file PATH or $SLAPO_TUNE_STORAGE")
    if is_journal(storage) and not Path(storage.removeprefix("journal:")).is_file():
        raise UsageError(f"no study journal at {storage.removeprefix('journal:')}")
    opened = open_storage(storage, out)
    names = [s.study_name for s in optuna.get_all_study_summaries(opened, include_best_trial=False)]
    if study_name is None:
        if len(names) != 1:
            raise UsageError(f"{shown} holds {len(names)} studies ({', '.join(names) or 'none'}): name one with --study")
        study_name = names[0]
    if study_name not in names:
        raise UsageError(f"no study '{study_name}' in {shown} (it holds: {', '.join(names) or 'none'})")
    study = optuna.load_study(study_name=study_name, storage=opened)
    recorded = study.user_attrs.get(OUTPUTS_ATTR)
    if recorded is None:
        raise UsageError(f"study '{study_name}' in {shown} was not written by slapo-tune tune "
                         f"(or by a version that kept its outputs in the results folder only)")
    where = f"study '{study_name}' in {shown}"
    spec = ProblemSpec.from_record(recorded.get("problem") if isinstance(recorded, dict) else None, where)
    template = recorded_template(spec.template, spec.template_sha256, space, where)
    problem = spec.resolve(template=template)
    Outputs(out, problem, str(recorded.get("strategy", "?")), recorded.get("command")).finish(study, report=report)
    return study
