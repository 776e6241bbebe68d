"""Use an exported schedule in a training job: ``load_schedule`` and ``apply_schedule``.

``load_schedule`` checks everything a file can get wrong before any process group or model exists
(format, version, template, knob legality for the model and world size, the model's config
fingerprint), so a bad file costs one line, not a hung job. ``apply_schedule`` then goes through
the same path as trials (:class:`slapo_tune.session.Session`): what was measured is what trains.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from search_spaces import recorded_template

from ._partition import rank_block_counts
from .errors import ModelMismatchError, UsageError
from .models import ModelSpec, config_fingerprint
from .plan import Plan, Workload, knob_value
from .problem import Problem, ProblemSpec
from .schedule_file import read_schedule, validate
from .session import Session
from .template import Template

log = logging.getLogger("slapo_tune")


@dataclass
class LoadedSchedule:
    """A validated schedule file: the problem it solves and its plan."""

    data: dict[str, Any]
    problem: Problem
    plan: Plan
    source: str = ""
    overridden: list[str] = field(default_factory=list)  # checks the user chose to override

    @property
    def template(self) -> Template:
        return self.problem.template

    @property
    def workload(self) -> Workload:
        return self.problem.workload

    @property
    def model(self) -> ModelSpec:
        return self.problem.model

    @property
    def world_size(self) -> int:
        return self.workload.world_size


def load_schedule(source: str | os.PathLike | Mapping[str, Any], *, model: str | ModelSpec | None = None,
                  world_size: int | None = None, allow_model_mismatch: bool = False,
                  template: Template | None = None, space: str | None = None) -> LoadedSchedule:
    """Read and check a ``best_schedule.json`` (a path, or its already parsed content).

    ``model`` trains another model than the one the file was tuned for (a preset name, a config
    path or a :class:`ModelSpec`); its config fingerprint must match the file's unless
    ``allow_model_mismatch`` (then the override is logged). ``world_size``, when given (e.g. from
    ``torchrun``), must equal the schedule's. The file is data, and nothing it names is imported or
    run: it names a built-in template, or a template file (``--space my_space.py`` when tuning) by
    path and content hash, or a template module. A file or module is used only as the caller names
    it: ``space`` (the user's ``--space``; a file must still hash to the recorded content, checked
    before it runs), or ``template``, a template object the caller loaded. Every problem is a
    :class:`UsageError` of one line.
    """
    if isinstance(source, Mapping):
        where = "schedule"
        data = validate(dict(source), where)
    else:
        where = str(source)
        data = read_schedule(source)
    recorded = data["model"]
    overrides = recorded.get("overrides", {})
    if not isinstance(overrides, dict):
        raise UsageError(f"{where}: model.overrides must be an object")
    spec = model if isinstance(model, ModelSpec) else ModelSpec(model or recorded["name"],
                                                                {} if model else dict(overrides))
    try:
        config = spec.config()
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a config the file names: one line, not a traceback
        raise UsageError(f"{where}: cannot load model {spec.name!r}: {type(exc).__name__}: {exc}") from None
    overridden = []
    expected = recorded.get("fingerprint")
    actual = config_fingerprint(config)
    if expected is not None and expected != actual:
        if not allow_model_mismatch:
            raise ModelMismatchError(f"{where}: the schedule was tuned for model {recorded['name']!r} ({expected}) but "
                             f"{spec.name!r} has config {actual}; pass --allow-model-mismatch to use it anyway")
        log.warning("using schedule %s tuned for %s (%s) on %s (%s): model mismatch overridden",
                    where, recorded["name"], expected, spec.name, actual)
        overridden.append("model")
    if world_size is not None and world_size != data["world_size"]:
        raise UsageError(f"{where}: the schedule is for {data['world_size']} ranks but this job has {world_size}; "
                         f"re-tune for {world_size} ranks or launch {data['world_size']}")
    named = data["template"]
    if template is None:
        template = recorded_template(named.get("file", named["name"]), named.get("sha256"), space, where)
    # (how ranks find the template again: the user's reference; a file's resolves to its path and hash)
    problem_spec = ProblemSpec(spec.name, data["world_size"], model_overrides=dict(spec.overrides),
                               template=space or template.name, global_batch=data["global_batch"], seq_len=data["seq_len"],
                               precision=data["precision"], device=data["device"])
    try:
        problem = problem_spec.resolve(config, template)
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    _check_template(problem.template, named, where)
    knobs = data["knobs"]
    missing = [k for k in problem.space.names if k not in knobs]
    if missing:
        raise UsageError(f"{where}: knobs {', '.join(missing)} missing (template {problem.template.name} has "
                         f"{', '.join(problem.space.names)})")
    try:
        plan = problem.plan({k: str(v) for k, v in knobs.items()})
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    wrong_type = [k for k in problem.space.names if type(plan[k]) is not type(knobs[k])]
    if wrong_type:  # a value of the wrong type (tp "2" or 2.0)
        raise UsageError(f"{where}: knob {wrong_type[0]}={knobs[wrong_type[0]]!r} should be a "
                         f"{type(plan[wrong_type[0]]).__name__}")
    for name in ("micro_batch", "accumulation"):
        if data[name] != getattr(plan, name):
            raise UsageError(f"{where}: {name}={data[name]} does not follow from the knobs (expected "
                             f"{getattr(plan, name)})")
    recorded_blocks = data["layout"].get("stage_blocks")
    if recorded_blocks is not None:  # files from before uneven stages: none (their even cuts are unchanged)
        cut = rank_block_counts(problem.info.layers, plan.pp, knob_value(plan, "vpp"))
        if recorded_blocks != cut:
            raise UsageError(f"{where}: the schedule's pipeline stages hold {recorded_blocks} blocks but this "
                             f"slapo-tune cuts {cut}; re-tune, or verify the schedule with this version")
    return LoadedSchedule(data, problem, plan, where, overridden)


def _check_template(template: Template, recorded: Mapping[str, str], where: str) -> None:
    """The template that will schedule is the one the schedule file names, in its version."""
    if template.name != recorded["name"]:
        raise UsageError(f"{where}: the schedule was made with template {recorded['name']!r}, not {template.name!r}")
    if str(template.version) != recorded["version"]:
        raise UsageError(f"{where}: template {template.name} is version {template.version} here but the schedule "
                         f"was made with version {recorded['version']}; re-tune with this slapo-tune")


def check_model(model: nn.Module, loaded: LoadedSchedule) -> None:
    """Refuse, in one line naming both config fingerprints, a model instance that is not the model
    ``loaded`` schedules (the file's, or the one ``load_schedule(model=...)`` named): the schedule
    would otherwise fail deep inside its template, on a module path the model does not have."""
    config = getattr(model, "config", None)
    actual = config_fingerprint(config) if config is not None and hasattr(config, "to_dict") else None
    expected = config_fingerprint(loaded.problem.config)
    if actual != expected:
        given = f"{type(model).__name__} with config {actual}" if actual else f"{type(model).__name__} (no config)"
        raise ModelMismatchError(f"{loaded.source}: the schedule is for model {loaded.model.name!r} ({expected}) but "
                                 f"the model given is a {given}; pass the model it was tuned for, or re-tune for "
                                 "this one")


def apply_schedule(model: nn.Module | None, schedule: LoadedSchedule | str | os.PathLike, *,
                   device=None, seed: int = 0, topology=None, lr: float | None = None) -> Session:
    """Schedule and build this rank's part of the model; call on every rank of the job.

    ``model`` is the unscheduled model: real weights (e.g. loaded with ``from_pretrained``) are
    kept and sliced, never re-initialised; ``None`` (or meta tensors) initialises from ``seed``. A
    model whose config is not the schedule's raises :class:`~slapo_tune.errors.ModelMismatchError`
    (one line naming both fingerprints). Returns the rank's :class:`~slapo_tune.session.Session`:
    ``.train_step(batch)`` runs micro-batching, the pipeline, gradient synchronisation and the
    optimizer update over the global batch and returns the mean loss (the one call a step takes
    with pipeline stages). For a loop of your own: ``.stage``, at ``pp=1`` called like the model
    (``stage(input_ids=..., labels=...)``, see :meth:`~slapo_tune.runtime.TrainStep.call_like_model`)
    on ``.micro_batches(batch)``, whose optimizer steps ``.trained_parameters()`` (the fp32 masters
    under bf16, then ``stage.master.publish()``); ``.step(batch)`` (gradients only, any ``pp``),
    ``.topology`` (the process groups) and ``.plan``. The process group must already be initialised
    with the schedule's world size.
    """
    import torch.distributed as dist

    loaded = schedule if isinstance(schedule, LoadedSchedule) else load_schedule(schedule)
    if model is not None:
        check_model(model, loaded)
    if not dist.is_initialized():
        raise UsageError("apply_schedule() needs torch.distributed initialised (torchrun, or "
                         "slapo-tune train which launches the ranks)")
    if dist.get_world_size() != loaded.world_size:
        raise UsageError(f"the schedule is for {loaded.world_size} ranks but the process group has "
                         f"{dist.get_world_size()}")
    return Session(loaded.problem, loaded.plan, seed=seed, device=device, topology=topology, model=model, lr=lr)
