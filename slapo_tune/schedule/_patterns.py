r"""One normal form for pattern matching: module calls and their functional spellings.

A model may compute a GELU as ``nn.GELU()``, ``F.gelu`` or Hugging Face's ``NewGELUActivation``;
a pattern may be written either way too. Before matching, both the pattern's graph and a copy of
the target graph are rewritten into one normal form, so the spelling does not matter:

* a call of a module type in :data:`MODULE_FORMS` becomes a call of its functional form, with the
  module's attributes as the functional's arguments (``nn.Dropout(0.1)`` -> ``F.dropout(x, 0.1)``)
  and its parameters as tensor operands;
* a call of a functional in :data:`FUNCTIONAL_FORMS` (or an alias such as ``torch.relu``) gets
  every argument in the functional's order, defaults filled in, and arguments that do not change
  the result (``inplace``) dropped;
* any other module call matches a call of a module of the same type, whatever its attributes
  (``nn.BatchNorm2d(3)`` in a pattern matches every ``BatchNorm2d``);
* a tensor a pattern holds (a pattern module's parameter, a constant) matches any tensor of the
  model: a pattern says what is computed, not with which weights;
* :func:`call_module` in a pattern (``call_module(r"mlp\.c_fc", x)``) matches a call of any module
  whose path (relative to the traced module) the regular expression matches from its start.

Only the copy is rewritten: matches are reported on the target's own nodes, so a fused match runs
exactly the operations the model ran.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

_REQUIRED = object()  # an argument without a default


@dataclass(frozen=True)
class FunctionalForm:
    """A functional and its arguments: ``(name, default)`` in order; ``ignored`` ones do not
    change the result; ``aliases`` are other callables computing the same thing."""

    fn: Callable
    params: tuple[tuple[str, Any], ...]
    ignored: frozenset[str] = frozenset()
    aliases: tuple[Callable, ...] = ()

    def canonical_args(self, args: tuple, kwargs: dict) -> tuple | None:
        """Every kept argument in order with defaults filled in; None if the call does not bind."""
        names = [name for name, _ in self.params]
        if len(args) > len(names) or any(k not in names for k in kwargs):
            return None
        bound = dict(zip(names, args))
        if any(k in bound for k in kwargs):
            return None
        bound.update(kwargs)
        values = []
        for name, default in self.params:
            value = bound.get(name, default)
            if value is _REQUIRED:
                return None
            if name not in self.ignored:
                values.append(tuple(value) if isinstance(value, (list, torch.Size)) else value)
        return tuple(values)


@dataclass(frozen=True)
class TensorOperand:
    """A module's parameter passed to its functional form (``nn.LayerNorm``'s ``weight``)."""

    name: str


def _tensors(module: nn.Module, *names: str) -> dict[str, TensorOperand | None]:
    # _parameters, not getattr: under fx tracing, reading a parameter would record a graph node
    return {n: TensorOperand(n) if module._parameters.get(n) is not None else None for n in names}


_INPUT = ("input", _REQUIRED)
_INPLACE = frozenset({"inplace"})

FUNCTIONAL_FORMS: dict[str, FunctionalForm] = {
    "gelu": FunctionalForm(F.gelu, (_INPUT, ("approximate", "none"))),
    "relu": FunctionalForm(F.relu, (_INPUT, ("inplace", False)), _INPLACE, (torch.relu,)),
    "silu": FunctionalForm(F.silu, (_INPUT, ("inplace", False)), _INPLACE),
    "dropout": FunctionalForm(F.dropout, (_INPUT, ("p", 0.5), ("training", True), ("inplace", False)), _INPLACE),
    "layer_norm": FunctionalForm(F.layer_norm, (_INPUT, ("normalized_shape", _REQUIRED), ("weight", None),
                                                ("bias", None), ("eps", 1e-5))),
    "linear": FunctionalForm(F.linear, (_INPUT, ("weight", _REQUIRED), ("bias", None))),
}

# module type (or a Hugging Face class by qualified name, so transformers need not be imported)
# -> (its functional form, the functional's arguments the module holds). A dropout module is
# written for training mode; its mode at run time is the model's, as the fused match keeps the call.
MODULE_FORMS: dict[type | str, tuple[str, Callable[[nn.Module], dict[str, Any]]]] = {
    nn.GELU: ("gelu", lambda m: {"approximate": m.approximate}),
    nn.ReLU: ("relu", lambda m: {}),
    nn.SiLU: ("silu", lambda m: {}),
    nn.Dropout: ("dropout", lambda m: {"p": m.p}),
    nn.LayerNorm: ("layer_norm", lambda m: {"normalized_shape": m.normalized_shape, "eps": m.eps,
                                            **_tensors(m, "weight", "bias")}),
    nn.Linear: ("linear", lambda m: _tensors(m, "weight", "bias")),
    # GPT-2's gelu_new is the tanh approximation written out; the others call F.gelu / F.silu
    "transformers.activations.NewGELUActivation": ("gelu", lambda m: {"approximate": "tanh"}),
    "transformers.activations.GELUTanh": ("gelu", lambda m: {"approximate": "tanh"}),
    "transformers.activations.PytorchGELUTanh": ("gelu", lambda m: {"approximate": "tanh"}),
    "transformers.activations.GELUActivation": ("gelu", lambda m: {}),
    "transformers.activations.SiLUActivation": ("silu", lambda m: {}),
}

_BY_CALLABLE: dict[Callable, FunctionalForm] = {
    fn: form for form in FUNCTIONAL_FORMS.values() for fn in (form.fn, *form.aliases)
}


def has_normal_form(module: nn.Module) -> bool:
    """Whether the table knows ``module``'s type (its calls have a functional form)."""
    return _module_entry(module) is not None


def _module_entry(module: nn.Module):
    cls = type(module)
    return MODULE_FORMS.get(cls) or MODULE_FORMS.get(f"{cls.__module__}.{cls.__qualname__}")


def module_form(module: nn.Module) -> tuple[FunctionalForm, dict[str, Any]] | None:
    """The functional form of ``module``'s call and the arguments it holds, if the table knows it."""
    entry = _module_entry(module)
    if entry is None:
        return None
    name, attributes = entry
    return FUNCTIONAL_FORMS[name], attributes(module)


@functools.cache
def call_of_type(cls: type) -> Callable:
    """The normal form's stand-in for calling any module of type ``cls`` (never run)."""

    def call(*args, **kwargs):
        raise RuntimeError("a normal-form graph is for matching only")

    call.__name__ = call.__qualname__ = f"call_{cls.__name__}"
    return call


@functools.cache
def call_named(regex: str) -> Callable:
    """The normal form's stand-in for calling a module whose path ``regex`` matches (never run)."""

    def call(*args, **kwargs):
        raise RuntimeError("a normal-form graph is for matching only")

    call.__name__ = call.__qualname__ = "call_module"
    call.regex = re.compile(regex)
    return call


def call_module(name_regex: str, *args: Any) -> Any:
    """In a pattern: a call of any module whose path matches ``name_regex`` (Python's ``re.match``)
    with ``args``; for a pattern only (it is recorded while the pattern is traced, never run)."""
    proxies = [a for a in args if isinstance(a, fx.Proxy)]
    if not proxies:
        raise RuntimeError("call_module is for patterns passed to find(), not for running")
    re.compile(name_regex)  # a bad expression fails here, where the pattern is written
    return proxies[0].tracer.create_proxy("call_function", call_named(name_regex), args, {})


@dataclass
class NormalForm:
    """A graph in normal form and how its nodes relate to the graph it was made from."""

    graph: fx.Graph
    origin: dict[fx.Node, fx.Node]  # normal-form node -> the node it was made from
    operands: dict[fx.Node, tuple[fx.Node, str]]  # a module's parameter -> (the module's call, name)
    placeholders: list[fx.Node]  # the source's placeholders, in order
    held: list[fx.Node]  # tensors the source held (patterns only): wildcards over the target's tensors


def normal_form(graph: fx.Graph, module_at: Callable[[str], nn.Module], *, opaque: Callable[[nn.Module], bool],
                pattern: bool) -> NormalForm:
    """``graph`` rewritten into the normal form (a new graph; ``graph`` is left as it is).

    ``module_at`` resolves a ``call_module`` target; modules for which ``opaque`` holds (hooks,
    syncs, checkpointing change what they compute) are kept as calls nothing in a pattern matches.
    In a ``pattern`` the tensors it holds become wildcards (placeholders listed in ``held``).
    """
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nf = NormalForm(out, {}, {}, [], [])

    def operand(call: fx.Node, name: str) -> fx.Node:
        if pattern:
            node = out.placeholder(f"held_{len(nf.held)}")
            nf.held.append(node)
        else:
            node = out.get_attr(f"{call.target}.{name}")
            nf.operands[node] = (call, name)
        return node

    for node in graph.nodes:
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        new = None
        if node.op == "call_module":
            module = module_at(node.target)
            found = None if opaque(module) else module_form(module)
            if found is not None and not kwargs and len(args) == 1:
                form, held = found
                values = {k: operand(node, v.name) if isinstance(v, TensorOperand) else v for k, v in held.items()}
                canonical = form.canonical_args(args, values)
                new = None if canonical is None else out.call_function(form.fn, canonical)
            if new is None and not opaque(module):
                new = out.call_function(call_of_type(type(module)), args, kwargs)
        elif node.op == "call_function" and node.target in _BY_CALLABLE:
            form = _BY_CALLABLE[node.target]
            canonical = form.canonical_args(args, kwargs)
            if canonical is not None:
                new = out.call_function(form.fn, canonical)
        elif node.op == "get_attr" and pattern:
            new = out.placeholder(f"held_{len(nf.held)}")
            nf.held.append(new)
        if new is None:
            new = out.node_copy(node, env.__getitem__)
        if node.op == "placeholder":
            nf.placeholders.append(new)
        env[node] = new
        nf.origin[new] = node
    return nf
