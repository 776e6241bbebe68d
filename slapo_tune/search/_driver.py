"""The tuning driver: owns the Optuna study (ask/tell), prunes with the cost model before any
launch, keeps up to C trials in flight on a runner, and rewrites the outputs after every trial.

Every asked point ends in exactly one of: *launched* (a runner measured it), *pruned* (the cost
model says it cannot fit; never launched), *duplicate* (already known: answered from the study,
never launched twice). Out-of-memory and pruned points are told to Optuna as infeasible
(constraint > 0), so constraint-aware samplers stop proposing their neighbourhood.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SlapoTuneError, UsageError
from ..space import Point, format_point, point_key
from ._strategies import make_strategy, random_unknown

FINISHED = ("ok", "oom", "crash", "timeout")
MAX_DUPLICATES = 3  # consecutive known points from a sampler before the driver picks one itself


@dataclass
class TuneConfig:
    """Everything a tuning run needs (the CLI's arguments, resolved)."""

    model: str
    world_size: int
    memory_budget: int
    out: Path
    model_overrides: dict[str, Any] = field(default_factory=dict)
    space: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    dtype: str = "fp32"
    device: str = "cpu"
    trials: int = 20
    time_budget: float | None = None
    strategy: str = "tpe"
    objective: str = "throughput"
    storage: str | None = None
    study: str | None = None
    concurrency: int = 1
    seed: int = 0
    prune: str = "exact"  # exact | analytic | none
    patience: int | None = None
    warmup_steps: int = 1
    measured_steps: int = 3
    trial_time_limit: float = 300.0

    @property
    def multi_objective(self) -> bool:
        return self.objective == "throughput,memory"


@dataclass
class Progress:
    launched: int = 0
    pruned: int = 0
    failed: int = 0
    duplicates: int = 0
    best: float | None = None
    best_point: Point | None = None
    started: float = field(default_factory=time.monotonic)


class Tuner:
    """One tuning run. ``runner`` executes trials (local, Ray, replay); ``report`` is called with
    an event dict after every told trial (progress bars, JSON lines)."""

    def __init__(self, config: TuneConfig, runner, *, report: Callable[[dict], None] | None = None,
                 write_outputs: bool = True):
        from search_spaces import load_template, template_for

        from ..cost_model import CostModel, hardware
        from ..realize import ModelSpec
        from ..template import ModelInfo, Workload

        self.config, self.runner, self.report = config, runner, report or (lambda _event: None)
        self.write = write_outputs
        self.spec = ModelSpec(config.model, dict(config.model_overrides))
        model_config = self.spec.config()
        self.template = load_template(config.space) if config.space else template_for(model_config)
        self.info = ModelInfo.from_config(model_config)
        gb = config.global_batch or 8 * config.world_size
        seq = config.seq_len or min(128, getattr(model_config, "max_position_embeddings", 128) or 128)
        self.workload = Workload(config.world_size, gb, seq, config.dtype)
        self.space = self.template.space(self.info, self.workload)
        if next(self.space.enumerate(), None) is None:
            raise UsageError(f"no legal schedule for {config.model} on {config.world_size} ranks with global batch {gb}")
        self.cost = CostModel(self.spec, self.template, self.workload, hardware(config.device))
        self.strategy = make_strategy(config.strategy, self.space, config.seed, rank=self._predicted_throughput)
        self.known: dict[str, str] = {}  # point key -> status of every point told so far
        self.values: dict[str, Any] = {}  # point key -> the value told for it (answers duplicates)
        self.progress = Progress()
        self.study = None
        self._in_flight: dict[cf.Future, tuple[Any, Point, dict]] = {}
        self._since_best = 0  # told trials since the best improved (early stop)

    # ------------------------------------------------------------------ cost model
    def _predicted_throughput(self, point: Point) -> float:
        if not self.cost.verdict(point, self.config.memory_budget).fits:
            return 0.0
        return self.cost.time(point).throughput(self.workload)

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
    def open_study(self):
        import optuna

        from ._storage import open_storage

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = open_storage(self.config.storage, self.config.out)
        directions = ["maximize", "minimize"] if self.config.multi_objective else ["maximize"]
        name = self.config.study or self.config.out.name
        sampler = self.strategy.sampler(self.config.multi_objective)
        self.study = optuna.create_study(study_name=name, storage=storage, directions=directions, sampler=sampler,
                                         load_if_exists=True)
        self._check_same_study()
        self._recover()
        return self.study

    def _check_same_study(self) -> None:
        stored = self.study.user_attrs.get("context")
        context = {"model": self.config.model, "overrides": self.config.model_overrides,
                   "template": self.template.describe(), "world_size": self.config.world_size,
                   "global_batch": self.workload.global_batch, "seq_len": self.workload.seq_len,
                   "dtype": self.config.dtype, "device": self.config.device,
                   "memory_budget": self.config.memory_budget, "objective": self.config.objective}
        if stored is None:
            self.study.set_user_attr("context", context)
        elif stored != context:
            diff = ", ".join(f"{k}: {stored.get(k)!r} -> {v!r}" for k, v in context.items() if stored.get(k) != v)
            raise UsageError(f"study '{self.study.study_name}' was started with other settings ({diff}); "
                             f"use another --out or --study")

    def _recover(self) -> None:
        """Rebuild what is known from the study; trials left RUNNING by a killed driver are marked
        failed and their points queued again, once."""
        from optuna.trial import TrialState

        storage = self.study._storage
        retried = {t.user_attrs.get("retry_of") for t in self.study.trials}
        for t in self.study.get_trials(deepcopy=False):
            if t.state == TrialState.RUNNING:
                storage.set_trial_user_attr(t._trial_id, "status", "interrupted")
                storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                point = t.user_attrs.get("point")
                if point and t.number not in retried and "retry_of" not in t.user_attrs:
                    self.study.enqueue_trial(self.space.params_of(point), user_attrs={"retry_of": t.number})
            elif t.state in (TrialState.COMPLETE, TrialState.FAIL):
                status, point = t.user_attrs.get("status"), t.user_attrs.get("point")
                if point is None or status in (None, "interrupted", "duplicate"):
                    continue
                key = point_key(point)
                self.known[key] = status
                if t.state == TrialState.COMPLETE:
                    self.values[key] = t.values
                if status in FINISHED:
                    self.progress.launched += 1
                    self.progress.failed += status in ("crash", "timeout")
                    if status == "ok":
                        self._update_best(point, t.values[0])
                elif status == "pruned":
                    self.progress.pruned += 1
        self._since_best = max(0, self._since_best)

    def _update_best(self, point: Point, value: float) -> None:
        if self.progress.best is None or value > self.progress.best:
            self.progress.best, self.progress.best_point = value, point
            self._since_best = -1  # the caller counts this trial

    # ------------------------------------------------------------------ ask / tell
    def _ask(self):
        """(trial, point) for the next point, or None when the space has nothing left to try."""
        from optuna.trial import TrialState

        duplicates = 0
        while True:
            proposal = self.strategy.propose(self.known | self._in_flight_keys())
            waiting = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
            if proposal is None and not waiting and self.strategy.name in ("grid", "model", "frontier"):
                return None
            if proposal is not None and not waiting:
                self.study.enqueue_trial(self.space.params_of(proposal))
            if duplicates >= MAX_DUPLICATES and not waiting:
                forced = random_unknown(self.space, self.known | self._in_flight_keys(), self.config.seed)
                if forced is None:
                    return None
                self.study.enqueue_trial(self.space.params_of(forced))
                duplicates = 0
            trial = self.study.ask()
            point = self.space.suggest(trial)
            trial.set_user_attr("point", point)
            key = point_key(point)
            if key in self.known or key in self._in_flight_keys():
                duplicates += 1
                self._tell_duplicate(trial, key)
                continue
            return trial, point

    def _in_flight_keys(self) -> dict[str, str]:
        return {point_key(p): "running" for _, p, _ in self._in_flight.values()}

    def _tell_duplicate(self, trial, key: str) -> None:
        from optuna.trial import TrialState

        self.progress.duplicates += 1
        trial.set_user_attr("status", "duplicate")
        values = self.values.get(key)
        if values is None:  # failed or still running: nothing to learn from a repeat
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            trial.set_constraint("memory", 1.0 if self.known.get(key) in ("oom", "pruned") else 0.0)
            self.study.tell(trial, values)

    def _infeasible_values(self) -> list[float]:
        return [0.0, float(self.config.memory_budget) * 4] if self.config.multi_objective else [0.0]

    def _tell_pruned(self, trial, point: Point, reason: str, predicted: int) -> None:
        key = point_key(point)
        trial.set_user_attr("status", "pruned")
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("predicted", self._predict(point) | {"pruned_peak": predicted})
        trial.set_constraint("memory", predicted / self.config.memory_budget - 1.0)
        values = self._infeasible_values()
        self.study.tell(trial, values)
        self.known[key], self.values[key] = "pruned", values
        self.progress.pruned += 1
        self._event("pruned", point, reason=reason)

    def _tell_result(self, trial, point: Point, result, predicted: dict[str, Any]) -> None:
        from optuna.trial import TrialState

        key = point_key(point)
        data = result.to_dict()
        data.pop("knobs", None)
        trial.set_user_attr("status", result.status)
        trial.set_user_attr("result", data)
        trial.set_user_attr("predicted", predicted)
        self.known[key] = result.status
        self.progress.launched += 1
        if result.status == "ok":
            peak = max(result.peak_memory)
            values = [result.samples_per_s, float(peak)] if self.config.multi_objective else [result.samples_per_s]
            trial.set_constraint("memory", 0.0)
            self.study.tell(trial, values)
            self.values[key] = values
            self._update_best(point, result.samples_per_s)
            self._since_best += 1
        elif result.status == "oom":
            values = self._infeasible_values()
            trial.set_constraint("memory", 1.0)
            self.study.tell(trial, values)
            self.values[key] = values
            self._since_best += 1
        else:
            self.progress.failed += 1
            self.study.tell(trial, state=TrialState.FAIL)
            self._since_best += 1
        self._event(result.status, point, result=data)

    def _event(self, kind: str, point: Point, **extra) -> None:
        p = self.progress
        self.report({"event": kind, "point": format_point(point), "launched": p.launched, "pruned": p.pruned,
                     "failed": p.failed, "duplicates": p.duplicates, "best": p.best,
                     "best_point": format_point(p.best_point) if p.best_point else None,
                     "elapsed": time.monotonic() - p.started, "target": self.config.trials, **extra})
        if self.write and kind != "launched":  # a launch changes no output: nothing is told yet
            from ._outputs import write_outputs

            write_outputs(self)

    # ------------------------------------------------------------------ loop
    def trial_spec(self, trial_number: int, point: Point):
        from runners.trial import TrialSpec

        return TrialSpec(model=self.config.model, model_overrides=dict(self.config.model_overrides), knobs=point,
                         world_size=self.config.world_size, global_batch=self.workload.global_batch,
                         seq_len=self.workload.seq_len, dtype=self.config.dtype,
                         memory_budget=self.config.memory_budget, template=self.template.name
                         if self.config.space is None else self.config.space,
                         warmup_steps=self.config.warmup_steps, measured_steps=self.config.measured_steps,
                         time_limit=self.config.trial_time_limit, device=self.config.device, seed=self.config.seed,
                         name=f"trial-{trial_number}")

    def _stop_reason(self) -> str | None:
        c, p = self.config, self.progress
        if p.launched + len(self._in_flight) >= c.trials:
            return "trials"
        if c.time_budget is not None and time.monotonic() - p.started >= c.time_budget:
            return "time budget"
        if c.patience is not None and self._since_best >= c.patience:
            return "no improvement"
        return None

    def run(self) -> dict[str, Any]:
        """Tune until the trial or time budget is spent (or nothing is left); returns a summary."""
        if self.study is None:
            self.open_study()
        stop = None
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
                        self._event("launched", point)
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
            if self.write:
                from ._outputs import write_outputs

                write_outputs(self, final=True)
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

    def summary(self, stop: str) -> dict[str, Any]:
        p = self.progress
        return {"stop": stop, "launched": p.launched, "pruned": p.pruned, "failed": p.failed,
                "duplicates": p.duplicates, "best": p.best, "best_point": p.best_point,
                "elapsed": time.monotonic() - p.started, "study": self.study.study_name if self.study else None,
                "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.config).items()}}
