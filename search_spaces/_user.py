"""Templates written as a schedule function and its knobs, in a user's ``.py`` file
(``--space my_space.py``): Slapo's schedule function with symbols, as a template of a few lines.

The file declares:

* ``KNOBS``: ``{name: values}``, each a list of values of one type (ints, floats or strings), or a
  :class:`slapo_tune.space.Knob` whose domain depends on earlier knobs (``depends``);
* ``schedule(sch, point)``: applies the file's knobs to the schedule ``sch`` (``point`` holds every
  knob of the space);
* optionally ``BASE``: a template to extend (a registered name such as ``"llama"``, or a
  :class:`~slapo_tune.template.Template`): its knobs come first, and it schedules first, so
  ``schedule`` refines a model the base already scheduled. Without a base, the runtime's knobs
  (``dp``, ``zero``, ``micro_batch``) and ``attn`` are searched beside the file's, while tensor
  parallelism, pipelines, checkpointing and fusion stay off (extend a template to tune them);
* optionally ``CONSTRAINTS``: functions of a complete point returning why it is illegal, or None;
  ``NAME`` (default: the file's name) and ``VERSION`` (default ``"1"``).

The cost model knows the base's knobs only: it predicts a point as the base schedules it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from slapo_tune.errors import UsageError
from slapo_tune.plan import KNOBS as COMMON_KNOBS
from slapo_tune.space import Knob, Point, Space
from slapo_tune.template import ModelInfo, Template, set_attention

from .generic import GenericDecoderTemplate

if TYPE_CHECKING:
    from torch import nn

    from slapo_tune.plan import Workload
    from slapo_tune.schedule._schedule import Schedule

NO_BASE_PINS = {"pp": 1, "ckpt_ratio": 0.0}  # without a base nothing cuts or checkpoints the blocks
_VALUE_TYPES = (int, float, str)


class _NoBase(GenericDecoderTemplate):
    """What a file without ``BASE`` extends: the runtime's knobs, and the attention kernel. The
    generic template finds the block list (for the cost model)."""

    name = "none"

    def tp_refusal(self, config) -> str:
        return "the template file extends no template (BASE), so nothing shards the model"

    def apply(self, sch: Schedule, point: Mapping[str, Any]) -> None:
        set_attention(sch.mod, point["attn"])


class ScheduleFunctionTemplate(Template):
    """A template made of a base template's knobs plus a file's own knobs and schedule function."""

    def __init__(self, *, name: str, version: str, schedule: Callable[[Schedule, Mapping[str, Any]], None],
                 knobs: Sequence[Knob], constraints: Sequence[Callable[[Point], str | None]], base: Template | None):
        self.name, self.version = name, version
        self.schedule_function = schedule
        self.own_knobs = list(knobs)
        self.constraints = list(constraints)
        self.base = base if base is not None else _NoBase()
        self.pins = NO_BASE_PINS if base is None else {}

    # what the model's structure decides is the base's business
    def blocks_path(self, model: nn.Module) -> str:
        return self.base.blocks_path(model)

    def tensor_parallel_plan(self, model: nn.Module, fused: bool = False) -> dict[str, Any]:
        return self.base.tensor_parallel_plan(model, fused)

    def tp_refusal(self, config) -> str:
        return self.base.tp_refusal(config)

    def tp_divides(self, info: ModelInfo) -> tuple[int, ...]:
        return self.base.tp_divides(info)

    @property
    def has_fusion(self) -> bool:
        return self.base.has_fusion

    def fuse(self, sch: Schedule, model: nn.Module) -> None:
        self.base.fuse(sch, model)

    def space(self, info: ModelInfo, workload: Workload) -> Space:
        space = self.base.space(info, workload)
        if self.pins:
            space = space.pinned(self.pins)
        known = set(space.names)
        for knob in self.own_knobs:
            if knob.name in known:
                raise UsageError(f"template {self.name}: knob '{knob.name}' is already a knob of template "
                                 f"{self.base.name}; name yours otherwise")
            later = [d for d in knob.depends if d not in known]
            if later:
                raise UsageError(f"template {self.name}: knob '{knob.name}' depends on '{later[0]}', which is not "
                                 "a knob declared before it")
            known.add(knob.name)
        return Space([*space.knobs, *self.own_knobs], [*space.constraints, *self.constraints],
                     {**space.context, "template": self.name})

    def apply(self, sch: Schedule, point: Mapping[str, Any]) -> None:
        """The base schedules the point, then the file's function refines it. A point without the
        file's knobs (the cost model's probe of the base's layout) is the base's alone."""
        self.base.apply(sch, point)
        if all(knob.name in point for knob in self.own_knobs):
            self.schedule_function(sch, point)


def schedule_function_template(module: Any, where: str, stem: str,
                               templates: Mapping[str, Template]) -> ScheduleFunctionTemplate | None:
    """The template a loaded file declares with ``schedule`` and ``KNOBS`` (None if it declares
    neither); ``templates`` are those a ``BASE`` may name. A malformed declaration is a
    :class:`UsageError` naming it."""
    schedule, knobs = getattr(module, "schedule", None), getattr(module, "KNOBS", None)
    if schedule is None and knobs is None:
        return None
    if not callable(schedule):
        raise UsageError(f"{where} declares KNOBS but no schedule(sch, point) function")
    try:
        inspect.signature(schedule).bind(None, None)
    except (TypeError, ValueError):
        raise UsageError(f"{where}: schedule must take two arguments, (sch, point)") from None
    if not isinstance(knobs, Mapping):
        raise UsageError(f"{where} defines schedule() but no KNOBS dict (knob name -> values; {{}} for none)")
    base = getattr(module, "BASE", None)
    if isinstance(base, str):
        if base not in templates:
            raise UsageError(f"{where}: BASE {base!r} is not a template ({', '.join(templates)})")
        base = templates[base]
    elif base is not None and not isinstance(base, Template):
        raise UsageError(f"{where}: BASE must be a template name or a Template, not {type(base).__name__}")
    constraints = getattr(module, "CONSTRAINTS", ())
    if not isinstance(constraints, Sequence) or not all(callable(c) for c in constraints):
        raise UsageError(f"{where}: CONSTRAINTS must be a list of functions of a point")
    return ScheduleFunctionTemplate(
        name=str(getattr(module, "NAME", stem)), version=str(getattr(module, "VERSION", "1")), schedule=schedule,
        knobs=[_knob(name, values, where) for name, values in knobs.items()], constraints=list(constraints),
        base=base)


def _knob(name: Any, values: Any, where: str) -> Knob:
    """A declared knob: a :class:`Knob` named ``name``, or a list of values of one type."""
    if not isinstance(name, str) or not name.isidentifier():
        raise UsageError(f"{where}: knob name {name!r} is not an identifier")
    if name in COMMON_KNOBS:
        raise UsageError(f"{where}: knob '{name}' is one every template has; name yours otherwise")
    if isinstance(values, Knob):
        if values.name != name:
            raise UsageError(f"{where}: KNOBS[{name!r}] is a Knob named {values.name!r}")
        return values
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise UsageError(f"{where}: knob '{name}' needs a non-empty list of values or a Knob")
    kinds = {type(v) for v in values}
    if len(kinds) != 1 or not kinds <= set(_VALUE_TYPES):
        raise UsageError(f"{where}: knob '{name}' values must all be ints, all floats or all strings "
                         f"(got {', '.join(sorted(k.__name__ for k in kinds))})")
    if len(set(values)) != len(values):
        raise UsageError(f"{where}: knob '{name}' lists a value twice")
    return Knob(name, tuple(values), kind=kinds.pop(), doc=f"declared in {where}")
