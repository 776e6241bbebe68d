"""From a model, a template and a point to a runnable training step, on one rank.

This is the one path shared by ``slapo-tune verify``, trials and the training job: build the
model on the meta device, schedule it with the template, keep this rank's stage, materialise it,
and wrap it in the runtime's :class:`~slapo_tune.runtime.TrainStep`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._build import build
from ._pipeline import StageModule
from .models import build_model
from .runtime import TrainStep
from .template import Template, Workload, accumulation
from .topology import Topology, init_topology


@dataclass(frozen=True)
class ModelSpec:
    """A model to build: a preset name or config path, plus config overrides."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)

    def build(self, device: str | torch.device = "meta"):
        return build_model(self.name, device=device, **self.overrides)

    def config(self):
        from .models import load_config

        return load_config(self.name, **self.overrides)


@dataclass
class Realized:
    stage: StageModule
    step: TrainStep
    topology: Topology
    accumulation: int


def realize(spec: ModelSpec, template: Template, point: Mapping[str, Any], workload: Workload, *,
            seed: int = 0, device: str | torch.device | None = None, topology: Topology | None = None,
            model: torch.nn.Module | None = None) -> Realized:
    """Schedule ``spec``'s model for ``point`` and return this rank's stage and training step.

    ``model`` is an already built instance of ``spec`` whose real weights are kept (sliced where
    sharded); by default the model is built on the meta device and initialised from ``seed``.
    All ranks of the world call it together (it creates the process groups).
    """
    device_type = torch.device(device).type if device is not None else "cpu"
    topo = topology or init_topology(pp=point["pp"], tp=point["tp"], device_type=device_type)
    if model is None:
        model = spec.build("meta")
    sch = template.schedule(model, point, topo)
    stage = build(sch, topology=topo, zero=point["zero"], seed=seed, device=device)
    accum = accumulation(point, workload)
    step = TrainStep(stage, n_microbatches=accum, schedule=point["pipeline_schedule"], dtype=workload.dtype)
    return Realized(stage, step, topo, accum)
