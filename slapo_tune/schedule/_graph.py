"""Graph-level primitives: trace a module into a graph, find subgraphs, replace and fuse them.

``trace`` uses ``torch.fx`` symbolic tracing, which keeps the graph shape-generic (any batch or
sequence length). Modules the schedule has touched (sharded with syncs, checkpointed) stay
opaque calls, so their hooks keep working; so do modules with a functional form in the pattern
table (``_patterns``: activations, dropout, norms), which patterns match in either spelling. A
``decompose``d linear layer is traced through, so its bias addition becomes visible to patterns. Where ``torch.fx`` fails (Hugging Face blocks in
transformers 5 do), ``torch.export`` takes example inputs instead; its graph is specialised to
their shapes.

Horizontal fusion of sibling linear layers that read the same input (Q, K and V) works on
modules, without a graph: one fused linear layer runs once per input and each former layer
becomes a slice of its output.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import PatternError, ScheduleError, TraceError
from ._patterns import NormalForm, has_normal_form, normal_form
from ._sharding import is_conv1d
from ._state import INIT_PARTS, ModuleState, checkpointed_call, state_of


class FusedLinear(nn.Linear):
    """Sibling linear layers concatenated along their output features (``split_sizes``)."""

    def __init__(self, in_features: int, split_sizes: Sequence[int], bias: bool, device=None, dtype=None):
        super().__init__(in_features, sum(split_sizes), bias=bias, device=device, dtype=dtype)
        self.split_sizes = list(split_sizes)


class _FusedSlice(nn.Module):
    """What a fused layer left behind: slice ``index`` of the fused layer's output.

    The fused layer runs once per input tensor; the other slices reuse its output. A slice called
    with another input (cross-attention) simply computes the fused layer again, so results are
    always right, and fused only when the inputs are shared.
    """

    def __init__(self, fused: nn.Module, index: int):
        super().__init__()
        self.__dict__["fused"] = fused  # not a child: the fused layer belongs to the common parent
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = self.fused.__dict__.setdefault("_slapo_cache", {"input": None, "output": None, "served": set()})
        if cache["input"] is not x or self.index in cache["served"]:
            cache.update(input=x, output=self.fused(x), served=set())
        out = cache["output"]
        cache["served"].add(self.index)
        if len(cache["served"]) == len(self.fused.split_sizes):  # every slice taken: let go of it
            cache.update(input=None, output=None, served=set())
        return out.split(self.fused.split_sizes, dim=-1)[self.index]


class _Fused(nn.Module):
    """A replacement or compiled subgraph inserted into a traced graph."""

    def __init__(self, fn: Callable):
        super().__init__()
        if isinstance(fn, nn.Module):
            self.fn = fn
        else:
            self.__dict__["fn"] = fn

    def forward(self, *args):
        return self.fn(*args)


def _has_schedule_effects(st: ModuleState | None) -> bool:
    return st is not None and bool(st.pre_syncs or st.post_syncs or st.checkpointed or st.forks_rng
                                   or st.defers_bias or (st.compute is not None and not st.decomposed))


class _Tracer(fx.Tracer):
    def __init__(self, leaf_types: tuple[type, ...] = ()):
        super().__init__()
        self.leaf_types = leaf_types

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        st = state_of(m)
        if st is not None and st.decomposed:
            if st.pre_syncs or st.post_syncs:
                raise TraceError(
                    f"'{qualname}' is decomposed but has syncs, which a traced graph would drop; "
                    "move the sync to its parent (e.g. ReduceInputGrad on the MLP)"
                )
            return False
        if _has_schedule_effects(st) or isinstance(m, (_FusedSlice, _Fused, *self.leaf_types)):
            return True
        if getattr(type(m), "slapo_leaf", False):  # a module that asks to stay a call (slapo_tune.op)
            return True
        if has_normal_form(m):  # kept as a call, so patterns can match its normal form
            return True
        if is_conv1d(m):
            return True
        return super().is_leaf_module(m, qualname)


class _PatternTracer(_Tracer):
    """Traces a pattern (a function or a module); remembers the module each call refers to,
    including modules the pattern creates or closes over (not installed anywhere)."""

    def __init__(self):
        super().__init__()
        self.called: dict[str, nn.Module] = {}

    def path_of_module(self, mod: nn.Module) -> str:
        try:
            path = super().path_of_module(mod)
        except NameError:
            path = f"_pattern_module_{id(mod)}"
        self.called[path] = mod
        return path


def trace_module(module: nn.Module, path: str, example_args: tuple | None = None,
                 example_kwargs: dict | None = None, leaf_types: tuple[type, ...] = ()) -> fx.GraphModule:
    """A GraphModule computing what ``module`` computes (parameters shared, not copied). (Slapo's
    tracing, level by level: :func:`slapo_tune.schedule._tracing.trace_levels`.)"""
    if isinstance(module, fx.GraphModule):
        raise TraceError(f"trace('{path}'): already traced")
    try:
        graph = _Tracer(leaf_types).trace(module)
        gm = fx.GraphModule(module, graph, type(module).__name__)
        # fx rebuilds traced-through children as bare containers; put the originals back so the
        # module tree (paths, types, schedule state) is exactly what it was
        for name, child in module.named_children():
            gm.add_module(name, child)
        return gm
    except TraceError:
        raise
    except Exception as exc:  # noqa: BLE001 - fx raises anything; report it with the path
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if example_args is None and example_kwargs is None:
        raise TraceError(
            f"trace('{path}'): torch.fx cannot trace {type(module).__name__} ({reason}); pass example "
            "inputs (trace(example_args=..., example_kwargs=...)) to trace it with torch.export, which "
            "specialises the graph to their shapes"
        )
    try:
        exported = torch.export.export(module, tuple(example_args or ()), dict(example_kwargs or {}), strict=False)
    except Exception as exc:  # noqa: BLE001
        raise TraceError(
            f"trace('{path}'): neither torch.fx ({reason}) nor torch.export "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}) can trace {type(module).__name__}"
        ) from None
    return exported.module()


def capture_call(root: nn.Module, module: nn.Module, model_inputs: dict) -> tuple[tuple, dict]:
    """The positional and keyword arguments ``module`` receives when ``root`` runs ``model_inputs``."""
    seen: list[tuple[tuple, dict]] = []

    def grab(mod, args, kwargs):
        if not seen:
            seen.append((args, kwargs))
        raise _Captured

    handle = module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            root(**model_inputs)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen:
        raise TraceError("trace(model_inputs=...): the model's forward never called this module")
    return seen[0]


class _Captured(Exception):  # noqa: N818 - control flow
    pass


@dataclass
class Match:
    """A subgraph of a traced module matched by a pattern."""

    owner: object  # the Schedule node holding the traced module
    pattern: Callable
    nodes: list[fx.Node]  # target-graph nodes computed by the pattern (in graph order)
    inputs: list  # what the pattern's arguments are bound to (target-graph nodes or constants), in order
    output: fx.Node

    @property
    def operands(self) -> list:
        """The inputs, then every other outside node the matched nodes read (the model's tensors
        that a pattern module's parameters stood for): what a fused copy of the match takes."""
        inside, seen = set(self.nodes), set()
        extra = []
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in self.inputs and a not in seen:
                    seen.add(a)
                    extra.append(a)
        return [*self.inputs, *extra]

    def __repr__(self) -> str:
        return f"Match({self.owner.path}: {[n.name for n in self.nodes]} <- {[_name(n) for n in self.inputs]})"


def _name(value) -> str:
    return value.name if isinstance(value, fx.Node) else repr(value)


def _pattern_graph(node, pattern: Callable):
    """The pattern's graph in normal form; PatternError if it cannot be one."""
    where = f"find('{node.path}')"
    tracer = _PatternTracer()
    try:
        graph = tracer.trace(pattern)
    except Exception as exc:  # noqa: BLE001 - fx raises anything for an untraceable function
        raise PatternError(f"{where}: cannot trace the pattern ({type(exc).__name__}: {exc}); write it as "
                           "a function of tensors using torch operations and modules") from None
    root = pattern if isinstance(pattern, nn.Module) else None

    def module_at(path: str) -> nn.Module:
        found = tracer.called.get(path)
        return found if found is not None else root.get_submodule(path)

    nf = normal_form(graph, module_at, opaque=lambda m: False, pattern=True)
    nf.graph.eliminate_dead_code()
    (out,) = [n for n in nf.graph.nodes if n.op == "output"]
    if not isinstance(out.args[0], fx.Node):
        raise PatternError(f"{where}: the pattern must return one tensor (it returns {out.args[0]!r}); "
                           "find each result with its own pattern")
    if out.args[0].op == "placeholder":
        raise PatternError(f"{where}: the pattern computes nothing (it returns an input)")
    return nf


def _matcher(pattern: fx.Graph, target: NormalForm, *, by_operation: bool):
    """A subgraph matcher over normal forms (torch's ``SubgraphMatcher``, imported here only).

    A pattern's :func:`~slapo_tune.schedule._patterns.call_module` node matches a call of a module whose
    path its expression matches, whatever the module's normal form (the other pattern nodes still
    see ``F.relu`` in a ``ReLU`` whose path the expression also matches); it gives the module its
    arguments, the module's own (weights, attributes) are not compared.

    ``by_operation`` matches operations and the dataflow between them, as Slapo's ``find`` did,
    instead of slapo-tune's exact reading of a pattern:

    * every use of a pattern argument is its own wildcard (see :func:`_one_placeholder_per_use`):
      ``F.relu(x) + x`` finds ``F.relu(a) + b`` (in the exact reading both uses are one value);
    * the pattern's constants match anything: ``F.dropout(x)`` finds a dropout of any ``p``, and
      ``F.layer_norm(x, 1024)`` a norm with weights (Slapo compared operations, not arguments);
    * an intermediate value may also be used outside the match (the match is found; ``replace`` and
      ``fuse`` refuse it, since the outside user would lose its input).
    """
    from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

    def called_path(gn: fx.Node) -> str | None:
        """The path of the module whose call ``gn`` is the normal form of (None: not a module call
        the schedule left matchable)."""
        origin = target.origin.get(gn)
        return origin.target if origin is not None and origin.op == "call_module" and gn.op != "call_module" else None

    class PatternMatcher(SubgraphMatcher):
        def _nodes_are_equal(self, pn, gn, node_name_match=""):
            regex = getattr(pn.target, "regex", None) if pn.op == "call_function" else None
            if regex is None:
                return super()._nodes_are_equal(pn, gn, node_name_match)
            path = called_path(gn)
            return path is not None and regex.match(path) is not None

        def _match_nodes(self, pn, gn, match, node_name_match=""):
            if by_operation and pn.op == "placeholder":  # one use of one argument
                match.nodes_map[pn] = gn
                return True
            if pn.op != "call_function" or not hasattr(pn.target, "regex"):
                return super()._match_nodes(pn, gn, match, node_name_match)
            if pn in match.nodes_map:
                return match.nodes_map[pn] == gn
            if gn in match.nodes_map.values() or not self._nodes_are_equal(pn, gn) or len(pn.args) > len(gn.args):
                return False
            match.nodes_map[pn] = gn
            for a, b in zip(pn.args, gn.args):  # the module's inputs; what it holds comes after them
                both = isinstance(a, fx.Node) and isinstance(b, fx.Node)
                if not (self._match_nodes(a, b, match) if both else self._match_literals(a, b, match)):
                    del match.nodes_map[pn]
                    return False
            return True

        def _match_literals(self, pn, gn, match):
            if not by_operation:
                return super()._match_literals(pn, gn, match)
            if isinstance(pn, fx.Node):  # an argument may stand for a constant; an operation may not
                if pn.op == "placeholder":
                    match.nodes_map[pn] = gn
                return pn.op == "placeholder"
            return True

        def _is_contained(self, nodes_map) -> bool:
            return True if by_operation else super()._is_contained(nodes_map)

    return PatternMatcher(pattern, match_output=False, match_placeholder=False, remove_overlapping_matches=True)


def _one_placeholder_per_use(graph: fx.Graph) -> fx.Graph:
    """A copy of a pattern graph in which every use of an argument reads a placeholder of its own."""
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        env[node] = out.node_copy(node, lambda a: out.placeholder(f"{a.name}_use") if a.op == "placeholder" else env[a])
    return out


def external_inputs(nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """The nodes outside ``nodes`` that they read, each once, in graph order of their readers and
    argument order (what a replacement of the subgraph takes, in Slapo's order)."""
    inside, found = set(nodes), {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                found.setdefault(a, None)
    return list(found)


def find_pattern(node, pattern: Callable, *, allow_empty: bool = False, by_operation: bool = False) -> list[Match]:
    """Every non-overlapping match of ``pattern`` in ``node``'s graph.

    ``pattern`` is a function of tensors or an ``nn.Module``; it may call functionals or modules,
    and module calls match their functional forms (``_patterns``: the pattern and a copy of the
    target graph are matched in one normal form). Raises :class:`PatternError`, never anything else,
    when the pattern cannot be matched or matches nothing (with ``allow_empty``: returns ``[]``).

    ``by_operation`` matches as Slapo's ``find`` did (see :func:`_matcher`); a match's
    ``inputs`` are then its :func:`external_inputs`, since one argument may stand for several values.
    """
    gm = node.mod
    if not isinstance(gm, fx.GraphModule):
        raise TraceError(f"find('{node.path}'): {type(gm).__name__} is not traced; call trace() on it first")
    pat = _pattern_graph(node, pattern)
    target = normal_form(gm.graph, gm.get_submodule, opaque=lambda m: _has_schedule_effects(state_of(m)),
                         pattern=False)
    try:
        graph = _one_placeholder_per_use(pat.graph) if by_operation else pat.graph
        found = _matcher(graph, target, by_operation=by_operation).match(target.graph)
    except Exception as exc:  # noqa: BLE001 - the matcher asserts on what it does not support
        raise PatternError(f"find('{node.path}'): cannot match the pattern ({type(exc).__name__}: {exc}); "
                           "write it with torch functionals or nn modules over tensor arguments") from None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def bound(value):
        """The target-graph node (or constant) a pattern argument is bound to."""
        if not isinstance(value, fx.Node):
            return value
        if value not in target.operands:
            return target.origin[value]
        # a module's parameter: a node reading it before the module's call (found, else made)
        call, name = target.operands[value]
        path = f"{call.target}.{name}"
        reader = next((n for n in gm.graph.nodes if n.op == "get_attr" and n.target == path
                       and order.get(n, len(order)) < order[call]), None)
        if reader is None:
            with gm.graph.inserting_before(call):
                reader = gm.graph.get_attr(path)
        return reader

    matches = []
    for m in found:
        computed = {t for p, t in m.nodes_map.items() if p.op not in ("placeholder", "output")}
        arguments = [t for p, t in m.nodes_map.items() if p.op == "placeholder"]
        if by_operation:
            if any(a in computed for a in arguments):
                continue  # an argument of the pattern computed by the match itself
            inner = sorted({target.origin[t] for t in computed}, key=order.get)
            matches.append(Match(node, pattern, inner, external_inputs(inner), target.origin[m.returning_nodes[0]]))
            continue
        if any(not isinstance(m.nodes_map[h], fx.Node) for h in pat.held if h in m.nodes_map):
            continue  # a pattern module's weight stands for a tensor, not for a missing one (None)
        inner = sorted({target.origin[t] for t in computed}, key=order.get)
        inputs = [bound(m.nodes_map[p]) for p in pat.placeholders if p in m.nodes_map]
        matches.append(Match(node, pattern, inner, inputs, target.origin[m.returning_nodes[0]]))
    if not matches and not allow_empty:
        name = getattr(pattern, "__name__", type(pattern).__name__)
        raise PatternError(f"find('{node.path}'): {name} matches nothing in the traced graph of {node.path or 'the model'}")
    return matches


def accepts(fn: Callable, n: int, kwargs: dict | None = None) -> bool:
    """Whether ``fn`` (a function or a module's forward) can be called with ``n`` positional
    arguments and ``kwargs``."""
    target = fn.forward if isinstance(fn, nn.Module) else fn
    try:
        inspect.signature(target).bind(*([None] * n), **(kwargs or {}))
    except TypeError:
        return False
    except ValueError:  # builtins without a signature: let them run
        return True
    return True


def check_replaceable(matches: Sequence[Match], where: str) -> None:
    """PatternError unless every match is still in its graph and only its result leaves it."""
    for match in matches:
        gm: fx.GraphModule = match.owner.mod
        if any(n.graph is not gm.graph for n in match.nodes) or any(n not in gm.graph.nodes for n in match.nodes):
            raise PatternError(f"{where}: the match is stale (its graph changed); find it again")
        escaping = [n for n in match.nodes if n is not match.output and any(u not in match.nodes for u in n.users)]
        if escaping:
            users = ", ".join(u.name for u in escaping[0].users if u not in match.nodes)
            raise PatternError(
                f"{where}: {escaping[0].name} inside the match is also used outside it (by {users}); "
                "only the pattern's result may leave a replaced subgraph"
            )


def substitute(matches: Sequence[Match], op: str, target, args: Sequence, kwargs: dict | None = None) -> fx.Node:
    """The matches' nodes become one call (``op``: ``"call_module"`` or ``"call_function"``) of
    ``target(*args, **kwargs)``: with one match, its result's users read the call; with several,
    the i-th match's users read ``call[i]`` (horizontal fusion). Call :func:`check_replaceable` first.
    The call goes before the first node that reads a result, so every argument must come before it."""
    gm: fx.GraphModule = matches[0].owner.mod
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    inside = {n for m in matches for n in m.nodes}
    readers = [u for m in matches for u in m.output.users if u not in inside]
    anchor = min(readers, key=order.__getitem__) if readers else max(inside, key=order.__getitem__).next
    read: list[fx.Node] = []
    fx.node.map_arg((tuple(args), dict(kwargs or {})), read.append)
    late = [a for a in read if order[a] >= order[anchor]]
    if late:
        raise PatternError(f"replace('{matches[0].owner.path}'): {late[0].name}, an input, is computed after "
                           f"{anchor.name}, which reads a result; the matches cannot become one call")
    with graph.inserting_before(anchor):
        call = graph.create_node(op, target, tuple(args), dict(kwargs or {}))
        results = [call] if len(matches) == 1 else [graph.call_function(operator.getitem, (call, i))
                                                    for i in range(len(matches))]
    for match, result in zip(matches, results):
        match.output.replace_all_uses_with(result)
    for n in sorted(inside, key=order.__getitem__, reverse=True):
        graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return call


def unique_attribute(gm: nn.Module, name: str, first: int | None = None) -> str:
    """``name`` (``first`` None) or ``name_{first}``, counting up while ``gm`` has the attribute."""
    i = first
    attr = name if i is None else f"{name}_{i}"
    while hasattr(gm, attr):
        i = 1 if i is None else i + 1
        attr = f"{name}_{i}"
    return attr


def replace_match(match: Match, new: Callable, name: str = "fused", *, operands: bool = False) -> str:
    """Vertical fusion: the matched subgraph becomes one call of ``new(*match.inputs)``
    (``new(*match.operands)`` with ``operands``: a copy of the match, which reads them all)."""
    gm: fx.GraphModule = match.owner.mod
    args = match.operands if operands else match.inputs
    if not accepts(new, len(args)):
        raise PatternError(
            f"replace('{match.owner.path}'): the replacement must take the {len(args)} input(s) "
            f"of the match ({', '.join(_name(n) for n in args)})"
        )
    check_replaceable([match], f"replace('{match.owner.path}')")
    attr = unique_attribute(gm, name)
    gm.add_submodule(attr, _Fused(new))
    substitute([match], "call_module", attr, args)
    return attr


def extract_match(match: Match, class_name: str = "FusedSubgraph", *, numbered: bool = False) -> fx.GraphModule:
    """The matched subgraph as a standalone GraphModule of the match's operands (an instance of a
    class named ``class_name``). It calls the model's own modules; with ``numbered`` they are its
    attributes ``"0"``, ``"1"``, ... in call order, else they keep their paths."""
    gm: fx.GraphModule = match.owner.mod
    graph = fx.Graph()
    env = {n: graph.placeholder(f"in_{i}") for i, n in enumerate(match.operands)}
    modules: dict[str, nn.Module] = {}
    for n in match.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
        if numbered and n.op == "call_module":
            modules[str(len(modules))] = gm.get_submodule(n.target)
            env[n].target = str(len(modules) - 1)
    graph.output(env[match.output])
    return fx.GraphModule(modules if numbered else gm, graph, class_name)


def reading_parameters_outside(match: Match) -> Match:
    """The match without its parameter reads (``get_attr`` nodes), which become operands: a copy of
    the match then reads the model's parameters at every call, including those that ``shard`` or
    ``build`` replaced after the copy was made."""
    return dataclasses.replace(match, nodes=[n for n in match.nodes if n.op != "get_attr"])


def fuse_match(match: Match, compiler: str, name: str) -> str:
    """The matched subgraph, compiled with ``compiler``, as one call; returns the submodule's name."""
    match = reading_parameters_outside(match)
    return replace_match(match, compile_fn(extract_match(match), compiler), name, operands=True)


class _CheckpointedSubgraph:
    """Runs a copy of a matched subgraph under activation checkpointing. Not a module: the modules
    the subgraph calls stay children of the traced module (paths and state-dict keys unchanged)."""

    def __init__(self, subgraph: fx.GraphModule, policy: str):
        self.subgraph, self.policy = subgraph, policy

    def __call__(self, *args):
        return checkpointed_call(self.subgraph, self.policy, *args)


def checkpoint_match(match: Match, policy: str) -> str:
    """Checkpoint only the matched subgraph: its inner activations are recomputed in backward."""
    match = reading_parameters_outside(match)
    return replace_match(match, _CheckpointedSubgraph(extract_match(match), policy), "checkpointed", operands=True)


def compile_fn(fn: Callable, compiler: str) -> Callable:
    """``fn`` compiled with a torch.compile backend; ``"eager"`` leaves it as it is."""
    if compiler == "eager":
        return fn
    return torch.compile(fn, backend=compiler, dynamic=True)


def bias_then(act: Callable) -> Callable:
    """The pattern ``act(x + b)``: a bias addition followed by ``act`` (a function or a module
    whose ops are traced through, e.g. Hugging Face's GELU modules)."""
    return lambda x, b: act(x + b)


def decomposed_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Linear / Conv1D as a matrix product followed by a separate bias addition."""
    if is_conv1d(module):
        out = torch.matmul(x, module.weight)
    else:
        out = F.linear(x, module.weight)
    return out if module.bias is None else out + module.bias


def fuse_linears(modules: Sequence[nn.Module]) -> FusedLinear:
    """One linear layer computing ``modules`` (``nn.Linear`` with the same input) side by side.

    Weights and biases are concatenated (meta tensors stay meta), so results are identical.
    """
    if not modules or not all(type(m) is nn.Linear for m in modules):
        raise ScheduleError("fuse_linears(): horizontal fusion takes nn.Linear layers")
    in_features = {m.in_features for m in modules}
    has_bias = {m.bias is not None for m in modules}
    if len(in_features) != 1 or len(has_bias) != 1:
        raise ScheduleError("fuse_linears(): the layers must share their input size and all have (or lack) a bias")
    w = modules[0].weight
    fused = FusedLinear(in_features.pop(), [m.out_features for m in modules], has_bias.pop(),
                        device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([m.weight for m in modules], dim=0),
                                    requires_grad=w.requires_grad)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in modules], dim=0),
                                      requires_grad=modules[0].bias.requires_grad)
    return fused


def replace_horizontal(nodes: list, make: Callable | nn.Module, name: str | None = None):
    """Horizontal fusion: sibling modules become slices of one fused module's output."""
    parents = {id(n.parent) for n in nodes}
    if len(nodes) < 2 or len(parents) != 1 or nodes[0].parent is None:
        raise PatternError("replace(target=[...]): horizontal fusion takes two or more sibling modules")
    for n in nodes:
        st = state_of(n.mod)
        if st is not None and (st.shards or st.pre_syncs or st.post_syncs):
            raise ScheduleError(f"replace('{n.path}'): it is already sharded or synced; fuse before sharding")
    parent = nodes[0].parent
    fused = make([n.mod for n in nodes]) if not isinstance(make, nn.Module) else make
    if not hasattr(fused, "split_sizes"):
        raise ScheduleError("replace(target=[...]): the fused module needs a split_sizes attribute "
                            "(output features per replaced module); fuse_linears() builds one")
    attr = name or "_".join(n.name for n in nodes)
    if hasattr(parent.mod, attr):
        raise ScheduleError(f"replace(target=[...]): '{parent.path}' already has an attribute '{attr}'")
    setattr(parent.mod, attr, fused)
    for i, n in enumerate(nodes):
        setattr(parent.mod, n.name, _FusedSlice(fused, i))
    parent._build_children()
    node = parent[attr]
    parts = {}
    for param, _ in fused.named_parameters(recurse=False):
        # lets verify() compare the fused gradient with the originals' gradients, concatenated
        node.annotate(param, FUSED_FROM, [f"{n.path}.{param}" for n in nodes])
        parts[param] = [(n.path, n.mod, param) for n in nodes]
    # a fused meta tensor is materialised as its parts would have been: same weights as unfused
    fused.__dict__[INIT_PARTS] = parts
    return node


FUSED_FROM = "fused_from"


def replace_call(gm: fx.GraphModule, node: fx.Node, fn: Callable) -> None:
    """One operation of a traced graph (a function, method or module call) becomes
    ``fn(*node.args, **node.kwargs)`` (a method's first argument is its tensor)."""
    if node.graph is not gm.graph or node.op not in ("call_function", "call_method", "call_module"):
        raise PatternError(f"replace(): {node.name} is not an operation of this traced module's graph")
    with gm.graph.inserting_after(node):
        call = gm.graph.call_function(fn, node.args, node.kwargs)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
