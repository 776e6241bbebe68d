"""Tracing with Slapo's options: concrete arguments, leaf modules by name, one graph per module
level (``flatten=False``) or one flat graph, and example inputs made from shapes where
``torch.fx`` alone cannot trace.

``torch.fx`` fails on Hugging Face modules of transformers 5 wherever Python needs a value that a
symbolic proxy does not have: ``*x.shape[:-1]`` (iterating a proxy), ``if q_len > 1`` (a proxy as
a bool), ``torch.finfo(x.dtype)``, ``buffer[:, :k]`` (a proxy as a slice index). The tracer here
first traces symbolically; where that fails, it traces again with example inputs made from the
module's signature and config (fake tensors: nothing is computed or allocated) and lets a proxy
answer those questions with its example value. The graph then keeps the branches, lengths and
dtypes the examples took; shapes themselves stay symbolic where the code reads them as tensors'
sizes. Examples for a submodule are the values its parent's graph passes to it.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import has_side_effect
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ._graph import _Tracer
from ._state import _HOOK_DICTS, TRACED_FROM

EXAMPLE_VALUE = "slapo_example_value"  # node.meta key: the node's value for the example inputs
EXAMPLE_BATCH, EXAMPLE_SEQUENCE = 2, 16  # distinct and > 1, so no size-1 branch is baked in
# tensor attributes answered with the example's value (a dtype or a rank cannot change with the
# input's size); device stays symbolic: a model traced on meta runs on its real device later
CONCRETE_ATTRIBUTES = frozenset({"dtype", "ndim", "is_cuda", "is_meta", "is_sparse", "is_quantized", "layout"})
# torch constructors that a proxy argument (a device, a size) must turn into a graph call
CONSTRUCTORS = ("tensor", "as_tensor", "arange", "ones", "zeros", "full", "empty", "rand", "randn", "tril", "triu")
_MISSING = object()


@has_side_effect
def check_specialised(value: Any, expected: Any, name: str) -> None:
    """Raised when a traced module is called with another value for an argument it was traced with."""
    same = value is expected if expected is None or isinstance(expected, bool) else value == expected
    if not same:
        raise TraceError(f"traced with {name}={expected!r}, called with {name}={value!r}; trace again with that value")


class _ExampleProxy(fx.Proxy):
    """A proxy that answers length, iteration, truth and index questions with its example value."""

    def _example(self) -> Any:
        value = self.node.meta.get(EXAMPLE_VALUE, _MISSING)
        if value is _MISSING:
            raise fx.proxy.TraceError(f"{self.node.name} has no example value to decide with; "
                                      "symbolically traced variables cannot be used as inputs to control flow")
        return value

    def __len__(self) -> int:
        return len(self._example())

    def __iter__(self) -> Iterator:
        value = self.node.meta.get(EXAMPLE_VALUE, _MISSING)
        count = len(value) if value is not _MISSING else _unpacked_count(inspect.currentframe().f_back)
        if count is None:
            self._example()  # raises: nothing tells how many items there are
        return iter([self[i] for i in range(count)])

    def __bool__(self) -> bool:
        return bool(self._example())

    def __index__(self) -> int:
        return operator.index(self._example())

    def __getattr__(self, name: str):
        if name in CONCRETE_ATTRIBUTES:
            value = self.node.meta.get(EXAMPLE_VALUE, _MISSING)
            if value is not _MISSING and hasattr(value, name):
                return getattr(value, name)
        return _ExampleAttribute(self, name)


def _unpacked_count(frame) -> int | None:
    """How many names ``a, b = proxy`` unpacks into, where the caller is doing that (as fx reads it)."""
    current = next((i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti), None)
    return current.argval if current is not None and current.opname == "UNPACK_SEQUENCE" else None


class _ExampleAttribute(fx.proxy.Attribute, _ExampleProxy):
    """``proxy.attr`` (created lazily, as fx's), answering like :class:`_ExampleProxy`."""


def _leaf_named(module: nn.Module, qualname: str, names: Sequence[str]) -> bool:
    """Slapo's leaf test: a name that is part of the module's type name, or its path."""
    return any(n in type(module).__name__ or n == qualname for n in names) or getattr(module, "traceable", True) is False


class _LevelTracer(_Tracer):
    """fx tracing of one module with Slapo's concrete arguments and leaves; with ``examples``
    (parameter name -> fake tensor), each node records its example value and proxies use it."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_names: Sequence[str], concrete: Mapping[str, Any],
                 examples: Mapping[str, Any] | None, fake_mode):
        super().__init__(leaf_types)
        self.leaf_names, self.concrete, self.examples, self.fake_mode = list(leaf_names), dict(concrete), examples, fake_mode
        self.proxy_buffer_attributes = examples is not None  # buffers sliced by proxies must be graph values

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return _leaf_named(m, qualname, self.leaf_names) or super().is_leaf_module(m, qualname)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ExampleProxy(node, self)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Placeholders named as the forward's parameters (decorators unwrapped); a concrete
        argument keeps its placeholder (so callers may still pass it) with a check that it has
        that value; ``**kwargs`` is empty."""
        fn = inspect.unwrap(root_fn)
        params = list(inspect.signature(fn).parameters.values())[1 if is_module else 0:]
        positional, keywords = [], {}
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.name in self.concrete:
                value = self.concrete[p.name]
                plain = value is None or isinstance(value, bool | int | float | str)
                placeholder = self.create_proxy("placeholder", p.name, (value,) if plain else (), {})
                if plain:
                    self.create_proxy("call_function", check_specialised, (placeholder, value, p.name), {})
            else:
                default = () if p.default is p.empty else (p.default,)
                value = self.create_proxy("placeholder", p.name, default, {})
            if p.kind == p.KEYWORD_ONLY:
                keywords[p.name] = value
            else:
                positional.append(value)

        var_keyword = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)
        keywords.update(self.concrete.get(f"**{var_keyword}", {}))  # constants a parent passes through **kwargs
        if var_keyword is not None:
            # callers may pass what the original took through **kwargs (transformers passes
            # position_ids, ...): accepted; the graph was traced with none of them
            self.create_proxy("placeholder", f"**{var_keyword}", (), {})

        def body(*args):
            return fn(*args, *positional, **keywords)

        body.__annotations__ = {}
        return body, ([self.root] if is_module else [])

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if name is None and kind == "call_module" and target == "self":
            name = "self_"  # a node named "self" would shadow the module in the generated code
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if self.examples is not None and kind != "output":
            value = self._example_of(kind, target, args, kwargs)
            if value is not _MISSING:
                proxy.node.meta[EXAMPLE_VALUE] = value
        return proxy

    def _example_of(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            return self.examples.get(target, self.concrete.get(target, _MISSING))
        if kind == "get_attr":
            with _fx_patches_lifted():
                return _fake(self.fake_mode, _attr(self.root, target))
        return run_example(self.fake_mode, self.root, kind, target, args, kwargs, _value_of_proxy)


def _value_of_proxy(value: Any) -> Any:
    return value.node.meta.get(EXAMPLE_VALUE, _MISSING) if isinstance(value, fx.Proxy) else value


def _value_of_node(value: Any) -> Any:
    return value.meta.get(EXAMPLE_VALUE, _MISSING) if isinstance(value, fx.Node) else value


def _attr(root: nn.Module, target: str) -> Any:
    return functools.reduce(getattr, target.split("."), root)


def _fake(fake_mode, value: Any) -> Any:
    return fake_mode.from_tensor(value) if isinstance(value, torch.Tensor) else value


def run_example(fake_mode, root: nn.Module, kind: str, target: Any, args: tuple, kwargs: dict,
                value_of: Callable[[Any], Any]) -> Any:
    """The example value of one call (fake tensors), or ``_MISSING`` where it cannot be had.
    A module's hooks are not run: a sync's collective must not run while tracing."""
    args, kwargs = pytree.tree_map(value_of, (args, kwargs))
    if any(v is _MISSING for v in pytree.tree_leaves((args, kwargs))):
        return _MISSING
    try:
        with _fx_patches_lifted(), fake_mode:
            if kind == "call_function":
                return target(*args, **kwargs)
            if kind == "call_method":
                return getattr(args[0], target)(*args[1:], **kwargs)
            if kind == "call_module":
                return root.get_submodule(target).forward(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a value we cannot compute is only a question we cannot answer later
        return _MISSING
    return _MISSING


def _fx_patches_lifted():
    """fx's tracing patches (module calls and attributes become graph nodes) lifted while an
    example value is computed (torch's own context manager for that, where this torch has it)."""
    from torch.fx import _symbolic_trace

    lift = getattr(_symbolic_trace, "_maybe_revert_all_patches", None)
    return lift() if lift is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _constructors_traced(tracer: fx.Tracer) -> Iterator[None]:
    """torch's constructors called with a proxy (``torch.tensor(v, device=x.device)``) become
    graph calls instead of failing on the proxy."""
    originals = {name: getattr(torch, name) for name in CONSTRUCTORS}

    def traced(original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            if any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves((args, kwargs))):
                return tracer.create_proxy("call_function", original, args, kwargs)
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(torch, name, traced(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def _config_of(module: nn.Module, config: Any = None) -> Any:
    if config is not None:
        return config
    return next((m.config for m in module.modules() if hasattr(getattr(m, "config", None), "hidden_size")), None)


def _placement(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    tensors = [*module.parameters(), *module.buffers()]
    floating = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
    return (tensors[0].device if tensors else torch.device("cpu")), floating


def example_inputs(module: nn.Module, names: Sequence[str], fake_mode, config: Any = None) -> dict[str, torch.Tensor]:
    """Fake example inputs for ``module``'s parameters ``names``, made from shapes: token ids and
    masks ``[batch, sequence]`` for a whole model, hidden states ``[batch, sequence, hidden]`` and
    additive masks ``[batch, 1, sequence, sequence]`` for its layers (``hidden`` from the config)."""
    config = _config_of(module, config)
    hidden = next((getattr(config, k) for k in ("hidden_size", "n_embd", "d_model") if hasattr(config, k)), None)
    device, dtype = _placement(module)
    whole_model = hasattr(module, "get_input_embeddings") and hasattr(module, "config")
    b, s = EXAMPLE_BATCH, EXAMPLE_SEQUENCE
    out = {}
    with fake_mode:
        for name in names:
            if name == "position_ids":
                out[name] = torch.arange(s, device=device).expand(b, s)
            elif name.endswith("_ids") or (whole_model and "mask" in name):
                out[name] = torch.ones(b, s, dtype=torch.long, device=device)
            elif "mask" in name:
                out[name] = torch.zeros(b, 1, s, s, dtype=dtype, device=device)
            elif hidden is not None:
                out[name] = torch.zeros(b, s, hidden, dtype=dtype, device=device)
            else:
                raise TraceError(f"no example for input '{name}': give the module's config (trace(config=...)) "
                                 "or an example tensor")
    return out


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _concrete_and_inputs(fn: Callable, concrete_args: Mapping[str, Any] | None) -> tuple[dict, list[str]]:
    """Slapo's ``concrete_args`` (``inspect.Parameter.empty`` for "not given") -> the concrete
    values and the names left as inputs."""
    params = [p for p in list(inspect.signature(inspect.unwrap(fn)).parameters.values())[1:]  # after self
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    concrete = {k: v for k, v in (concrete_args or {}).items() if v is not inspect.Parameter.empty
                and any(p.name == k for p in params)}
    return concrete, [p.name for p in params if p.name not in concrete]


def _trace_graph(module: nn.Module, leaf_types, leaf_names, concrete, inputs, examples, fake_mode, config):
    """One module's graph: symbolic first, then with examples. Returns (graph, reason or None)."""
    try:
        return _LevelTracer(leaf_types, leaf_names, concrete, None, fake_mode).trace(module), None
    except Exception as exc:  # noqa: BLE001 - fx raises anything
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        if examples is None:
            examples = example_inputs(module, [n for n in inputs], fake_mode, config)
        tracer = _LevelTracer(leaf_types, leaf_names, concrete, examples, fake_mode)
        with _constructors_traced(tracer):
            return tracer.trace(module), None
    except Exception as exc:  # noqa: BLE001
        return None, f"{reason}; with example inputs: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _children(module: nn.Module) -> dict[str, nn.Module]:
    """Direct children by the path a graph calls them with (a ModuleList's items as ``name.i``)."""
    out = {}
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList):
            out.update({f"{name}.{i}": item for i, item in child.named_children()})
        else:
            out[name] = child
    return out


def _call_inputs(child: nn.Module, node: fx.Node) -> tuple[dict, dict] | None:
    """The child's concrete arguments and example inputs, as its parent's graph calls it."""
    try:
        bound = inspect.signature(inspect.unwrap(type(child).forward)).bind(child, *node.args, **node.kwargs)
    except TypeError:
        return None
    concrete, examples = {}, {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = bound.signature.parameters[name].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if any(isinstance(v, fx.Node) for v in pytree.tree_leaves(value)) or (value and kind == kind.VAR_POSITIONAL):
                return None  # a graph value passed through *args / **kwargs: no name to give a placeholder
            if value:
                concrete[f"**{name}"] = dict(value)
            continue
        if isinstance(value, fx.Node):
            example = _value_of_node(value)
            if example is _MISSING:
                return None
            examples[name] = example
        elif any(isinstance(v, fx.Node) for v in pytree.tree_leaves(value)):
            return None
        else:
            concrete[name] = value
    for p in list(bound.signature.parameters.values())[1:]:
        if p.name not in bound.arguments and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            concrete[p.name] = p.default
    return concrete, examples


def _record_examples(gm: fx.GraphModule, examples: Mapping[str, Any], concrete: Mapping[str, Any], fake_mode) -> None:
    """Each node's example value (for the children's examples), where the graph has none yet."""
    for node in gm.graph.nodes:
        if EXAMPLE_VALUE in node.meta or node.op == "output":
            continue
        if node.op == "placeholder":
            value = examples.get(node.target, concrete.get(node.target, _MISSING))
        elif node.op == "get_attr":
            value = _fake(fake_mode, _attr(gm, node.target))
        else:
            value = run_example(fake_mode, gm, node.op, node.target, node.args, node.kwargs, _value_of_node)
        if value is not _MISSING:
            node.meta[EXAMPLE_VALUE] = value


def carry_over(new: nn.Module, old: nn.Module) -> None:
    """What a traced module keeps of the module it traced: hooks, schedule state, the original
    (a model's initialiser recognises modules by type)."""
    for name in _HOOK_DICTS:
        getattr(new, name).update(getattr(old, name))
    if "_slapo" in old.__dict__:
        new.__dict__["_slapo"] = old.__dict__["_slapo"]
    new.__dict__[TRACED_FROM] = old.__dict__.get(TRACED_FROM, old)


def trace_levels(module: nn.Module, path: str, *, leaf_types: tuple[type, ...] = (), concrete_args: Mapping | None = None,
                 leaf_names: Sequence[str] = (), flatten: bool = False, recursive: bool = True, config: Any = None,
                 examples: Mapping[str, Any] | None = None) -> fx.GraphModule:
    """``module`` as a GraphModule, Slapo's way. ``flatten``: one graph through every module that
    is not a leaf. Otherwise one graph per level: the module's children are calls in its graph and,
    with ``recursive``, are traced in turn into their own GraphModules (a child that cannot be
    traced stays as it is, as under Slapo). ``examples``: fake example inputs by parameter name
    (default: made from the signature and config when symbolic tracing fails)."""
    if isinstance(module, fx.GraphModule):
        raise TraceError(f"trace('{path}'): already traced")
    fake_mode = _fake_mode()
    if examples is not None:  # given tensors, on the module's device (meta for a model built empty)
        device = _placement(module)[0]
        examples = {k: _fake(fake_mode, v.to(device)) if isinstance(v, torch.Tensor) else v for k, v in examples.items()}
    return _trace_level(module, path, leaf_types, list(leaf_names), concrete_args, flatten, recursive, config,
                        examples, fake_mode, top=True)


def _trace_level(module, path, leaf_types, leaf_names, concrete_args, flatten, recursive, config, examples,
                 fake_mode, top):
    concrete, inputs = _concrete_and_inputs(type(module).forward, concrete_args)
    children = _children(module)
    level_leaves = leaf_names if flatten else [*leaf_names, *children]
    graph, reason = _trace_graph(module, leaf_types, level_leaves, concrete, inputs, examples, fake_mode, config)
    if graph is None:
        if top:
            raise TraceError(f"trace('{path}'): cannot trace {type(module).__name__} ({reason})")
        return module
    gm = fx.GraphModule(module, graph, type(module).__name__)
    # fx rebuilds traced-through children as bare containers; put the originals back so the
    # module tree (paths, types, schedule state) is what it was
    for name, child in module.named_children():
        gm.add_module(name, child)
    if not flatten and recursive:
        _trace_children(gm, children, path, leaf_types, leaf_names, config, concrete, examples, fake_mode)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def _trace_children(gm, children, path, leaf_types, leaf_names, config, concrete, examples, fake_mode) -> None:
    calls = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    real_leaf = _LevelTracer(leaf_types, leaf_names, {}, None, fake_mode)
    examples_recorded = False
    for qualname, child in children.items():
        if qualname not in calls or real_leaf.is_leaf_module(child, qualname):
            continue
        if not examples_recorded:
            made = examples if examples is not None else _examples_or_none(gm, concrete, fake_mode, config)
            _record_examples(gm, made or {}, concrete, fake_mode)
            examples_recorded = True
        call = _call_inputs(child, calls[qualname])
        child_concrete, child_examples = call if call is not None else (None, None)
        traced = _trace_level(child, f"{path}.{qualname}" if path else qualname, leaf_types, leaf_names,
                              child_concrete, False, True, config, child_examples or None, fake_mode, top=False)
        if traced is child:
            continue
        carry_over(traced, child)
        owner_name, _, index = qualname.rpartition(".")
        if owner_name:  # an item of a ModuleList: a new list, so the original model is left as it was
            items = dict(gm.get_submodule(owner_name).named_children())
            items[index] = traced
            gm.add_module(owner_name, nn.ModuleList(items.values()))
        else:
            gm.add_module(qualname, traced)


def _examples_or_none(gm: fx.GraphModule, concrete: Mapping[str, Any], fake_mode, config) -> dict | None:
    inputs = [n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target not in concrete]
    try:
        return example_inputs(gm, inputs, fake_mode, config)
    except TraceError:
        return None
