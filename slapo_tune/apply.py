"""Use an exported schedule in a training job: ``load_schedule`` and ``apply_schedule``.

``load_schedule`` checks everything a file can get wrong before any process group or model exists
(format, version, template, knob legality for the model and world size, the model's config
fingerprint), so a bad file costs one line, not a hung job. ``apply_schedule`` then goes through
the same path as trials (:func:`slapo_tune.realize.realize`): what was measured is what trains.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .errors import UsageError
from .realize import ModelSpec, Realized, realize
from .schedule_file import read_schedule, validate
from .template import ModelInfo, Template, Workload

log = logging.getLogger("slapo_tune")


@dataclass
class LoadedSchedule:
    """A validated schedule file: its template, complete legal point and workload."""

    data: dict[str, Any]
    template: Template
    point: dict[str, Any]
    workload: Workload
    model: ModelSpec
    source: str = ""
    overridden: list[str] = field(default_factory=list)  # checks the user chose to override

    @property
    def world_size(self) -> int:
        return self.workload.world_size

    @property
    def micro_batch(self) -> int:
        return self.point["micro_batch"]

    @property
    def accumulation(self) -> int:
        return self.data["accumulation"]


def load_schedule(source: str | os.PathLike | Mapping[str, Any], *, model: str | ModelSpec | None = None,
                  world_size: int | None = None, allow_model_mismatch: bool = False,
                  template: Template | None = None) -> LoadedSchedule:
    """Read and check a ``best_schedule.json`` (a path, or its already parsed content).

    ``model`` trains another model than the one the file was tuned for (a preset name, a config
    path or a :class:`ModelSpec`); its config fingerprint must match the file's unless
    ``allow_model_mismatch`` (then the override is logged). ``world_size``, when given (e.g. from
    ``torchrun``), must equal the schedule's. The file names a built-in template; a custom one is
    passed as ``template`` (a file is data: it never decides which code runs). Every problem is a
    :class:`UsageError` of one line.
    """
    from search_spaces import TEMPLATES

    from .models import config_fingerprint
    from .space import coerce

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
            raise UsageError(f"{where}: the schedule was tuned for model {recorded['name']!r} ({expected}) but "
                             f"{spec.name!r} has config {actual}; pass --allow-model-mismatch to use it anyway")
        log.warning("using schedule %s tuned for %s (%s) on %s (%s): model mismatch overridden",
                    where, recorded["name"], expected, spec.name, actual)
        overridden.append("model")
    if world_size is not None and world_size != data["world_size"]:
        raise UsageError(f"{where}: the schedule is for {data['world_size']} ranks but this job has {world_size}; "
                         f"re-tune for {world_size} ranks or launch {data['world_size']}")
    name = data["template"]["name"]
    if template is None:
        if name not in TEMPLATES:
            raise UsageError(f"{where}: template {name!r} is not built in ({', '.join(TEMPLATES)}); load a custom "
                             "template yourself and pass it (load_schedule(..., template=...))")
        template = TEMPLATES[name]
    elif template.name != name:
        raise UsageError(f"{where}: the schedule was made with template {name!r}, not {template.name!r}")
    if str(template.version) != data["template"]["version"]:
        raise UsageError(f"{where}: template {template.name} is version {template.version} here but the schedule "
                         f"was made with version {data['template']['version']}; re-tune with this slapo-tune")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and data["seq_len"] > positions:
        raise UsageError(f"{where}: seq_len {data['seq_len']} is longer than {spec.name}'s {positions} positions")
    workload = Workload(data["world_size"], data["global_batch"], data["seq_len"], data["dtype"])
    space = template.space(ModelInfo.from_config(config), workload)
    knobs = data["knobs"]
    missing = [k for k in space.names if k not in knobs]
    if missing:
        raise UsageError(f"{where}: knobs {', '.join(missing)} missing (template {template.name} has "
                         f"{', '.join(space.names)})")
    try:
        point = space.complete(coerce(space, {k: str(v) for k, v in knobs.items()}))
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    if point != {k: knobs[k] for k in space.names}:  # a value of the wrong type (tp "2" or 2.0)
        changed = [k for k in space.names if point[k] != knobs[k] or type(point[k]) is not type(knobs[k])]
        raise UsageError(f"{where}: knob {changed[0]}={knobs[changed[0]]!r} should be a "
                         f"{type(point[changed[0]]).__name__}")
    for name in ("micro_batch", "accumulation"):
        expected_value = point["micro_batch"] if name == "micro_batch" else \
            data["global_batch"] // (point["dp"] * point["micro_batch"])
        if data[name] != expected_value:
            raise UsageError(f"{where}: {name}={data[name]} does not follow from the knobs (expected {expected_value})")
    return LoadedSchedule(data, template, point, workload, spec, where, overridden)


def apply_schedule(model: nn.Module | None, schedule: LoadedSchedule | str | os.PathLike, *,
                   device=None, seed: int = 0, topology=None) -> Realized:
    """Schedule and build this rank's part of the model; call on every rank of the job.

    ``model`` is the unscheduled model: real weights (e.g. loaded with ``from_pretrained``) are
    kept and sliced, never re-initialised; ``None`` (or meta tensors) initialises from ``seed``.
    Returns the stage module (``.stage``, whose parameters go to the optimizer), the training step
    (``.step(batch)`` runs micro-batching, the pipeline and gradient synchronisation over the
    global batch and returns the mean loss), the process groups (``.topology``) and the
    accumulation count. The process group must already be initialised with the schedule's world
    size.
    """
    import torch.distributed as dist

    loaded = schedule if isinstance(schedule, LoadedSchedule) else load_schedule(schedule)
    if not dist.is_initialized():
        raise UsageError("apply_schedule() needs torch.distributed initialised (torchrun, or "
                         "slapo-tune train which launches the ranks)")
    if dist.get_world_size() != loaded.world_size:
        raise UsageError(f"the schedule is for {loaded.world_size} ranks but the process group has "
                         f"{dist.get_world_size()}")
    return realize(loaded.model, loaded.template, loaded.point, loaded.workload, seed=seed, device=device,
                   topology=topology, model=model)
