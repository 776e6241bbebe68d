"""Slapo's ``slapo.pipeline``: pipeline stages cut in traced graphs, and tied weights across stages.

``generate_pipeline_partition(sch)`` splits the traced model at its cuts
(``sch[path].cut_pipeline_stage()`` after ``sch.trace_until(...)``): the graph that calls a cut
module is split after that call (``torch.fx``'s ``split_module``: ``submod_0``, ``submod_1``, ...),
the split is inlined into the graph of the module above it, and so on up to the lowest module above
every cut, whose graph is split into the stages: the top module then calls ``submod_<stage>`` in
order. Returns the schedule of the partitioned model.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from torch import fx, nn
from torch.fx.passes.split_module import split_module

from ..errors import PipelineError
from ..schedule._schedule import Schedule as _Node
from ..schedule._schedule import state_of

_CUT = "slapo_cut_after"  # node.meta key: a stage ends after this call


def _owner(node: _Node) -> tuple[_Node, str]:
    """The nearest traced module above ``node`` and the call target naming ``node`` in its graph."""
    parts, owner = [node.name], node.parent
    while owner is not None and not isinstance(owner.mod, fx.GraphModule):
        parts.insert(0, owner.name)
        owner = owner.parent
    if owner is None:
        raise PipelineError(f"cut_pipeline_stage('{node.path}'): no traced module above it; "
                            "trace first (sch.trace_until(...))")
    return owner, ".".join(parts)


def _call_of(owner: _Node, target: str, path: str) -> fx.Node:
    call = next((n for n in owner.mod.graph.nodes if n.op == "call_module" and n.target == target), None)
    if call is None:
        raise PipelineError(f"cut_pipeline_stage('{path}'): the graph of '{owner.path}' does not call it "
                            "(it was traced through); trace_until its parent so that it stays a call")
    return call


def mark_cut(node: _Node) -> None:
    """Slapo's cut in a traced parent: a stage ends after the parent graph's call of ``node``."""
    owner, target = _owner(node)
    _call_of(owner, target, node.path)
    state_of(node.mod, create=True).cut_after = True


def _cuts(root: _Node) -> list[_Node]:
    return [n for _, n in root.named_schedules() if n.parent is not None
            and state_of(n.mod) is not None and state_of(n.mod).cut_after]


def _split(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` split into ``submod_<i>`` after each call marked as a cut."""
    stage, stage_of = 0, {}
    for n in gm.graph.nodes:
        stage_of[n] = stage
        stage += bool(n.meta.get(_CUT))
    if stage == 0:
        raise PipelineError("generate_pipeline_partition(): no cut left to split at")
    return split_module(gm, None, lambda n: stage_of[n], keep_original_order=True)


def _free_name(module: nn.Module, name: str) -> str:
    base, i = name, 0
    while hasattr(module, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _inline(split: fx.GraphModule, parent: fx.GraphModule, call: fx.Node) -> None:
    """Replace ``call`` in ``parent``'s graph by the stage calls of ``split`` (the module it called);
    the stage boundaries become cuts of ``parent``'s graph."""
    params = [n for n in split.graph.nodes if n.op == "placeholder"]
    bound = [*call.args, *call.kwargs.values()]
    env: dict[fx.Node, Any] = dict(zip(params, bound, strict=False))
    stage_calls, last, output = [], call, None
    for n in split.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            output = n.args[0]
            continue
        with parent.graph.inserting_after(last):
            if n.op == "call_module":
                name = _free_name(parent, n.target)
                parent.add_module(name, split.get_submodule(n.target))
                new = parent.graph.call_module(name, fx.map_arg(n.args, env.get), fx.map_arg(n.kwargs, env.get))
                stage_calls.append(new)
            else:
                new = parent.graph.node_copy(n, env.get)
        env[n], last = new, new
    for stage_call in stage_calls[:-1]:
        stage_call.meta[_CUT] = True
    if call.meta.get(_CUT):  # the module itself ended a stage of its parent
        stage_calls[-1].meta[_CUT] = True
    result = fx.map_arg(output, env.get)
    if isinstance(result, fx.Node):
        call.replace_all_uses_with(result)
    else:
        for user in list(call.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                parent.graph.erase_node(user)
        if call.users:
            raise PipelineError(f"generate_pipeline_partition(): '{call.target}' returns a "
                                f"{type(result).__name__} that its parent uses whole; only item reads are supported")
    parent.graph.erase_node(call)
    parent.delete_all_unused_submodules()
    parent.graph.lint()
    parent.recompile()


def _common_prefix(paths: Sequence[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    common = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def generate_pipeline_partition(sch: Any) -> Any:
    """Slapo's ``generate_pipeline_partition``: the traced model split into one ``submod_<i>`` per
    stage at its cuts; returns the schedule of the partitioned model."""
    root: _Node = sch._root
    cuts = _cuts(root)
    if not cuts:
        raise PipelineError("generate_pipeline_partition(): no cut_pipeline_stage() in the schedule")
    owners: dict[str, _Node] = {}
    for cut in cuts:
        owner, target = _owner(cut)
        _call_of(owner, target, cut.path).meta[_CUT] = True
        owners[owner.path] = owner
    # stages are cut at the top, or, when cuts lie in several graphs, at their lowest common module
    top_path = _common_prefix(list(owners)) if len(owners) > 1 else ""
    while not isinstance(root[top_path].mod, fx.GraphModule):  # a module list's path: its traced parent
        top_path = top_path.rpartition(".")[0]
    # the deepest owners first, so each split is inlined into a graph that is split later
    pending = sorted((p for p in owners if p != top_path), key=lambda p: -p.count("."))
    while pending:
        path = pending.pop(0)
        node = root[path]
        parent, target = _owner(node)
        split = _split(node.mod)
        _inline(split, parent.mod, _call_of(parent, target, path))
        parent._build_children()
        if parent.path != top_path and parent.path not in pending:
            pending.append(parent.path)
            pending.sort(key=lambda p: -p.count("."))
    top = root[top_path]
    partitioned = _split(top.mod)
    top._swap(partitioned, state_of(top.mod))
    return type(sch)(root, "")


def analyze_tie_weights(top_mod: nn.Module, is_pipeline_partitioned: bool) -> dict[nn.Parameter, list[tuple[str, int]]]:
    """Parameters that several modules share: ``{parameter: [(name, stage), ...]}``. Partitioned:
    each child of ``top_mod`` is a stage, names are relative to it, and only parameters shared by
    two stages or more are listed; otherwise every shared parameter, all in stage 0."""
    stages = list(top_mod.named_children()) if is_pipeline_partitioned else [("", top_mod)]
    seen: dict[int, tuple[nn.Parameter, list[tuple[str, int]]]] = {}
    for stage_id, (_, stage) in enumerate(stages):
        for prefix, module in stage.named_modules(remove_duplicate=False):
            for name, param in module._parameters.items():
                if param is None:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                names = seen.setdefault(id(param), (param, []))[1]
                if (full, stage_id) not in names:
                    names.append((full, stage_id))
    ties = {}
    for param, names in seen.values():
        if len({s for _, s in names}) > 1 if is_pipeline_partitioned else len(names) > 1:
            ties[param] = names
    return ties


__all__ = ["analyze_tie_weights", "generate_pipeline_partition", "mark_cut"]
