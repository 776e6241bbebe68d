"""Slapo's public call forms over slapo-tune: ``import slapo_tune.compat as slapo`` runs a schedule
written for Slapo (awslabs/slapo).

Every call maps onto slapo-tune's own primitives, with Slapo's argument names, defaults and return
values: ``sync(mode, sync_op_or_fn, axis=0)`` with hook functions, ``find`` returning
``[[(parent_name, node), ...]]`` (``[]`` when nothing matches), ``replace_all(type, fn(name, mod))``,
``checkpoint(subgraph)``, ``fuse(subgraph, compiler="TorchScript")``, ``build`` returning
``(model, optimizer)``, ``Verify`` as a context manager. docs/schedule-language.md's "Running Slapo schedules"
section lists what differs and why.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from .._verify import VerifyReport
from .._verify import verify as _verify
from ..errors import ScheduleError, VerificationError
from ..schedule import _graph, _schedule, _state, _tracing  # noqa: F401
from ..schedule._build import build as _build
from ..schedule._schedule import list_primitives, register_primitive, state_of  # noqa: F401  (re-exported)
from . import _subgraphs, op  # noqa: F401  (op: Slapo's slapo.op)
from ._metadata import ScheduleMetadata, metadata_of, tag_parameters
from ._subgraphs import Subgraph
from .logger import get_logger  # noqa: F401  (re-exported, as Slapo's slapo.get_logger)
from .pattern import Pattern, call_module  # noqa: F401  (re-exported, as Slapo's slapo.Pattern)
from .pipeline import mark_cut
from .random import get_cuda_rng_tracker, is_random_seed_set, set_random_seed, tracker_aware  # noqa: F401

# Slapo's resharding schemes over the last two axes (R: replicated, S: sharded) -> (op, axis, join axis)
RESHARD: dict[str, tuple[str | None, int, int | None]] = {
    "RR->RS": ("scatter", -1, None), "RR->SR": ("scatter", -2, None),
    "RS->RR": ("all_gather", -1, None), "SR->RR": ("all_gather", -2, None),
    "RS->SR": ("all_to_all", -2, -1), "SR->RS": ("all_to_all", -1, -2),
    "RR->RR": (None, 0, None), "RS->RS": (None, 0, None), "SR->SR": (None, 0, None),
}
_HOOKS = {"fwd_pre": "register_forward_pre_hook", "fwd_post": "register_forward_hook",
          "bwd_post": "register_full_backward_hook"}


class Schedule:
    """A schedule node with Slapo's primitives, over a slapo-tune node (found again by its path
    at every call, so replacements made through either API are seen)."""

    def __init__(self, root: _schedule.Schedule, path: str = ""):
        self._root, self.path = root, path

    # ------------------------------------------------------------------ tree
    @property
    def _node(self) -> _schedule.Schedule:
        return self._root[self.path]

    @property
    def mod(self) -> nn.Module:
        return self._node.mod

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def parent(self) -> Schedule | None:
        return None if not self.path else Schedule(self._root, self.path.rpartition(".")[0])

    @property
    def child(self) -> dict[str, Schedule]:
        return {name: self[name] for name in self._node.child}

    @property
    def group(self):
        return self._node.group

    @property
    def rank(self) -> int:
        return self._node.rank

    @property
    def world_size(self) -> int:
        return self._node.world_size

    @property
    def metadata(self) -> ScheduleMetadata:
        """Slapo's ``tie_weights`` and ``param_tags``, read from the whole model."""
        return metadata_of(self._root.mod)

    def __getitem__(self, path: str) -> Schedule:
        full = f"{self.path}.{path}" if self.path and path else (path or self.path)
        self._root[full]  # noqa: B018 - raises ScheduleKeyError (a KeyError) naming the closest paths
        return Schedule(self._root, full)

    def __contains__(self, path: str) -> bool:
        return path in self._node

    def __repr__(self) -> str:
        return f"compat.Schedule(path={self.path!r}, module={type(self.mod).__name__})"

    def named_schedules(self, prefix: str = "") -> Iterator[tuple[str, Schedule]]:
        for rel, _ in self._node.named_schedules():
            yield (f"{prefix}.{rel}" if prefix and rel else prefix or rel), (self[rel] if rel else self)

    def get_top_schedule(self) -> Schedule:
        return Schedule(self._root)

    def get_module(self, name: str) -> nn.Module:
        return self.mod.get_submodule(name)

    def __getattr__(self, name: str):
        primitive = _schedule.registered_primitive(name)
        if primitive is None:
            raise AttributeError(f"{type(self).__name__} has no attribute or primitive {name!r}")
        return lambda *args, **kwargs: primitive(self, *args, **kwargs)

    # ------------------------------------------------------------ primitives
    def shard(self, tensor_name: str, axis: int, *, num_fused: int | Sequence[int] = 1) -> None:
        """Slapo's ``shard``; ``num_fused`` (slapo-tune's) shards a fused QKV block by block. A
        parameter records its full shape as ``orig_shape``. A parameter tied to one already
        sharded along the same axis is left as it is: it is that sharded parameter (Slapo
        re-tied it here)."""
        node = self._node
        param = node.mod._parameters.get(tensor_name)
        state = state_of(node.mod)
        spec = state.shards.get(tensor_name) if state is not None else None
        if (param is not None and spec is not None and spec.axis == axis % param.dim()
                and len(node._owners(param)) > 1):
            return
        node.shard(tensor_name, axis, num_fused=num_fused)
        if param is not None:
            node.annotate(tensor_name, "orig_shape", torch.Size(param.shape))
            tag_parameters(node.mod)

    def sync(self, mode: str, sync_op_or_fn: str | Callable, **kwargs) -> None:
        """Slapo's ``sync``: an op name (``axis`` defaults to 0; ``all_gather`` reduce-scatters its
        gradient unless ``tensor_parallel_output_grad=False``), a resharding scheme
        (``"RS->SR"``, ...), or a hook function registered as ``mode`` says."""
        unknown = set(kwargs) - {"axis", "tensor_parallel_output_grad"}
        if unknown:
            raise ScheduleError(f"sync('{self.path}'): unknown argument(s) {', '.join(sorted(unknown))}")
        if callable(sync_op_or_fn):
            if mode not in _HOOKS:
                raise ScheduleError(f"sync('{self.path}'): mode must be one of {', '.join(_HOOKS)}, got {mode!r}")
            getattr(self.mod, _HOOKS[mode])(sync_op_or_fn)
            return
        axis = kwargs.get("axis", 0)
        if isinstance(sync_op_or_fn, str) and "->" in sync_op_or_fn:
            if sync_op_or_fn not in RESHARD:
                raise ScheduleError(f"sync('{self.path}'): unknown resharding scheme {sync_op_or_fn!r}; "
                                    f"known: {', '.join(RESHARD)}")
            op_name, axis, join_axis = RESHARD[sync_op_or_fn]
            if op_name is not None:
                self._node.sync(mode, op_name, axis=axis, join_axis=join_axis)
            return
        reduce_grad = sync_op_or_fn == "all_gather" and kwargs.get("tensor_parallel_output_grad", True)
        self._node.sync(mode, sync_op_or_fn, axis=axis, reduce_grad=reduce_grad)

    def replace(self, new_mod_or_func: nn.Module | Callable, target_ops: Any = None, name: str | None = None,
                concrete_args: dict | None = None) -> None:
        """Slapo's ``replace``: the whole module, subgraphs from ``find`` (a module becomes the
        attribute ``{name or its class name}_0``; a function is called directly; several subgraphs
        become one call, horizontally; see ``compat._subgraphs``), or one node from ``find_node``
        (``(parent_name, node)``: that call becomes ``new(*node.args)``)."""
        if target_ops is None:
            if concrete_args:
                raise ScheduleError(f"replace('{self.path}'): concrete_args is for replacing a subgraph")
            self._node.replace(new_mod_or_func)
        elif isinstance(target_ops, tuple) and len(target_ops) == 2 and isinstance(target_ops[1], fx.Node):
            _graph.replace_call(self._traced(), target_ops[1], new_mod_or_func)
        else:
            matches = _subgraphs.matches_of(target_ops, "replace", several=True)
            _subgraphs.replace_subgraphs(self._node, matches, new_mod_or_func, name, concrete_args)

    def replace_all(self, target_mod_type: type[nn.Module], make_mod_fn: Callable, **kwargs) -> None:
        """Slapo's ``replace_all``: every module of the type becomes ``make_mod_fn(path, module, **kwargs)``."""
        paths = {id(node.mod): path for path, node in self._node.named_schedules()}
        self._node.replace_all(target_mod_type, lambda mod: make_mod_fn(paths[id(mod)], mod, **kwargs))

    def checkpoint(self, subgraph: Any = None, order_args_fn: Callable | None = None) -> None:
        """Slapo's ``checkpoint``: the module (kept in place, its class named ``CheckPointWrapper``
        and ``sch.mod.mod`` reaching it, as under Slapo's wrapper), or a subgraph from ``find``
        (the module ``CheckPointWrapper_0``). ``order_args_fn`` is not needed (keyword inputs are
        checkpointed as they are) and not used."""
        if subgraph is not None:
            self.trace()
            (match,) = _subgraphs.matches_of(subgraph, "checkpoint")
            _subgraphs.checkpoint_subgraph(self._node, match)
            return
        module = self.mod
        self._node.checkpoint()
        _subgraphs.name_checkpointed(module)

    def trace(self, recursive: bool = True, flatten: bool = False, **kwargs) -> bool:
        """Slapo's ``trace``: one graph per module level, each traced child a GraphModule of its own
        (``recursive``), or one flat graph (``flatten``; the children of the traced module stay
        schedules, their descendants do not, as under Slapo). ``concrete_args``: values some inputs
        are traced with (``inspect.Parameter.empty``: not given); ``leaf_modules``: type names (or
        parts of them) and paths kept as calls; ``config``: the model config example inputs are
        shaped from where symbolic tracing fails (default: the module's or the model's). ``tracer``:
        ``"pytorch"`` and ``"huggingface"`` trace alike here; ``"dynamo"`` takes the tensors of
        ``concrete_args`` as example inputs. Raises :class:`~slapo_tune.TraceError` where Slapo
        returned False; a child that cannot be traced stays a module, as under Slapo."""
        if isinstance(self.mod, fx.GraphModule):
            return True
        tracer = kwargs.pop("tracer", "pytorch")
        if tracer not in ("pytorch", "huggingface", "dynamo"):
            raise ScheduleError(f"trace('{self.path}'): unknown tracer {tracer!r}; use 'pytorch', 'huggingface' or 'dynamo'")
        concrete = dict(kwargs.pop("concrete_args", None) or {})
        leaf_names = list(kwargs.pop("leaf_modules", ()))
        config = kwargs.pop("config", None)
        if kwargs:
            raise ScheduleError(f"trace('{self.path}'): unsupported argument(s) {', '.join(sorted(kwargs))}")
        examples = None
        if tracer == "dynamo":
            examples = {k: v for k, v in concrete.items() if isinstance(v, torch.Tensor)}
            concrete = {k: v for k, v in concrete.items() if k not in examples}
        if config is None and _tracing._config_of(self.mod) is None:
            config = getattr(self._root.mod, "config", None)
        self._node.trace(concrete_args=concrete, leaf_names=leaf_names, flatten=flatten, recursive=recursive,
                         config=config, examples=examples)
        if flatten:
            for child in self._node.child.values():
                child.child = {}
        return True

    def trace_until(self, paths: str | Sequence[str], **kwargs) -> bool:
        """Slapo's ``trace_until``: trace the model level by level down to the modules at ``paths``,
        whose children stay calls (so stages can be cut after them). Only on the top module."""
        if self.path:
            raise ScheduleError(f"trace_until('{self.path}'): only the top module traces until a level")
        if isinstance(self.mod, fx.GraphModule):
            raise ScheduleError("trace_until(): the top module is already traced")
        leaves = [name for path in ([paths] if isinstance(paths, str) else paths)
                  for name in _tracing._children(self._root[path].mod)]
        return self.trace(recursive=True, flatten=False, leaf_modules=leaves,
                          tracer=kwargs.pop("tracer", "pytorch"), concrete_args=kwargs.pop("concrete_args", {}))

    def _traced(self) -> fx.GraphModule:
        self.trace()
        return self.mod

    def find_node(self, regex_or_pattern_fn: str | Callable[[fx.Node], bool]) -> list[tuple[str, fx.Node]]:
        """Nodes of this (traced) module: module calls whose target matches a regex at its start,
        or nodes for which a predicate holds; as ``(parent_name, node)``."""
        nodes = self._traced().graph.nodes
        if isinstance(regex_or_pattern_fn, str):
            regex = re.compile(regex_or_pattern_fn)
            return [("", n) for n in nodes if n.op == "call_module" and regex.match(n.target)]
        return [("", n) for n in nodes if regex_or_pattern_fn(n)]

    def find(self, regex_or_pattern_fn: str | Callable) -> list:
        """A regex: :meth:`find_node`. A pattern function: its subgraphs, ``[[(parent_name, node),
        ...], ...]``, ``[]`` when nothing matches (a pattern that cannot be matched raises
        :class:`~slapo_tune.PatternError`). Matched as Slapo did, by operation and dataflow: each use
        of a pattern argument is its own wildcard and the pattern's constants match anything
        (``_graph.find_pattern(by_operation=True)``)."""
        if isinstance(regex_or_pattern_fn, str):
            return self.find_node(regex_or_pattern_fn)
        self.trace()
        return [Subgraph(m) for m in _graph.find_pattern(self._node, regex_or_pattern_fn, allow_empty=True,
                                                         by_operation=True)]

    def fuse(self, subgraph: Any, compiler: str | None = "TorchScript", name: str = "FusedModule") -> None:
        """Slapo's ``fuse``: the subgraph becomes the module ``{name}_0``: scripted with
        ``torch.jit.script`` (``"TorchScript"``), uncompiled (``None``: a module of class ``name``
        whose attributes ``"0"``, ``"1"``, ... are the modules it calls) or compiled with another
        torch.compile backend (``"inductor"``, ...)."""
        (match,) = _subgraphs.matches_of(subgraph, "fuse")
        _subgraphs.fuse_subgraph(self._node, match, compiler, name)

    def decompose(self) -> None:
        self._node.decompose()

    def cut_pipeline_stage(self) -> None:
        """A stage ends after this module. Under a traced parent (``trace_until``), Slapo's cut in
        its graph, for ``slapo.pipeline.generate_pipeline_partition``; else slapo-tune's (after a
        block of a module list, for ``build`` with a pipeline topology)."""
        parent = self._node.parent
        if parent is not None and isinstance(parent.mod, fx.GraphModule):
            mark_cut(self._node)
            return
        self._node.cut_pipeline_stage()

    def annotate(self, param_name: str, key: str, value: Any) -> None:
        """Slapo's ``annotate``: the parameter carries ``value`` as attribute ``key`` now and after ``build``."""
        self._node.annotate(param_name, key, value)
        tag_parameters(self.mod)

    def fork_rng(self) -> None:
        self._node.fork_rng()


def create_schedule(root: nn.Module, name: str = "", path: str = "", parent: Any = None, group=None,
                    **kwargs) -> Schedule:
    """Slapo's ``create_schedule`` (``name``, ``path`` and ``parent`` are Slapo's internals: a
    schedule is created for a whole model here)."""
    if name or path or parent is not None or kwargs:
        raise ScheduleError("create_schedule(): pass the model and optionally group=; a sub-schedule is sch[path]")
    return Schedule(_schedule.create_schedule(root, group=group))


def build(sch: Schedule, target: str | None = None, init_weights: bool | Callable = True,
          **kwargs) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Slapo's ``build``: ``(model, optimizer)``. ``init_weights``: True or False (real tensors are
    never re-initialised, meta ones always are), or ``fn(module)`` / ``fn(module, path)``.
    ``optimizer``: a factory (``torch.optim.AdamW`` or ``lambda params: ...``) called with the built
    model's parameters. Other keywords go to :func:`slapo_tune.build` (device, dtype, seed,
    topology, zero, precision)."""
    if target is not None:
        raise ScheduleError(f"build(target={target!r}): slapo-tune runs pipelines and data parallelism itself; "
                            "pass topology=slapo_tune.topology.init_topology(...) instead of a framework target")
    optimizer = kwargs.pop("optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ScheduleError("build(optimizer=...): pass a factory (e.g. torch.optim.AdamW); an optimizer made "
                            "before build holds the unsharded, unmaterialised parameters")
    model = _build(sch._root, init_weights=init_weights if callable(init_weights) else None, **kwargs)
    tag_parameters(model)
    return model, (optimizer(model.parameters()) if optimizer is not None else None)


def _default_loss(output: Any) -> torch.Tensor:
    """A loss that weighs every element of the first output differently (a plain sum would give
    every element the same gradient and hide a permuted output)."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    tensor = output if isinstance(output, torch.Tensor) else next(
        t for t in (output.values() if isinstance(output, Mapping) else output) if isinstance(t, torch.Tensor))
    weights = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(2023), dtype=torch.float64)
    return (tensor.double() * weights.to(tensor.device)).sum()


class Verify(contextlib.ContextDecorator):
    """Slapo's ``Verify``: ``with Verify(sch, example_inputs): <primitives>`` checks on exit that
    the scheduled model computes what the model computed on entry: outputs, loss and every
    gradient (slapo-tune's :func:`~slapo_tune.verify`; Slapo compared forward outputs). Raises
    :class:`~slapo_tune.VerificationError` (an ``AssertionError``); ``self.report`` keeps the report.
    ``loss_fn(output)``: default the output's ``loss``, else a fixed random weighting of it."""

    def __init__(self, sch: Schedule, example_inputs: Any, device: str | torch.device | None = None,
                 eval_mode: bool = True, enable: bool = True, *, loss_fn: Callable | None = None,
                 tolerance: float | None = None, init_weights: Callable | None = None):
        self.sch, self.enable, self.eval_mode = sch, enable, eval_mode
        self.inputs = example_inputs if isinstance(example_inputs, Mapping | list | tuple) else [example_inputs]
        self.device, self.loss_fn, self.tolerance, self.init_weights = device, loss_fn, tolerance, init_weights
        self.reference: nn.Module | None = None
        self.report: VerifyReport | None = None

    def __enter__(self) -> Verify:
        if self.enable:
            model = self.sch.get_top_schedule().mod
            if any(state_of(m) is not None and state_of(m).shards for m in model.modules()):
                raise VerificationError("Verify: the model is already sharded, so it cannot serve as the reference; "
                                        "open Verify before the first shard()")
            self.reference = copy.deepcopy(model)
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        if not self.enable or exc_type is not None:
            return False
        top = self.sch.get_top_schedule()
        model = _build(top._root, init_weights=self.init_weights)
        device = self.device or next((p.device for p in model.parameters()), torch.device("cpu"))
        model.to(device)
        inputs = {k: self._same_on_every_rank(v, device) for k, v in self.inputs.items()} \
            if isinstance(self.inputs, Mapping) else tuple(self._same_on_every_rank(v, device) for v in self.inputs)
        self.report = _verify(model, self.reference, inputs, loss_fn=self.loss_fn or _default_loss,
                              tolerance=self.tolerance, deterministic=self.eval_mode, init_weights=self.init_weights)
        model.zero_grad(set_to_none=True)
        return False

    def _same_on_every_rank(self, value: Any, device) -> Any:
        """Rank 0's input on every rank of the schedule's group, as Slapo broadcast it."""
        if not isinstance(value, torch.Tensor):
            return value
        value = value.to(device)
        group = self.sch.group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            value = value.clone()
            dist.broadcast(value, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return value


def checkpoint(function: Callable, *args, **kwargs):
    """Slapo's ``checkpoint``: ``function(*args, **kwargs)`` with activation checkpointing (the RNG
    states replayed, those of ``get_cuda_rng_tracker()`` included; keyword inputs allowed)."""
    return _state.checkpointed_call(tracker_aware(function), "full", *args, **kwargs)


@contextlib.contextmanager
def init_empty_weights(enable: bool = True) -> Iterator[None]:
    """Slapo's ``init_empty_weights``: modules created inside live on the meta device (``build``
    gives them values)."""
    with torch.device("meta") if enable else contextlib.nullcontext():
        yield


__all__ = ["RESHARD", "Pattern", "Schedule", "ScheduleMetadata", "Subgraph", "Verify", "build", "call_module",
           "checkpoint", "create_schedule", "get_cuda_rng_tracker", "get_logger", "init_empty_weights",
           "is_random_seed_set", "list_primitives", "op", "register_primitive", "set_random_seed"]
