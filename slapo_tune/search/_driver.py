"""The tuning driver: owns the Optuna study (ask/tell), prunes with the cost model before any
launch, keeps up to C trials in flight on a runner, and rewrites the outputs after every trial.

Every asked point ends in exactly one of: *launched* (a runner measured it), *pruned* (the cost
model says it cannot fit; never launched), *duplicate* (already known: answered from the study,
never launched twice). Out-of-memory and pruned points are told to Optuna as infeasible
(constraint > 0), so constraint-aware samplers stop proposing their neighbourhood. A launch the
cluster failed (``lost``, ``placement_timeout``) teaches nothing about the point: it is told as
failed, not infeasible, spends no trial of the budget, and its point is queued again once.

The study's first trial is its *baseline*: the out-of-the-box schedule (``plan.OUT_OF_THE_BOX``),
or where the cost model says it cannot fit, the default made to fit (the fitting point that
changes the fewest of its knobs, the fastest predicted of those). Confirmation measures it again
beside the candidates, so the gain the summary states is measured side by side (see ``._confirm``).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cost_model import CostModel, hardware, hardware_for
from ..cost_model.ranking import Fitting, fitting_points
from ..device import device_setup
from ..errors import SlapoTuneError, UsageError
from ..plan import OUT_OF_THE_BOX, TrialStatus
from ..precision import LEGACY_DTYPES
from ..problem import Problem, ProblemSpec
from ..space import Point, format_point, point_key
from ._confirm import (
    BASELINE,
    CONFIRM_ROUNDS,
    RECORD,
    baseline_trial,
    candidates,
    confirmation,
    contenders,
    crowned,
    measured_side_by_side,
    recorded,
    side_by_side_gain,
    why_confirmed,
)
from ._constraints import record_constraint
from ._known import KnownReader, trial_status
from ._outputs import OUTPUTS_ATTR, Outputs
from ._report import out_of_the_box, statuses, tune_command
from ._shared import driver_name, held_elsewhere, holds, other_driver_live, register
from ._storage import is_journal, journal_path, open_storage, redact
from ._strategies import DEFAULT_STRATEGY, Strategy, make_strategy, random_unknown

if TYPE_CHECKING:
    from optuna import Study
    from optuna.samplers import BaseSampler
    from optuna.trial import Trial

    from ..cost_model import Predictions

MAX_DUPLICATES = 3  # consecutive known points from a sampler before the driver picks one itself
# infrastructure failures in a row, per trial in flight, after which the study stops: every point
# is retried once, so a cluster that fails every trial would otherwise be asked forever
INFRA_IN_A_ROW = 3
# fitting points (by the analytic verdict) checked by the tuner's own pruning, nearest first, for
# the default made to fit: the analytic verdict is optimistic, exact mode may refuse a few
MADE_TO_FIT_TRIES = 20


@dataclass
class TuneConfig:
    """Everything a tuning run needs besides the problem's own settings (the CLI's arguments,
    resolved)."""

    problem: ProblemSpec  # model, template, workload, device and the memory budget (required here)
    out: Path
    trials: int = 20
    time_budget: float | None = None
    strategy: str = DEFAULT_STRATEGY
    objective: str = "throughput"
    storage: str | None = None
    # how the storage URL was given, for the command that resumes the study: read from this
    # --storage-file, or from $SLAPO_TUNE_STORAGE (neither: --storage, or the journal in ``out``)
    storage_file: str | None = None
    storage_from_environment: bool = False
    study: str | None = None
    concurrency: int = 1
    seed: int = 0
    prune: str = "exact"  # exact | analytic | none
    patience: int | None = None
    warmup_steps: int = 1
    measured_steps: int = 3
    trial_time_limit: float = 300.0
    # the cost model's hardware preset (cpu, a100-80gb, ...; see slapo_tune.cost_model.hardware);
    # None: the devices trials run on (this CPU measured, or the visible GPU's preset)
    hardware: str | None = None
    # knobs held at a value (``tune --knobs tp=8,zero=3``): the search explores the others (a
    # Tuner given a resolved problem takes it as pinned to these: Problem.pinned)
    knobs: dict[str, Any] = field(default_factory=dict)
    # candidates measured again side by side before one is crowned (``tune --confirm N``; 0: off;
    # see ._confirm), in this many alternating rounds of a trial's steps each
    confirm: int = 3
    confirm_rounds: int = CONFIRM_ROUNDS
    # the out-of-the-box schedule (or the default made to fit) run as the study's first trial and
    # measured again beside the candidates: the gain the summary states is measured, not predicted
    baseline: bool = True

    @property
    def multi_objective(self) -> bool:
        return self.objective == "throughput,memory"

    @property
    def memory_budget(self) -> int:
        return self.problem.memory_budget


@dataclass
class Progress:
    """The counts every event reports: launched, pruned and failed trials and infrastructure
    failures over the whole study, repeats, patience (``since_best``) and infrastructure failures
    in a row over this run."""

    launched: int = 0
    pruned: int = 0
    failed: int = 0
    infrastructure: int = 0  # lost / placement_timeout: not trials of the budget (retried once)
    infrastructure_in_a_row: int = 0
    duplicates: int = 0
    best: float | None = None
    best_point: Point | None = None
    since_best: int = 0  # launched trials since the best improved (early stop)
    resumed: int = 0  # launched trials the study had before this run (a resumed one's ETA counts the rest)
    started: float = field(default_factory=time.monotonic)

    def count(self, status: TrialStatus, point: Point, value: float | None = None) -> None:
        """Count one told trial (``value``: its throughput when it ran ok)."""
        if status.infrastructure:
            self.infrastructure += 1
            self.infrastructure_in_a_row += 1
        elif status.launched or status is TrialStatus.INVALID:  # a point the runner refused spent its trial too
            self.infrastructure_in_a_row = 0
            self.launched += 1
            self.failed += status.failed or status is TrialStatus.INVALID
            self.since_best += 1
            if status is TrialStatus.OK and (self.best is None or value > self.best):  # the first to reach it
                self.best, self.best_point, self.since_best = value, point, 0
        elif status is TrialStatus.PRUNED:
            self.pruned += 1
        elif status is TrialStatus.DUPLICATE:
            self.duplicates += 1


class Tuner:
    """One tuning run. ``runner`` executes trials (local, Ray, replay); ``report`` is called with
    an event dict after every launch and every told trial (progress bars, JSON lines);
    ``sampler`` replaces the strategy the config names (a :class:`Strategy`: tests script one).

    Building one touches nothing outside it: the study is opened (created or loaded from its
    storage, this driver registered in it, interrupted trials recovered, the baseline recorded)
    by :meth:`open`, which the first use of :attr:`study` and :meth:`run` call."""

    def __init__(self, config: TuneConfig, runner, *, problem: Problem | None = None,
                 report: Callable[[dict], None] | None = None, write_outputs: bool = True,
                 sampler: BaseSampler | None = None, cost: CostModel | None = None):
        if not config.problem.memory_budget:
            raise UsageError("tuning needs a memory budget per rank")
        # a given problem is the caller's, resolved and pinned (the CLI pins before anything starts)
        self.problem = problem or config.problem.resolve().pinned(config.knobs)
        self.config = replace(config, problem=self.problem.spec)  # the problem's defaults filled in
        self.runner, self.report = runner, report or (lambda _event: None)
        self.space, self.workload, self.template = self.problem.space, self.problem.workload, self.problem.template
        # a given cost model is the caller's, of this problem on the config's hardware (the CLI made it
        # to check that something fits before anything started)
        self.cost = cost or CostModel(self.problem, hardware(config.hardware) if config.hardware
                                      else hardware_for(device_setup(self.problem.spec.device, here=False))[0])
        self._known = KnownReader()  # what the study knows: point key -> status, told values, running
        self.driver = driver_name()  # (other drivers on the study leave its running trials alone)
        self.sampler: Strategy = sampler or make_strategy(config.strategy, self.problem, config.seed,
                                                          predict=self._predictions, known=self._known,
                                                          fitting=self._fitting)
        self.outputs = (Outputs(self.config.out, self.problem, self.config.strategy, self._command())
                        if write_outputs else None)
        self.progress = Progress()
        self.confirm_seconds = 0.0  # how long this run's confirmation took
        self._in_flight: dict[cf.Future, tuple[Trial, Point, dict]] = {}
        self._study: Study | None = None

    @property
    def study(self) -> Study:
        """The study, opened on first use (:meth:`open`)."""
        return self.open()

    def open(self) -> Study:
        """Open the study once: create or load it, register this driver, recover the trials a
        killed driver left running, record the baseline. Returns it."""
        if self._study is None:
            self._study = self._open_study()
            self._record_out_of_the_box()
        return self._study

    def _command(self) -> str:
        """The tune command that runs this study again (resumes it), its storage's password hidden."""
        return tune_command(self.config)

    # ------------------------------------------------------------------ cost model
    def _predictions(self, points: list[Point]) -> Predictions:
        """The cost model's verdict, peak and throughput (0 where a point cannot fit) of each of
        ``points``, evaluated together: the model-ranked strategies predict the whole space."""
        return self.cost.predictions(points, self.config.memory_budget)

    def _fitting(self) -> Fitting:
        """The points of the space the analytic verdict lets through, with their predictions, found
        without listing the others (``ranking.fitting_points``): what the model-ranked strategies
        rank of a large model's space."""
        return fitting_points(self.cost, self.space, self.config.memory_budget)

    def _predict(self, point: Point) -> dict[str, Any]:
        mem = self.cost.memory(point)
        timing = self.cost.time(point)
        return {"peak": mem.peak, "lower": mem.lower, "step_s": timing.step,
                "throughput": timing.throughput(self.workload)}

    def _prune_reason(self, point: Point) -> tuple[str, int] | None:
        """(reason, predicted peak) when the point cannot fit the budget; None when it may."""
        if self.config.prune == "none":
            return None
        budget = self.config.memory_budget
        verdict = self.cost.verdict(point, budget)
        if not verdict.fits:
            return verdict.reason, verdict.predicted
        if self.config.prune == "exact":
            verdict = self.cost.verdict(point, budget, exact=True)
            if not verdict.fits:
                return verdict.reason, verdict.predicted
        return None

    # ------------------------------------------------------------------ study
    def _open_study(self) -> Study:
        import optuna

        # optuna-free: every --help imports this module (the tune command imports the tuner); _samplers imports optuna
        from ._samplers import LegalDomains

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = open_storage(self.config.storage, self.config.out)
        self._check_not_emptied(storage)
        directions = ["maximize", "minimize"] if self.config.multi_objective else ["maximize"]
        name = self.config.study or self.config.out.name
        study = optuna.create_study(study_name=name, storage=storage, directions=directions,
                                    sampler=LegalDomains(self.sampler, self.space, self.config.seed),
                                    load_if_exists=True)
        self._check_same_study(study)
        # what rebuilds the outputs from the study alone, anywhere (``slapo-tune export``)
        study.set_user_attr(OUTPUTS_ATTR, {"problem": asdict(self.problem.spec), "strategy": self.config.strategy,
                                           "command": self._command()})
        metrics = ["samples/s", "peak memory (bytes)"][:len(directions)]
        if study.metric_names != metrics:  # named for optuna-dashboard's plots
            with warnings.catch_warnings():  # experimental since Optuna 3.2, unchanged since
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(metrics)
        register(study, self.driver)
        self._recover(study)
        return study

    def _check_not_emptied(self, storage) -> None:
        """Refuse to begin a new study in a journal holding none while the output folder's
        ``trials.csv`` lists trials: the journal was emptied, cut within its first record or
        replaced, and a new study would overwrite the outputs of the one it held."""
        import csv

        # optuna-free: every --help imports this module (the tune command imports the tuner); _journal imports optuna
        from ._journal import salvage_command

        table = self.config.out / "trials.csv"
        if self.outputs is None or not is_journal(self.config.storage) or storage.get_all_studies() \
                or not table.is_file():
            return
        with table.open(newline="") as f:
            listed = sum(1 for _ in csv.reader(f)) - 1
        if listed > 0:
            journal = journal_path(self.config.storage, self.config.out)
            raise UsageError(f"the study journal {journal} holds no study, but {table} lists {listed} trial(s) of "
                             f"one: the journal was emptied, cut, removed or replaced (check it: {salvage_command(journal)}; "
                             f"a backup may hold the study); to begin a new study there, remove {table}")

    def _record_out_of_the_box(self) -> None:
        """Record the baseline in the study: the out-of-the-box schedule (``plan.OUT_OF_THE_BOX``),
        or where it cannot fit, the default made to fit (:meth:`_made_to_fit`; the out-of-the-box
        point is then kept as ``out_of_the_box``), with its prediction; the summary and the report
        compare the crowned point with it (see ``_report.out_of_the_box``). Nothing where this
        space has no such point (pinned away)."""
        try:
            point = self.space.complete(OUT_OF_THE_BOX)
        except UsageError:
            return
        stored = self.study.user_attrs.get(BASELINE) or {}
        record: dict[str, Any] = {"point": point, "fits": self._fits(point)}
        if not record["fits"]:
            # the same problem and budget (_check_same_study) make the same choice: not searched again
            fitted = stored["point"] if stored.get("out_of_the_box") == point else self._made_to_fit(point)
            if fitted is not None:
                record = {"point": fitted, "fits": True, "out_of_the_box": point}
        record["predicted"] = self._predict(record["point"])
        if stored != record:
            self.study.set_user_attr(BASELINE, record)

    def _fits(self, point: Point) -> bool:
        """Whether ``point`` fits the budget by the tuner's pruning (:meth:`_prune_reason`): the
        analytic verdict, then in exact mode the exact one (analytic alone where pruning is off).
        The exact verdict only where the analytic one lets the point through: a large model's
        default that cannot fit by far took a minute's fake step to be refused again."""
        budget = self.config.memory_budget
        if not self.cost.verdict(point, budget).fits:
            return False
        return self.config.prune != "exact" or self.cost.verdict(point, budget, exact=True).fits

    def _made_to_fit(self, default: Point) -> Point | None:
        """The point a user makes ``default`` fit the budget with: of the points that fit, one
        that changes the fewest of its knobs, the fastest predicted of those; None if none fits.

        The first :data:`MADE_TO_FIT_TRIES` of the points the analytic verdict lets through, in
        that order (then the space's), are checked by the tuner's own pruning. The space is walked
        by the number of knobs changed (:meth:`Space.differing`), the points of each number
        predicted together, until one is found or the tries are spent: not the whole space listed
        and predicted (a large model's millions of points, minutes)."""
        tried = 0
        for changes in range(len(default) + 1):
            points = list(self.space.differing(default, changes))
            if not points:
                continue
            predicted = self._predictions(points)
            fitting = [i for i, fits in enumerate(predicted.fits) if fits]
            for i in sorted(fitting, key=lambda i: (-predicted.throughputs[i], i)):
                if tried == MADE_TO_FIT_TRIES:
                    return None
                tried += 1
                if self._fits(points[i]):
                    return points[i]
        return None

    def _queue_baseline(self) -> None:
        """Queue the baseline as the next trial (the study's first) unless the study has a trial
        of it already, queued, running or told (a resumed study), it cannot fit, or no trial is
        left to run it (a finished study resumed: nothing is left queued)."""
        record = self.study.user_attrs.get(BASELINE)
        if not self.config.baseline or not record or not record["fits"] or self.progress.launched >= self.config.trials:
            return
        key = point_key(record["point"])
        for t in self.study.get_trials(deepcopy=False):
            point = t.user_attrs.get("point")
            if t.user_attrs.get("baseline") or (point is not None and point_key(point) == key):
                return
        self.study.enqueue_trial(self.space.params_of(record["point"]), user_attrs={"baseline": True})

    def _check_same_study(self, study: Study) -> None:
        stored = study.user_attrs.get("context")
        if stored is not None and "dtype" in stored:  # a study begun before precisions had names
            stored = {("precision" if k == "dtype" else k): LEGACY_DTYPES.get(v, v) if k == "dtype" else v
                      for k, v in stored.items()}
        p = self.problem.spec
        context = {"model": p.model, "overrides": p.model_overrides, "template": self.template.describe(),
                   "world_size": p.world_size, "global_batch": p.global_batch, "seq_len": p.seq_len,
                   "precision": p.precision, "device": p.device, "memory_budget": p.memory_budget,
                   "objective": self.config.objective}
        if self.config.knobs:  # (absent when nothing is pinned: studies begun before pins match)
            context["knobs"] = {k: str(v) for k, v in self.config.knobs.items()}
        if stored is None:
            study.set_user_attr("context", context)
        elif stored != context:
            diff = ", ".join(f"{k}: {stored.get(k)!r} -> {context.get(k)!r}" for k in dict.fromkeys([*context, *stored])
                             if stored.get(k) != context.get(k))
            raise UsageError(f"study '{study.study_name}' was started with other settings ({diff}); "
                             f"use another --out or --study")

    def _recover(self, study: Study) -> None:
        """Count the study's trials so far. Trials left RUNNING by a killed driver are failed (they
        then read as interrupted: see ``_known``) and their points queued again, once; so is the
        point of an infrastructure failure whose retry was not queued yet (the driver stopped
        between the two). A trial
        another driver still runs (on this host: its process exists; on another: it started less
        than twice the trial time limit ago) is left to it, and this driver's sampler is reseeded:
        drivers started together with one seed would otherwise propose the same points."""
        from optuna.trial import Trial, TrialState

        trials = study.get_trials(deepcopy=False)
        recent = 2 * self.config.trial_time_limit + 60  # how long a trial of another host's driver may run
        # another registered driver still runs: a trial not named yet (asked a moment ago) is its
        other_live = other_driver_live(study, self.driver, recent)
        retried = {t.user_attrs.get("retry_of") for t in trials}
        others = False
        for t in trials:
            point = t.user_attrs.get("point")
            if t.state == TrialState.RUNNING and held_elsewhere(t, self.driver, other_live, recent):
                others = True
                continue
            if t.state == TrialState.RUNNING:
                if "status" in t.user_attrs:  # told all but its state (killed, or that record salvaged away)
                    Trial(study, t._trial_id).set_user_attr("status", TrialStatus.INTERRUPTED.value)
                study.tell(t.number, state=TrialState.FAIL)
                if point and t.number not in retried and "retry_of" not in t.user_attrs:
                    self._queue_retry(study, t.number, point)
                continue
            status = trial_status(t)  # repeats count in their own run only; invalid points never did on resume
            if point is not None and status is not None and status.infrastructure and t.number not in retried \
                    and "retry_of" not in t.user_attrs:
                self._queue_retry(study, t.number, point)
            if point is not None and status is not None and (status.launched or status.infrastructure
                                                             or status is TrialStatus.PRUNED):
                self.progress.count(status, point, t.values[0] if t.values else None)
        self.progress.since_best = 0  # patience counts this run's trials
        self.progress.resumed = self.progress.launched
        self.progress.infrastructure_in_a_row = 0
        if others and hasattr(self.sampler, "reseed_rng"):
            self.sampler.reseed_rng()

    def _queue_retry(self, study: Study, number: int, point: Point) -> None:
        """Queue trial ``number``'s point again (asked before any new point), once: the retry names
        the trial it retries, and a retry is never retried."""
        study.enqueue_trial(self.space.params_of(point), user_attrs={"retry_of": number})

    # ------------------------------------------------------------------ ask / tell
    def _ask(self) -> tuple[Trial, Point] | None:
        """(trial, point) for the next point, or None when the space has nothing left to try."""
        from optuna.trial import TrialState

        duplicates = 0
        while True:
            known = self._known(self.study)
            if not self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):  # nothing queued
                if self.sampler.is_exhausted(self.study):
                    return None
                if duplicates >= MAX_DUPLICATES:
                    forced = random_unknown(self.space, known, self.config.seed)
                    if forced is None:
                        return None
                    self.study.enqueue_trial(self.space.params_of(forced))
                    duplicates = 0
            trial = self.study.ask()
            point = self.space.suggest(trial)
            trial.set_user_attr("point", point)
            trial.set_user_attr("driver", self.driver)
            key = point_key(point)
            # samplers do not see running trials (TPE offers one promising point to every free slot);
            # another driver on the study may have just named the same point (holds)
            if key in known.status or key in known.running or not holds(self.study, trial.number, key):
                duplicates += 1
                values = known.values.get(key)  # none when it failed or still runs: nothing to learn again
                constraint = None if values is None else 1.0 if known.status[key].infeasible else 0.0
                self._tell(trial, point, TrialStatus.DUPLICATE, values, constraint)
                continue
            return trial, point

    def _infeasible_values(self) -> list[float]:
        return [0.0, float(self.config.memory_budget) * 4] if self.config.multi_objective else [0.0]

    def _tell_pruned(self, trial: Trial, point: Point, reason: str, predicted: int) -> None:
        prediction = self._predict(point) | {"pruned_peak": predicted}
        self._tell(trial, point, TrialStatus.PRUNED, self._infeasible_values(),
                   predicted / self.config.memory_budget - 1.0,
                   attrs={"reason": reason, "predicted": prediction},
                   event={"reason": reason, "predicted": prediction})

    def _tell_result(self, trial: Trial, point: Point, result, predicted: dict[str, Any]) -> None:
        status = TrialStatus(result.status)
        data = result.to_dict()
        data.pop("knobs", None)
        values, constraint = None, None  # failed (a crash, a timeout, an invalid point): nothing learnt
        if status is TrialStatus.OK:
            peak = max(result.peak_memory)
            values = [result.samples_per_s, float(peak)] if self.config.multi_objective else [result.samples_per_s]
            constraint = 0.0
        elif status.infeasible:
            values, constraint = self._infeasible_values(), 1.0
        self._tell(trial, point, status, values, constraint, attrs={"result": data, "predicted": predicted},
                   event={"result": data, "predicted": predicted})
        if status.infrastructure and "retry_of" not in trial.user_attrs:  # the cluster failed: once more, later
            self._queue_retry(self.study, trial.number, point)

    def _tell(self, trial: Trial, point: Point, status: TrialStatus, values: list[float] | None,
              constraint: float | None, attrs: dict[str, Any] | None = None,
              event: dict[str, Any] | None = None) -> None:
        """The one way a trial ends: its status and ``attrs`` recorded, the memory constraint
        set (> 0: infeasible, which TPE reads), ``values`` told (None: failed), the progress counted;
        then, for a trial the outputs show (not a repeat), the event reported and the outputs
        rewritten."""
        from optuna.trial import TrialState

        trial.set_user_attr("status", status.value)
        for name, value in (attrs or {}).items():
            trial.set_user_attr(name, value)
        if constraint is not None:
            record_constraint(trial, constraint)
        told = self.study.tell(trial, values) if values is not None else self.study.tell(trial, state=TrialState.FAIL)
        self.progress.count(status, point, values[0] if values else None)
        if status is TrialStatus.DUPLICATE:  # a repeat changes nothing a user sees: no event, no rewrite
            return
        self._event(status.value, point, trial=trial.number, **(event or {}))
        if self.outputs is not None:
            self.outputs(self.study, told)

    def _event(self, kind: str, point: Point, **extra) -> None:
        p = self.progress
        self.report({"event": kind, "point": format_point(point), "knobs": point, "launched": p.launched,
                     "pruned": p.pruned, "failed": p.failed, "infrastructure": p.infrastructure,
                     "duplicates": p.duplicates, "best": p.best,
                     "best_point": format_point(p.best_point) if p.best_point else None,
                     "elapsed": time.monotonic() - p.started, "resumed": p.resumed, "target": self.config.trials,
                     "time_budget": self.config.time_budget, **extra})

    # ------------------------------------------------------------------ loop
    def trial_spec(self, trial_number: int, point: Point):
        # torch-free: every --help imports this module (the tune command imports the tuner); runners imports torch
        from runners.trial import TrialSpec

        return TrialSpec(problem=self.problem.spec, knobs=point, warmup_steps=self.config.warmup_steps,
                         measured_steps=self.config.measured_steps, time_limit=self.config.trial_time_limit,
                         seed=self.config.seed, name=f"trial-{trial_number}")

    def _stop_reason(self) -> str | None:
        c, p = self.config, self.progress
        if p.launched + len(self._in_flight) >= c.trials:
            return "trials"
        if c.time_budget is not None and time.monotonic() - p.started >= c.time_budget:
            return "time budget"
        if c.patience is not None and p.since_best >= c.patience:
            return "no improvement"
        if p.infrastructure_in_a_row >= INFRA_IN_A_ROW * max(1, c.concurrency):
            return "infrastructure failing"
        return None

    def run(self) -> dict[str, Any]:
        """Tune until the trial or time budget is spent (or nothing is left); returns a summary."""
        stop = None
        self._queue_baseline()
        baseline = self.study.user_attrs.get(BASELINE) or {}
        # the counts a resumed study starts from, and the baseline (the view names its trial)
        self._event("start", {}, baseline_point=baseline.get("point") if self.config.baseline else None,
                    made_to_fit="out_of_the_box" in baseline)
        pool = cf.ThreadPoolExecutor(max_workers=max(1, self.config.concurrency), thread_name_prefix="trial")
        try:
            while True:
                stop = self._stop_reason()
                while stop is None and len(self._in_flight) < self.config.concurrency:
                    asked = self._ask()
                    if asked is None:
                        stop = "space exhausted"
                        break
                    trial, point = asked
                    pruned = self._prune_reason(point)
                    if pruned is not None:
                        self._tell_pruned(trial, point, *pruned)
                    else:
                        predicted = self._predict(point)
                        spec = self.trial_spec(trial.number, point)
                        self._in_flight[pool.submit(self.runner.run, spec)] = (trial, point, predicted)
                        self._event("launched", point, trial=trial.number, predicted=predicted)
                    stop = self._stop_reason()
                if not self._in_flight:
                    break
                remaining = None
                if self.config.time_budget is not None:
                    remaining = max(0.0, self.config.time_budget - (time.monotonic() - self.progress.started))
                done, _ = cf.wait(list(self._in_flight), timeout=remaining, return_when=cf.FIRST_COMPLETED)
                if not done and stop == "time budget":
                    self.runner.cancel()  # the budget is spent: trials in flight end as failures
                    done, _ = cf.wait(list(self._in_flight))
                for future in done:
                    trial, point, predicted = self._in_flight.pop(future)
                    self._tell_result(trial, point, future.result(), predicted)
            if stop not in ("time budget", "infrastructure failing"):  # no time left, or no cluster to run on
                began = time.monotonic()
                self._confirm()
                self.confirm_seconds = time.monotonic() - began
            if self.outputs is not None:
                self.outputs.finish(self.study)
        except OSError as exc:  # the disk is full or the folder read-only: stop, keep what is recorded
            self.runner.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            where = exc.filename or self.config.out
            raise SlapoTuneError(
                f"stopped: cannot write {where} ({exc.strerror or exc}); the trials finished before are kept in "
                "the study and the exported schedule is the last complete one; free space (or fix permissions) "
                "and re-run the same command to resume") from None
        except BaseException:
            self.runner.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return self.summary(stop or "trials")

    # ------------------------------------------------------------------ confirm before crowning
    def _confirm(self) -> None:
        """Measure the candidates again side by side (see ._confirm) and record the confirmation in
        the study; nothing to do when confirmation is off, for a Pareto front (nothing to crown),
        or when the study's standing confirmation already covers the same candidates (a resumed
        study that finished)."""
        limit, rounds = self.config.confirm, self.config.confirm_rounds
        if limit < 1 or rounds < 1 or self.config.multi_objective:
            return
        chosen = candidates(self.study, limit)
        baseline = baseline_trial(self.study) if self.config.baseline else None
        if baseline is not None and trial_status(baseline) is not TrialStatus.OK:
            baseline = None  # it failed as a trial: nothing to measure it against
        standing = recorded(self.study)
        if not chosen or (standing is not None and standing.get("first", standing["candidates"])
                          == [t.number for t in chosen] and standing["rounds"] == rounds
                          and standing.get("baseline") == (baseline.number if baseline else None)):
            return
        record = self._side_by_side(chosen, limit, rounds, baseline, why_confirmed(chosen))
        others = contenders(self.study, record)[:limit - 1]
        if others:  # the crowned trial was lucky: it and the trials that may be faster, side by side
            lucky = next(t for t in chosen if t.number == record["crowned"])
            confirmed_at = record["figures"][str(lucky.number)]["samples_per_s"]
            why = {lucky.number: f"crowned, but confirmed at {confirmed_at:.2f} samples/s, below these trials' figures",
                   **{t.number: "its trial measured faster than that by more than the noise" for t in others}}
            first, chosen = chosen, sorted([lucky, *others], key=lambda t: (-t.values[0], t.number))
            record = {**self._side_by_side(chosen, limit, rounds, baseline, why, widened=True),
                      "first": [t.number for t in first]}
        self.study.set_user_attr(RECORD, record)
        if record["crowned"] is not None:
            figures = record["figures"][str(record["crowned"])]
            crowned = next(t for t in chosen if t.number == record["crowned"])
            self._event("confirmed", crowned.user_attrs["point"], trial=crowned.number,
                        samples_per_s=figures["samples_per_s"], spread=figures["spread"], candidates=len(chosen),
                        steps=len(figures["step_times"]), baseline=record["baseline"],
                        gain=side_by_side_gain(record, crowned.number))

    def _side_by_side(self, chosen: list, limit: int, rounds: int, baseline, why: dict[int, str],
                      widened: bool = False) -> dict[str, Any]:
        """Run the trials ``chosen`` (and the ``baseline`` trial after them) again, in alternating
        rounds (A B C A B C ...: the machine's load falls on all alike), and give the record of
        that confirmation (._confirm.confirmation). ``why``: why each of ``chosen`` is confirmed,
        said once as the phase begins (the ``confirming`` event; ``widened``: a second
        confirmation, see ._confirm.contenders)."""
        import statistics

        measured = measured_side_by_side(chosen, baseline)
        total = rounds * len(measured)
        # before the first run ends, a run is expected to last as long as these trials took
        walls = [(t.user_attrs.get("result") or {}).get("wall_seconds") for t in measured]
        self._event("confirming", {}, rounds=rounds, runs=total, estimate_s=statistics.median(
            [w for w in walls if w] or [0.0]), trials=[
            {"trial": t.number, "samples_per_s": t.values[0],
             "why": why.get(t.number) or "the baseline, for the measured gain"} for t in measured],
            baseline=None if baseline is None else baseline.number, widened=widened)
        runs: dict[int, list] = {t.number: [] for t in measured}
        done = 0
        for round_ in range(1, rounds + 1):
            for t in measured:
                point = t.user_attrs["point"]
                spec = replace(self.trial_spec(t.number, point), name=f"confirm-{t.number}-{round_}",
                               confirm_round=round_)
                where = dict(trial=t.number, round=round_, rounds=rounds, run=done + 1, runs=total)
                self._event("confirm_launched", point, **where)
                result = self.runner.run(spec)
                runs[t.number].append(result)
                done += 1
                self._event("confirm", point, **where, samples_per_s=result.samples_per_s,
                            status=str(result.status), error=result.error, trial_samples_per_s=t.values[0])
        return confirmation(chosen, runs, self.problem.spec.global_batch, limit, rounds, baseline)

    def summary(self, stop: str) -> dict[str, Any]:
        """The run's counts, and the point crowned in the whole study (other drivers' trials too):
        the confirmed one, with its confirmed figures, where the study's confirmation stands."""
        p = self.progress
        best, confirmed = crowned(self.study)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.config).items()}
        if self.config.storage:  # the summary is printed (the done event): never the storage's password
            config["storage"] = redact(self.config.storage, self.config.storage)
        return {"stop": stop, "launched": p.launched, "pruned": p.pruned, "failed": p.failed,
                "infrastructure": p.infrastructure, "duplicates": p.duplicates,
                "best": (confirmed["samples_per_s"] if confirmed else best.values[0]) if best else None,
                "best_point": best.user_attrs["point"] if best else None, "confirmed": confirmed,
                "best_peak": max((best.user_attrs.get("result") or {}).get("peak_memory") or [0]) or None if best else None,
                "elapsed": time.monotonic() - p.started, "confirm_seconds": self.confirm_seconds,
                "study": self.study.study_name, "config": config,
                "by_status": statuses(self.study), "out_of_the_box": out_of_the_box(self.study, best, confirmed)}
