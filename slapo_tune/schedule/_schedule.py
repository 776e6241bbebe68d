"""The schedule tree and its module-level primitives.

``create_schedule(model)`` wraps an unmodified ``nn.Module`` in a tree of :class:`Schedule` nodes,
one per submodule, addressed by the submodule's own path (``sch["transformer.h.0.attn"]``). Each
primitive is a method on a node; it checks everything first and changes the model only when it
can succeed, so a refused primitive leaves the model exactly as it was.

What a primitive decides is stored on the module itself (``module._slapo``), so it travels with the
module through ``replace``, ``deepcopy`` and stage construction; the tree is only an index.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed import ProcessGroup

from ..errors import PipelineError, ScheduleError, ScheduleKeyError, ShardingError, SyncError
from ..parallel import _comm
from . import _graph, _tracing
from ._sharding import PARTIAL, Layout, ShardEffect, ShardSpec, is_conv1d, rule_for
from ._state import (
    CHECKPOINT_POLICIES,
    SYNC_MODES,
    SYNC_OPS,
    TRACED_FROM,
    ModuleState,
    SyncSpec,
    _ensure_forward_patched,
    _ensure_hooks,
    _layout_after,
    copy_hooks,
    state_of,
)


def _required_positional(fn: Callable) -> int:
    params = inspect.signature(fn).parameters.values()
    return sum(
        1
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    )


def _accepts_positional(fn: Callable, n: int) -> bool:
    try:
        inspect.signature(fn).bind_partial(*([None] * n))
    except TypeError:
        return False
    return True


class Schedule:
    """A node of the schedule tree: one module, its path, and the primitives that apply to it.

    Nodes are created by :func:`create_schedule`; index a node with a dotted path relative to it.
    """

    def __init__(self, module: nn.Module, name: str = "", path: str = "", parent: Schedule | None = None,
                 group: ProcessGroup | None = None):
        self.mod = module
        self.name = name
        self.path = path
        self.parent = parent
        self.group = group
        self.child: dict[str, Schedule] = {}
        self._build_children()

    def _build_children(self) -> None:
        self.child = {
            name: Schedule(sub, name, f"{self.path}.{name}" if self.path else name, self, self.group)
            for name, sub in self.mod.named_children()
        }

    # ------------------------------------------------------------------ tree
    @property
    def root(self) -> Schedule:
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    @property
    def world_size(self) -> int:
        """Size of this schedule's (tensor-parallel) process group."""
        return _comm.group_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in the schedule's (tensor-parallel) process group."""
        return _comm.group_rank(self.group)

    def __getitem__(self, path: str) -> Schedule:
        node = self
        for part in path.split(".") if path else []:
            if part not in node.child:
                raise ScheduleKeyError(self._missing_path_message(path))
            node = node.child[part]
        return node

    def __contains__(self, path: str) -> bool:
        try:
            self[path]
        except ScheduleKeyError:
            return False
        return True

    def _missing_path_message(self, path: str) -> str:
        known = [p for p, _ in self.named_schedules() if p]
        close = difflib.get_close_matches(path, known, n=3, cutoff=0.5)
        where = f"under '{self.path}'" if self.path else "in the model"
        hint = f"; closest valid paths: {', '.join(repr(c) for c in close)}" if close else ""
        return f"no module '{path}' {where}{hint}"

    def named_schedules(self, prefix: str = "") -> Iterator[tuple[str, Schedule]]:
        """Yield ``(relative path, node)`` for this node and every descendant, parents first."""
        yield prefix, self
        for name, node in self.child.items():
            yield from node.named_schedules(f"{prefix}.{name}" if prefix else name)

    def find(self, pattern: str | Callable) -> list:
        """Find what a later primitive should act on.

        A string is a regular expression over descendant paths: the nodes whose relative path
        matches fully. A function of tensors (``lambda x, b: F.gelu(x + b)``) or an ``nn.Module``
        is a subgraph pattern: its non-overlapping :class:`~slapo_tune.schedule._graph.Match` es in this
        traced module. Module calls and their functional forms match each other
        (``nn.GELU(approximate="tanh")`` finds ``F.gelu(..., approximate="tanh")`` and GPT-2's
        ``gelu_new``; see ``slapo_tune.schedule._patterns``). A pattern that matches nothing, or cannot be
        matched, raises :class:`PatternError`.
        """
        if callable(pattern):
            return _graph.find_pattern(self, pattern)
        regex = re.compile(pattern)
        return [node for path, node in self.named_schedules() if path and regex.fullmatch(path)]

    def __repr__(self) -> str:
        return f"Schedule(path={self.path!r}, module={type(self.mod).__name__})"

    # ------------------------------------------------------------ primitives
    def replace(self, new_module: nn.Module | Callable, target: Any = None, *, name: str | None = None) -> Schedule | str:
        r"""Swap this node's module for ``new_module``, carrying its hooks and schedule state over.

        The new module's ``forward`` must accept the inputs the old one required. Refused for the
        root (use the new model directly) and for modules with sharded parameters (shard the new
        module instead). Returns the new node.

        With ``target``: a :class:`~slapo_tune.schedule._graph.Match` from :meth:`find` (on this traced
        module) is replaced by one call of ``new_module`` (a module or function of the match's
        inputs): vertical fusion; returns the name of the inserted submodule. A list of sibling
        nodes (e.g. ``find(r"self_attn\.[qkv]_proj")``) is fused horizontally into
        ``new_module(list_of_modules)`` (``slapo_tune.fuse_linears`` builds the usual one), each
        former module becoming a slice of its output; returns the fused node.
        """
        if target is not None:
            if isinstance(target, _graph.Match):
                return _graph.replace_match(target, new_module, name or "replaced")
            if isinstance(target, Sequence) and len(target) == 1 and isinstance(target[0], _graph.Match):
                return _graph.replace_match(target[0], new_module, name or "replaced")
            if isinstance(target, Sequence) and all(isinstance(t, Schedule) for t in target):
                return _graph.replace_horizontal(list(target), new_module, name)
            raise ScheduleError(f"replace('{self.path}'): target must be a Match from find() or a list of sibling nodes")
        if not isinstance(new_module, nn.Module):
            raise ScheduleError(f"replace('{self.path}'): expected an nn.Module, got {type(new_module).__name__}")
        if self.parent is None:
            raise ScheduleError("replace(): cannot replace the root module; schedule the new model instead")
        old = self.mod
        state = state_of(old)
        if state is not None and state.shards:
            raise ScheduleError(
                f"replace('{self.path}'): its parameters {sorted(state.shards)} are sharded; "
                "replace the module before sharding it"
            )
        needed = _required_positional(type(old).forward) - 1  # minus self
        if not _accepts_positional(new_module.forward, needed):
            raise ScheduleError(
                f"replace('{self.path}'): {type(new_module).__name__}.forward cannot take the {needed} "
                f"positional input(s) that {type(old).__name__}.forward requires"
            )
        return self._swap(new_module, state)

    def _swap(self, new_module: nn.Module, state: ModuleState | None) -> Schedule:
        copy_hooks(self.mod, new_module)
        if state is not None:
            new_module.__dict__["_slapo"] = state
            if state.changes_forward:
                _ensure_forward_patched(new_module)
        if self.parent is None:
            self.mod = new_module
            self._build_children()
            return self
        setattr(self.parent.mod, self.name, new_module)
        node = Schedule(new_module, self.name, self.path, self.parent, self.group)
        self.parent.child[self.name] = node
        return node

    def trace(self, example_args: tuple | None = None, example_kwargs: dict | None = None, *,
              model_inputs: dict | None = None, leaf_types: tuple[type, ...] = (), **levels) -> Schedule:
        """Turn this module into a graph (``torch.fx.GraphModule``) that ``find`` can match.

        The traced module keeps its path, parameters and numerics. Sharded/synced/checkpointed
        submodules stay opaque calls; ``decompose``d layers are traced through. If ``torch.fx``
        cannot trace the module, ``torch.export`` traces it from example inputs (the graph is then
        specialised to their shapes): ``example_args``/``example_kwargs`` exactly as the parent
        calls it, or ``model_inputs`` for the whole model, from which this module's call is
        captured. Raises :class:`TraceError` naming the module and the reason. ``levels``: Slapo's
        options (``concrete_args``, ``leaf_names``, ``flatten``, ``recursive``, ``config``; see
        :func:`slapo_tune.schedule._tracing.trace_levels`), used by ``slapo_tune.compat``.
        """
        if model_inputs is not None:
            example_args, example_kwargs = _graph.capture_call(self.root.mod, self.mod, model_inputs)
        path = self.path or type(self.mod).__name__
        if levels:  # Slapo's tracing, level by level
            gm = _tracing.trace_levels(self.mod, path, leaf_types=leaf_types, **levels)
        else:
            gm = _graph.trace_module(self.mod, path, example_args, example_kwargs, leaf_types)
        # a model's initialiser recognises modules by type: keep the original for materialisation
        gm.__dict__[TRACED_FROM] = self.mod.__dict__.get(TRACED_FROM, self.mod)
        return self._swap(gm, state_of(self.mod))

    def decompose(self) -> None:
        """Split a ``Linear`` / ``Conv1D`` into a matrix product and a separate bias addition, so a
        pattern can fuse the bias with what follows (``trace`` the parent afterwards)."""
        if not isinstance(self.mod, nn.Linear) and not is_conv1d(self.mod):
            raise ScheduleError(f"decompose('{self.path}'): only Linear and Conv1D layers decompose, not {type(self.mod).__name__}")
        st = state_of(self.mod)
        if st is not None and (st.decomposed or st.defers_bias):
            why = "already decomposed" if st.decomposed else "its output is partial, so its bias must follow the reduction"
            raise ScheduleError(f"decompose('{self.path}'): {why}")
        st = state_of(self.mod, create=True)
        st.decomposed, st.compute = True, _graph.decomposed_forward
        _ensure_forward_patched(self.mod)

    def fuse(self, target: Any = None, compiler: str = "inductor", *, name: str = "fused") -> Schedule | str:
        """Compile this module, or a :class:`Match` of it, with a ``torch.compile`` backend
        (``"inductor"``, ``"aot_eager"``, ...; ``"eager"`` keeps the subgraph as one uncompiled call).

        A match becomes one submodule running the compiled subgraph; returns its name.
        """
        if target is None:
            if compiler != "eager":
                self.mod.compile(backend=compiler, dynamic=True)
            return self
        match = target[0] if isinstance(target, Sequence) and len(target) == 1 else target
        if not isinstance(match, _graph.Match):
            raise ScheduleError(f"fuse('{self.path}'): target must be a Match from find()")
        return _graph.fuse_match(match, compiler, name)

    def replace_all(self, module_type: type[nn.Module], make_fn: Callable[[nn.Module], nn.Module]) -> int:
        """Replace every descendant of type ``module_type`` by ``make_fn(old_module)``; returns the count."""
        targets = [node for path, node in self.named_schedules() if path and isinstance(node.mod, module_type)]
        outermost = [n for n in targets if not any(n.path.startswith(t.path + ".") for t in targets)]
        replacements = [(node, make_fn(node.mod)) for node in outermost]
        for node, new in replacements:
            node.replace(new)
        return len(replacements)

    def _owners(self, tensor: torch.Tensor, buffer: bool = False) -> list[tuple[nn.Module, str]]:
        """Every (module, attribute) in the whole model that holds ``tensor`` (ties included)."""
        return [
            (m, n)
            for m in self.root.mod.modules()
            for n, p in (m._buffers if buffer else m._parameters).items()
            if p is tensor
        ]

    def shard(self, param_names: str | Sequence[str], axis: int, *, num_fused: int | Sequence[int] = 1) -> None:
        """Keep this rank's 1/world_size slice of parameter(s) or buffer(s) along ``axis``.

        The module's size attributes follow (for ``Linear``, ``Conv1D``, ``Embedding``), and the
        layouts of its input and output are inferred: sharding the output features makes the output
        a partition; sharding the input features makes it partial (sum it with
        ``sync("fwd_post", "all_reduce")``); sharding an embedding's vocabulary masks foreign ids
        and makes the output partial. Tied parameters are sharded once, for every module holding
        them. ``num_fused`` splits a fused axis block by block: a count of equal blocks (QKV = 3) or
        the block sizes (grouped-query QKV: ``[q, k, v]`` features). A buffer (a mask, a per-feature
        scale) is sliced the same way; nothing about the module's sizes or layouts is inferred
        from it, and ``build`` materialises it at full size before slicing, as a parameter.
        """
        names = [param_names] if isinstance(param_names, str) else list(param_names)
        blocks = tuple(num_fused) if isinstance(num_fused, Sequence) else ()
        num_fused = len(blocks) if blocks else num_fused
        if num_fused < 1:
            raise ShardingError(f"shard('{self.path}'): num_fused must be >= 1, got {num_fused}")
        size, rank = self.world_size, self.rank
        plans = []
        for name in names:
            is_buffer = name not in self.mod._parameters and self.mod._buffers.get(name) is not None
            param = self.mod._buffers.get(name) if is_buffer else self.mod._parameters.get(name)
            if param is None:
                have = ", ".join(repr(n) for n, _ in self.mod.named_parameters(recurse=False)) or "none"
                buffers = ", ".join(repr(n) for n, _ in self.mod.named_buffers(recurse=False))
                raise ShardingError(
                    f"shard('{self.path}'): {type(self.mod).__name__} has no parameter '{name}' (parameters: {have}"
                    + (f"; buffers: {buffers})" if buffers else ")")
                )
            if not -param.dim() <= axis < param.dim():
                raise ShardingError(
                    f"shard('{self.path}.{name}'): axis {axis} is out of range for a {param.dim()}-d parameter"
                )
            ax = axis % param.dim()
            owners = self._owners(param, is_buffer)
            for m, n in owners:
                st = state_of(m)
                if st is not None and n in st.shards:
                    tied = "" if m is self.mod else " (it is tied to a parameter sharded elsewhere)"
                    raise ShardingError(f"shard('{self.path}.{name}'): already sharded{tied}; shard a parameter once")
            if blocks and (sum(blocks) != param.shape[ax] or any(b % size for b in blocks)):
                raise ShardingError(
                    f"shard('{self.path}.{name}'): fused blocks {list(blocks)} must add up to dimension {ax} "
                    f"({param.shape[ax]}) and each be divisible by the tensor-parallel size {size}"
                )
            if not blocks and param.shape[ax] % (size * num_fused):
                raise ShardingError(
                    f"shard('{self.path}.{name}'): dimension {ax} of size {param.shape[ax]} is not divisible "
                    f"by {size * num_fused} (tensor-parallel size {size}"
                    + (f" x {num_fused} fused blocks)" if num_fused > 1 else ")")
                )
            spec = ShardSpec(ax, tuple(param.shape), size, rank, num_fused, self.group, blocks)
            effects = []
            for m, n in owners:
                st = state_of(m) or ModuleState()
                effect = ShardEffect() if is_buffer else rule_for(m).effect(m, n, ax, size, {**st.shards, n: spec})
                effects.append((m, n, effect))
            plans.append((param, spec, effects, is_buffer))
        for param, spec, effects, is_buffer in plans:
            if param.device.type == "meta":
                data = torch.empty(spec.local_shape, dtype=param.dtype, device="meta")
            else:
                data = spec.take(param.detach())
            new_param = data if is_buffer else nn.Parameter(data, requires_grad=param.requires_grad)
            for m, n, eff in effects:
                st = state_of(m, create=True)
                (m._buffers if is_buffer else m._parameters)[n] = new_param
                st.shards[n] = spec
                for attr, value in eff.attrs.items():
                    setattr(m, attr, value)
                st.input_layout = eff.input_layout or st.input_layout
                st.output_layout = eff.output_layout or st.output_layout
                if eff.compute is not None:
                    st.compute = eff.compute
                    _ensure_forward_patched(m)
                if eff.defers_bias:
                    st.defers_bias = True
                    _ensure_hooks(m, st)

    def is_sharded(self, param_name: str) -> bool:
        """Whether ``param_name`` of this module is sharded (directly or through a tie)."""
        st = state_of(self.mod)
        return st is not None and param_name in st.shards

    def sync(self, mode: str, op: str | Callable = "all_reduce", *, axis: int = -1, join_axis: int | None = None,
             reduce_grad: bool = False) -> None:
        """Attach a communication to this module's boundary.

        ``mode``: ``"fwd_pre"`` (on the first tensor input, forward), ``"fwd_post"`` (on the output,
        forward; on the first element of a tuple output) or ``"bwd_post"`` (on the gradient of the
        first tensor input, i.e. after this module's backward). ``op``: ``"all_reduce"``,
        ``"all_gather"``, ``"reduce_scatter"``, ``"scatter"``, ``"all_to_all"`` (each with its
        conjugate backward), or a callable ``fn(tensor, group) -> tensor``. A sync that contradicts
        the inferred layout is refused: an all-reduce of a partitioned output, an all-gather of a
        partial one, ...

        ``all_gather`` keeps this rank's chunk of the gradient in backward (the consumer is
        replicated); with ``reduce_grad=True`` it reduce-scatters it instead (the consumer is
        sharded, e.g. column-parallel layers). ``all_to_all`` re-partitions a tensor sliced along
        ``join_axis`` into slices along ``axis`` (DeepSpeed-Ulysses: ``axis=2, join_axis=1`` turns
        sequence-sharded ``[batch, seq, heads, dim]`` into head-sharded).
        """
        if mode not in SYNC_MODES:
            raise SyncError(f"sync('{self.path}'): mode must be one of {', '.join(SYNC_MODES)}, got {mode!r}")
        if not callable(op) and op not in SYNC_OPS:
            raise SyncError(
                f"sync('{self.path}'): op must be one of {', '.join(SYNC_OPS)} or a callable, got {op!r}"
            )
        if mode == "bwd_post" and not callable(op) and op != "all_reduce":
            raise SyncError(
                f"sync('{self.path}', 'bwd_post'): only all_reduce (or a callable) applies to input gradients; "
                f"for {op} use fwd_pre, whose backward is the conjugate"
            )
        if (op == "all_to_all") != (join_axis is not None):
            raise SyncError(f"sync('{self.path}'): join_axis goes with all_to_all, and all_to_all needs one "
                            f"(the axis the input is partitioned along), got op={op!r}, join_axis={join_axis!r}")
        if reduce_grad and op != "all_gather":
            raise SyncError(f"sync('{self.path}'): reduce_grad applies to all_gather only, not {op!r}")
        spec = SyncSpec(mode, op, axis, self.group, join_axis, reduce_grad)
        st = state_of(self.mod) or ModuleState()
        if not callable(op):
            self._check_sync_layout(spec, st)
        st = state_of(self.mod, create=True)
        (st.post_syncs if mode == "fwd_post" else st.pre_syncs).append(spec)
        _ensure_hooks(self.mod, st)

    def _check_sync_layout(self, s: SyncSpec, st: ModuleState) -> None:
        where = f"sync('{self.path}', '{s.mode}', '{s.op}')"
        if s.mode == "fwd_post":
            layout = st.synced_output_layout
            wanted = {
                "all_reduce": ("partial",),
                "reduce_scatter": ("partial",),
                "all_gather": ("partition",),
                "scatter": ("replicated",),
                "all_to_all": ("partition",),
            }[s.op]
            if layout is not None and layout.kind not in wanted:
                raise SyncError(f"{where}: the output is {layout}, so {s.op} would be wrong (it needs a {wanted[0]} tensor)")
            if (s.op == "all_gather" and layout is not None and layout.axis is not None
                    and s.axis < 0 and layout.axis < 0 and s.axis != layout.axis):
                raise SyncError(f"{where}: the output is partitioned along axis {layout.axis}, not {s.axis}")
            return
        expected = st.input_layout
        if expected is None:
            return
        if s.mode == "bwd_post":
            if expected.kind == "partition":
                raise SyncError(
                    f"{where}: the input is {expected}, so its gradient is partitioned too; "
                    "an all-reduce would sum different slices"
                )
            return
        produces = _layout_after(s, None)
        if produces is not None and produces.kind != expected.kind:
            raise SyncError(f"{where}: the module expects a {expected} input, but {s.op} produces a {produces} one")

    def checkpoint(self, policy: str = "full", target: Any = None) -> str | None:
        """Recompute this module's activations in backward instead of keeping them.

        ``policy="full"`` keeps only the module's inputs and recomputes its whole forward;
        ``"selective"`` also keeps the outputs of its linear layers' matmuls and recomputes the
        rest (element-wise ops, norms, activations, the attention core): memory and recomputation
        time between no checkpointing and full (Megatron's selective recomputation).
        Non-reentrant (keyword inputs work, e.g. Hugging Face layers), and the RNG state is
        replayed, so dropout masks in the recomputation equal the first ones: results are exact.

        With ``target``, a :class:`~slapo_tune.schedule._graph.Match` from :meth:`find` on this traced
        module, only that subgraph is checkpointed: it becomes one submodule call whose inner
        activations are recomputed (its inputs and result are kept); returns the submodule's name.
        """
        if policy not in CHECKPOINT_POLICIES:
            raise ScheduleError(
                f"checkpoint('{self.path}'): unknown policy {policy!r}; the policies are "
                + ", ".join(repr(p) for p in CHECKPOINT_POLICIES)
            )
        if target is not None:
            match = target[0] if isinstance(target, Sequence) and len(target) == 1 else target
            if not isinstance(match, _graph.Match) or match.owner.mod is not self.mod:
                raise ScheduleError(f"checkpoint('{self.path}'): target must be a Match from this node's find()")
            return _graph.checkpoint_match(match, policy)
        if isinstance(self.mod, nn.ModuleList | nn.ModuleDict):
            raise ScheduleError(
                f"checkpoint('{self.path}'): a {type(self.mod).__name__} has no forward; checkpoint its children"
            )
        st = state_of(self.mod)
        if st is not None and st.checkpointed:
            raise ScheduleError(f"checkpoint('{self.path}'): already checkpointed")
        st = state_of(self.mod, create=True)
        st.checkpointed, st.checkpoint_policy = True, policy
        _ensure_forward_patched(self.mod)
        return None

    def fork_rng(self) -> None:
        """Give each tensor-parallel rank its own dropout stream inside this module.

        Use it where activations are partitioned (attention heads): replicated masks there would
        make the ranks drop the same positions of different heads. Safe under checkpointing.
        """
        st = state_of(self.mod)
        if st is not None and st.forks_rng:
            raise ScheduleError(f"fork_rng('{self.path}'): already forked")
        st = state_of(self.mod, create=True)
        st.forks_rng, st.rng_group = True, self.group
        _ensure_forward_patched(self.mod)

    def cut_pipeline_stage(self) -> None:
        """End a pipeline stage after this block (a child of the repeated block list).

        ``k`` cuts make ``k + 1`` stages; :func:`slapo_tune.build` with a topology whose ``pp``
        equals the stage count keeps this rank's stage.
        """
        check_cut(self)
        state_of(self.mod, create=True).cut_after = True

    def annotate(self, param_name: str, key: str, value: Any) -> None:
        """Tag a parameter; tags survive sharding and the re-creation of the parameter by ``build``."""
        if param_name not in self.mod._parameters:
            raise ScheduleError(f"annotate('{self.path}'): {type(self.mod).__name__} has no parameter '{param_name}'")
        st = state_of(self.mod, create=True)
        st.annotations.setdefault(param_name, {})[key] = value

    def get_annotation(self, param_name: str, key: str, default: Any = None) -> Any:
        """A tag set by :meth:`annotate`, or ``default``."""
        st = state_of(self.mod)
        return default if st is None else st.annotations.get(param_name, {}).get(key, default)

    def set_attr(self, name: str, value: Any) -> None:
        """Overwrite a plain attribute of the module (e.g. a head count divided by tensor parallelism)."""
        if name not in self.mod.__dict__ or isinstance(getattr(self.mod, name), nn.Module | torch.Tensor):
            raise ScheduleError(
                f"set_attr('{self.path}'): {type(self.mod).__name__} has no plain attribute '{name}'"
            )
        setattr(self.mod, name, value)


# ------------------------------------------------------------------ pipeline cuts
# where cut_pipeline_stage may cut, and the cuts made: the pipeline (._pipeline) turns them into stages
def cut_nodes(sch: Schedule) -> list[Schedule]:
    return [node for _, node in sch.named_schedules() if getattr(state_of(node.mod), "cut_after", False)]


def check_cut(node: Schedule) -> None:
    """Refuse a cut that cannot define stages (raised by ``Schedule.cut_pipeline_stage``)."""
    if node.parent is None:
        raise PipelineError("cut_pipeline_stage(): cannot cut at the root; cut after a block of the block list")
    if not isinstance(node.parent.mod, nn.ModuleList):
        raise PipelineError(
            f"cut_pipeline_stage('{node.path}'): stages end after a block of a repeated block list "
            f"(nn.ModuleList), but '{node.parent.path}' is a {type(node.parent.mod).__name__}"
        )
    st = state_of(node.mod)
    if st is not None and getattr(st, "cut_after", False):
        raise PipelineError(f"cut_pipeline_stage('{node.path}'): already cut here")
    others = [n for n in cut_nodes(node.root) if n.parent is not node.parent]
    if others:
        raise PipelineError(
            f"cut_pipeline_stage('{node.path}'): all cuts must be in one block list, "
            f"but '{others[0].path}' is already cut"
        )
    names = list(node.parent.child)
    if names.index(node.name) == len(names) - 1:
        raise PipelineError(
            f"cut_pipeline_stage('{node.path}'): a cut after the last block leaves the last stage with no blocks"
        )


def create_schedule(model: nn.Module, group: ProcessGroup | None = None) -> Schedule:
    """Build the schedule tree of ``model``.

    ``group`` is the tensor-parallel process group the primitives shard and communicate over
    (default: the whole world when torch.distributed is initialised, else a single process).
    The model is not modified until a primitive is applied.
    """
    if not isinstance(model, nn.Module):
        raise ScheduleError(f"create_schedule(): expected an nn.Module, got {type(model).__name__}")
    return Schedule(model, group=group)


# the primitives every node has (methods of Schedule), and those added by register_primitive
BUILTIN_PRIMITIVES = ("replace", "replace_all", "shard", "sync", "checkpoint", "trace", "find", "fuse", "decompose",
                      "cut_pipeline_stage", "annotate", "fork_rng", "set_attr")
_REGISTERED: dict[str, Callable] = {}


def registered_primitive(name: str) -> Callable | None:
    """The function registered as primitive ``name`` (None for a built-in or unknown name)."""
    return _REGISTERED.get(name)


def register_primitive(primitive: Callable | type | None = None, *, name: str | None = None):
    """Add a primitive to every schedule node: ``sch[path].<name>(*args)`` calls
    ``primitive(node, *args)``.

    ``primitive`` is a function of the node, or a class with a static ``apply(sch, ...)`` and
    optionally a static ``name()`` (Slapo's form). Use as ``@register_primitive`` or
    ``@register_primitive(name="...")``. The name defaults to the function's (or ``name()``);
    a name a node already has is refused. Returns ``primitive`` unchanged.
    """

    def register(obj: Callable | type):
        apply = getattr(obj, "apply", None) if isinstance(obj, type) else obj
        if not callable(apply):
            raise ScheduleError(f"register_primitive(): {obj!r} is neither a function nor a class with apply(sch, ...)")
        key = name
        if key is None:
            key = obj.name() if isinstance(obj, type) and callable(getattr(obj, "name", None)) else obj.__name__
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ScheduleError(f"register_primitive(): {key!r} is not a usable name (an identifier not starting with _)")
        if key in _REGISTERED or hasattr(Schedule, key):
            what = "registered already" if key in _REGISTERED else "a built-in attribute of schedule nodes"
            raise ScheduleError(f"register_primitive(): '{key}' is {what}; choose another name")

        @functools.wraps(apply)
        def method(self, *args, **kwargs):
            return apply(self, *args, **kwargs)

        setattr(Schedule, key, method)
        _REGISTERED[key] = apply
        return obj

    return register if primitive is None else register(primitive)


def unregister_primitive(name: str) -> None:
    """Remove a primitive added by :func:`register_primitive`."""
    if name not in _REGISTERED:
        raise ScheduleError(f"unregister_primitive(): no registered primitive '{name}'")
    del _REGISTERED[name]
    delattr(Schedule, name)


def list_primitives(name_only: bool = True) -> list[str] | dict[str, Callable]:
    """The primitives of a schedule node: names (built-in first, then registered ones), or, with
    ``name_only=False``, ``{name: function}`` (a built-in's is the :class:`Schedule` method)."""
    table = {**{n: getattr(Schedule, n) for n in BUILTIN_PRIMITIVES}, **_REGISTERED}
    return list(table) if name_only else table


__all__ = ["Schedule", "create_schedule", "state_of", "ModuleState", "SyncSpec", "Layout", "PARTIAL",
           "register_primitive", "unregister_primitive", "list_primitives"]
