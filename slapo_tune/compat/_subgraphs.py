"""Slapo's rewrites of found subgraphs, with Slapo's names, over slapo-tune's graph machinery.

* ``replace(new, subgraphs, name=None, concrete_args=None)``: a module becomes the traced module's
  attribute ``{name or its class name}_0`` (``_1``, ... when taken); a function is called
  directly, so the new node is named after it. The call takes the subgraph's inputs: the outside
  values its operations read, in their order (Slapo's). Several subgraphs become one call whose
  i-th result replaces the i-th subgraph (horizontal fusion; they must read the same inputs).
  Hooks on the replaced modules move to the new module where they still mean the same (the
  module read exactly the subgraph's inputs / produced its result), else the replacement is refused.
* ``fuse(subgraph, compiler, name)``: ``"TorchScript"`` scripts a copy of the subgraph
  (``torch.jit.script``), ``None`` keeps the copy as a module of a class named ``name`` whose
  attributes ``"0"``, ``"1"``, ... are the modules it calls; either becomes ``{name}_0``.
* ``checkpoint(subgraph)`` becomes ``CheckPointWrapper_0`` whose ``mod`` is the subgraph's copy;
  ``checkpoint()`` of a whole module keeps the module in place (paths and state-dict keys
  unchanged) under a class named ``CheckPointWrapper``, with ``.mod`` reaching it.

The modules a copy calls are the model's own (shared, not copied), and stay children of the traced
module only: state-dict keys do not change (a TorchScript module keeps its own references).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from ..errors import PatternError, ScheduleError
from ..schedule import _graph
from ..schedule._state import checkpointed_call, copy_hooks


class Subgraph(list):
    """One match of ``find``: ``[(parent_name, node), ...]`` (Slapo's shape), remembering the match."""

    def __init__(self, match: _graph.Match):
        super().__init__(("", n) for n in match.nodes)
        self.match = match


# Slapo's hook kinds -> the nn.Module dictionaries holding them
_HOOK_DICTS = {
    "fwd_pre": ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"),
    "fwd_post": ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "bwd_post": ("_backward_hooks", "_backward_pre_hooks"),
}
_HOOK_KINDS = {"fwd_pre": "_forward_pre_hooks", "fwd_post": "_forward_hooks", "bwd_post": "_backward_hooks"}


def _hook_kinds(module: nn.Module) -> list[str]:
    return [kind for kind, attr in _HOOK_KINDS.items()
            if getattr(module, attr) or (kind == "bwd_post" and module._backward_pre_hooks)]


def _hooked_modules(gm: fx.GraphModule, matches: Sequence[_graph.Match]) -> list[tuple[fx.Node, nn.Module, list[str]]]:
    found = []
    for match in matches:
        for n in match.nodes:
            if n.op == "call_module":
                module = gm.get_submodule(n.target)
                kinds = _hook_kinds(module)
                if kinds:
                    found.append((n, module, kinds))
    return found


def _check_own(node, matches: Sequence[_graph.Match], where: str) -> None:
    if any(m.owner.mod is not node.mod for m in matches):
        raise ScheduleError(f"{where}: the subgraphs were found by another schedule's find(); use this one's")


def _transfer_hooks(gm: fx.GraphModule, matches: Sequence[_graph.Match], new: Any, where: str) -> list:
    """The (module, kinds) whose hooks move to ``new``; ScheduleError where a hook would be lost or
    would no longer mean what it meant. Checked before anything changes."""
    moves = []
    for node, module, kinds in _hooked_modules(gm, matches):
        if not isinstance(new, nn.Module) or isinstance(new, torch.jit.ScriptModule) or len(matches) > 1:
            why = ("a function has no hooks" if not isinstance(new, nn.Module) else
                   "a TorchScript module takes no Python hooks" if isinstance(new, torch.jit.ScriptModule) else
                   "several subgraphs become one call")
            raise ScheduleError(f"{where}: {node.target} has {'/'.join(kinds)} hook(s), which the replacement "
                                f"would drop ({why})")
        match = matches[0]
        reads_inputs = list(node.args) == match.inputs and not node.kwargs
        for kind in kinds:
            keeps_meaning = node is match.output if kind == "fwd_post" else reads_inputs
            if not keeps_meaning:
                role = "the subgraph's result" if kind == "fwd_post" else "the subgraph's inputs"
                raise ScheduleError(f"{where}: {node.target} has a {kind} hook, but its "
                                    f"{'output' if kind == 'fwd_post' else 'input'} is not {role}, so the "
                                    "hook cannot move to the replacement")
        moves.append((module, kinds))
    return moves


def replace_subgraphs(node, matches: Sequence[_graph.Match], new: nn.Module | Callable, name: str | None = None,
                      concrete_args: dict | None = None) -> str | Callable:
    """Slapo's ``replace(new, subgraphs)`` on the traced module of schedule node ``node``;
    returns the new attribute's name (a module) or the function."""
    gm: fx.GraphModule = node.mod
    where = f"replace('{node.path}')"
    _check_own(node, matches, where)
    _graph.check_replaceable(matches, where)
    inputs = matches[0].inputs
    if any(m.inputs != inputs for m in matches[1:]):
        different = next(m for m in matches if m.inputs != inputs)
        raise PatternError(f"{where}: horizontal fusion calls the replacement once, so every subgraph must read "
                           f"the same inputs ({[n.name for n in inputs]} vs {[n.name for n in different.inputs]})")
    kwargs = dict(concrete_args or {})
    if len(matches) > 1 and kwargs:
        raise ScheduleError(f"{where}: concrete_args is not taken by horizontal fusion (as in Slapo)")
    if not _graph.accepts(new, len(inputs), kwargs):
        raise PatternError(f"{where}: the replacement must take the subgraph's {len(inputs)} input(s) "
                           f"({', '.join(n.name for n in inputs)})" + (f" and {sorted(kwargs)}" if kwargs else "")
                           + "; bind the others with concrete_args={...}")
    moves = _transfer_hooks(gm, matches, new, where)
    if not isinstance(new, nn.Module):
        _graph.substitute(matches, "call_function", new, inputs, kwargs)
        return new
    attr = _graph.unique_attribute(gm, name or type(new).__name__, first=0)
    gm.add_submodule(attr, new)
    for module, kinds in moves:
        copy_hooks(module, new, [attr for kind in kinds for attr in _HOOK_DICTS[kind]])
    _graph.substitute(matches, "call_module", attr, inputs, kwargs)
    node._build_children()
    return attr


def _insert_copy(node, match: _graph.Match, module: nn.Module, name: str, operands: list) -> str:
    gm: fx.GraphModule = node.mod
    attr = _graph.unique_attribute(gm, name, first=0)
    gm.add_submodule(attr, module)
    _graph.substitute([match], "call_module", attr, operands)
    node._build_children()
    return attr


def fuse_subgraph(node, match: _graph.Match, compiler: str | None, name: str) -> str:
    """Slapo's ``fuse``: the subgraph's copy, scripted (``"TorchScript"``), as it is (``None``) or
    compiled with a torch.compile backend (any other name), as the module ``{name}_0``."""
    where = f"fuse('{node.path}')"
    _check_own(node, [match], where)
    _graph.check_replaceable([match], where)
    match = _graph.reading_parameters_outside(match)
    if compiler == "TorchScript":
        try:
            module = torch.jit.script(_graph.extract_match(match, name))
        except Exception as exc:  # noqa: BLE001 - TorchScript rejects many Python constructs
            raise ScheduleError(f"{where}: TorchScript cannot compile the subgraph ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}); fuse with compiler=None or "
                                "a torch.compile backend (\"inductor\")") from None
    elif compiler is None:
        module = _graph.extract_match(match, name, numbered=True)
        _out_of_the_module_tree(module)
    else:
        module = _Compiled(_graph.compile_fn(_graph.extract_match(match, name), compiler))
    return _insert_copy(node, match, module, name, match.operands)


def _out_of_the_module_tree(copy: fx.GraphModule) -> None:
    """The copy's modules as plain attributes, not children: the model's modules keep one path
    each (their traced parent's), so state-dict keys do not change."""
    for key in list(copy._modules):
        copy.__dict__[key] = copy._modules.pop(key)


class _Compiled(nn.Module):
    """A subgraph's copy compiled with a torch.compile backend (kept out of the module tree)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.__dict__["fn"] = fn

    def forward(self, *args):
        return self.fn(*args)


class CheckPointWrapper(nn.Module):
    """Slapo's name for a checkpointed subgraph: runs ``mod`` (the subgraph's copy, not a child)
    under activation checkpointing."""

    def __init__(self, mod: nn.Module, policy: str = "full"):
        super().__init__()
        self.__dict__["mod"] = mod
        self.policy = policy

    def forward(self, *args):
        return checkpointed_call(self.mod, self.policy, *args)


def checkpoint_subgraph(node, match: _graph.Match) -> str:
    """Slapo's ``checkpoint(subgraph)``: the module ``CheckPointWrapper_0`` runs the subgraph's copy
    with its activations recomputed in backward."""
    _check_own(node, [match], f"checkpoint('{node.path}')")
    _graph.check_replaceable([match], f"checkpoint('{node.path}')")
    match = _graph.reading_parameters_outside(match)
    copy = _graph.extract_match(match)
    _out_of_the_module_tree(copy)
    return _insert_copy(node, match, CheckPointWrapper(copy), "CheckPointWrapper", match.operands)


@functools.cache
def _checkpointed_class(cls: type) -> type:
    return type("CheckPointWrapper", (cls,), {
        "__module__": cls.__module__, "__qualname__": "CheckPointWrapper",
        "__doc__": f"A checkpointed {cls.__qualname__} (Slapo's name for a checkpointed module)."})


def name_checkpointed(module: nn.Module) -> None:
    """Slapo's ``checkpoint()`` wrapped a module in a ``CheckPointWrapper`` whose ``mod`` was the
    module; here the module stays where it was (paths and state-dict keys unchanged), its class
    named ``CheckPointWrapper`` (a subclass of its own: ``isinstance`` checks still hold) and its
    ``.mod`` reaching it."""
    if "mod" not in module.__dict__ and "mod" not in module._modules and not hasattr(type(module), "mod"):
        module.__dict__["mod"] = module  # not a child: paths and state-dict keys stay the same
    if type(module).__name__ != "CheckPointWrapper":
        module.__class__ = _checkpointed_class(type(module))


def matches_of(subgraphs: Any, primitive: str, *, several: bool = False) -> list[_graph.Match]:
    """The matches a Slapo subgraph argument stands for: ``find``'s result, part of it, or one
    element. Several only where ``several`` (horizontal ``replace``)."""
    if isinstance(subgraphs, Subgraph):
        found = [subgraphs]
    elif isinstance(subgraphs, Sequence) and subgraphs and all(isinstance(s, Subgraph) for s in subgraphs):
        found = list(subgraphs)
    else:
        raise ScheduleError(f"{primitive}(): expected subgraphs returned by find(), got {type(subgraphs).__name__}")
    if len(found) > 1 and not several:
        raise ScheduleError(f"{primitive}(): the pattern matched {len(found)} subgraphs; {primitive} acts on one "
                            "(pass [subgraphs[i]]), as in Slapo")
    return [s.match for s in found]
