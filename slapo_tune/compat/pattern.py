"""Slapo's ``slapo.pattern``: what a pattern passed to ``Schedule.find`` may be written with.

A pattern is a function of tensors or a :class:`Pattern` subclass whose ``forward`` is the
subgraph to find. In it, :func:`call_module` (or a :class:`ModulePattern` submodule) stands for a
call of any module whose path, relative to the traced module, a regular expression matches from
its start (Python's ``re.match``): ``call_module(r"[qkv]_proj", x)``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..schedule._patterns import call_module


class Pattern(nn.Module):
    """Slapo's pattern class: subclass it and write ``forward`` as the subgraph to find (it may use
    :func:`call_module` or :class:`ModulePattern` for a module named by a regular expression);
    pass an instance to ``find``."""

    def forward(self, *args):
        raise NotImplementedError("a Pattern subclass defines forward as the subgraph to find")


class ModulePattern(nn.Module):
    """In a :class:`Pattern`: a call of any module whose path ``name`` (a regular expression)
    matches from its start, written as a submodule (``self.fc = ModulePattern(r"fc\\d")``,
    then ``self.fc(x)`` in ``forward``); the same as ``call_module(name, x)``."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, *args: Any) -> Any:
        return call_module(self.name, *args)


__all__ = ["ModulePattern", "Pattern", "call_module"]
