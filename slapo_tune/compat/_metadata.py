"""``sch.metadata`` as Slapo's schedules read it, and the parameter tags ``build`` keeps.

Slapo kept a mapping of tied parameters and the names of the parameter tags (``annotate``'s keys,
and ``orig_shape``, which ``shard`` records) on the top schedule. Here both are read from the model
when asked: slapo-tune stores annotations on the modules, and re-ties sharded parameters itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from torch import nn

from ..schedule._schedule import state_of


@dataclass
class ScheduleMetadata:
    """``tie_weights``: each parameter held under more than one name, mapped to itself (Slapo's
    mapping, after slapo-tune re-tied what sharding replaced); ``param_tags``: the keys of every
    parameter annotation in the model."""

    tie_weights: OrderedDict[nn.Parameter, nn.Parameter] = field(default_factory=OrderedDict)
    param_tags: set[str] = field(default_factory=set)


def metadata_of(model: nn.Module) -> ScheduleMetadata:
    holders: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        holders[id(param)] = holders.get(id(param), 0) + 1
    ties = OrderedDict((p, p) for p in model.parameters() if holders[id(p)] > 1)
    tags = {key for m in model.modules() if (st := state_of(m)) is not None
            for keys in st.annotations.values() for key in keys}
    return ScheduleMetadata(ties, tags)


def tag_parameters(model: nn.Module) -> None:
    """Set every annotation as an attribute of its parameter (``param.orig_shape``, ``param.<key>``),
    as Slapo's parameters carried them: ``build`` re-creates materialised parameters without them."""
    for module in model.modules():
        st = state_of(module)
        for name, tags in (st.annotations.items() if st is not None else ()):
            param = module._parameters.get(name)
            if param is not None:
                for key, value in tags.items():
                    setattr(param, key, value)
