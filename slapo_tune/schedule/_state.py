"""What a primitive decides about one module, stored on the module itself (``module._slapo``), and
the hooks and forward that carry it out: a module's syncs, sharding layouts, checkpointing and
forked RNG, its initialisation parts, and the hook dictionaries a replacement takes over. It
travels with the module through ``replace``, ``deepcopy`` and stage construction. The schedule tree
(:mod:`._schedule`), graph rewrites (:mod:`._graph`), tracing, pipeline cuts and materialisation
all read it; it imports none of them.
"""


import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..errors import SyncError
from ..parallel import _comm
from ._sharding import REPLICATED, Layout, ShardSpec, partition

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
TRACED_FROM = "_slapo_traced_from"
INIT_PARTS = "_slapo_init_parts"  # {param: [(path, original module, param name), ...]} of a fused module
SYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter", "scatter", "all_to_all")

# Selective activation recomputation (Korthikanti et al., 2022, "Reducing Activation Recomputation
# in Large Transformer Models"): keep the outputs of the linear layers' matmuls, whose recomputation
# is most of a block's flops, and recompute everything else from them: element-wise ops, norms,
# activation functions, dropout, the attention core (eager attention's bmm and softmax, SDPA's
# kernels) and views. On CPU and CUDA a linear layer reaches the dispatcher as ``aten.mm`` (no bias,
# 3-D inputs folded to 2-D) or ``aten.addmm`` (bias, and Hugging Face's Conv1D); the attention
# matmuls are ``aten.bmm`` and are recomputed. Collectives (``c10d`` ops, inside the schedule's
# autograd functions) are recomputed too, as full checkpointing does: saving an in-place
# collective's output would not redo its mutation of the buffer the caller reads, and every rank
# of the group recomputes the same block at the same point of backward. Random ops are recomputed
# under the replayed RNG state, so dropout masks (and ``fork_rng``'s seed draw) come out the same.
_SELECTIVE_SAVED_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SELECTIVE_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# checkpoint policy -> the selective-checkpoint policy function (None: recompute everything)
CHECKPOINT_POLICIES: dict[str, Callable | None] = {"full": None, "selective": _selective_policy}


@dataclass
class SyncSpec:
    """One communication attached to a module boundary."""

    mode: str
    op: str | Callable
    axis: int
    group: ProcessGroup | None = field(default=None, compare=False, repr=False)
    join_axis: int | None = None  # all_to_all: the partitioned axis made whole
    reduce_grad: bool = False  # all_gather: reduce-scatter the gradient (a sharded consumer)

    def __deepcopy__(self, memo):
        clone = copy.copy(self)
        memo[id(self)] = clone
        return clone

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if _comm.is_disabled():
            return x
        if callable(self.op):
            if self.mode == "bwd_post":
                return _BackwardCallable.apply(x, self.op, self.group)
            return self.op(x, self.group)
        if self.mode == "bwd_post":
            return _comm.reduce_bwd(x, self.group)
        if self.op == "all_reduce":
            return _comm.reduce_fwd(x, self.group)
        if self.op == "all_gather":
            return (_comm.gather_reduce if self.reduce_grad else _comm.gather)(x, self.axis, self.group)
        if self.op == "all_to_all":
            return _comm.all_to_all(x, self.axis, self.join_axis, self.group)
        if self.op == "reduce_scatter":
            return _comm.reduce_scatter(x, self.axis, self.group)
        return _comm.scatter(x, self.axis, self.group)


class _BackwardCallable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, group):
        ctx.fn, ctx.group = fn, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad, ctx.group), None, None


@dataclass
class ModuleState:
    """Everything the schedule decided about one module."""

    shards: dict[str, ShardSpec] = field(default_factory=dict)
    input_layout: Layout | None = None
    output_layout: Layout | None = None  # as computed by the module, before fwd_post syncs
    pre_syncs: list[SyncSpec] = field(default_factory=list)
    post_syncs: list[SyncSpec] = field(default_factory=list)
    compute: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    defers_bias: bool = False
    checkpointed: bool = False
    checkpoint_policy: str = "full"  # a key of CHECKPOINT_POLICIES
    rng_group: ProcessGroup | None = field(default=None, repr=False)
    forks_rng: bool = False
    decomposed: bool = False
    cut_after: bool = False
    annotations: dict[str, dict[str, Any]] = field(default_factory=dict)
    hooks_installed: bool = False

    def __deepcopy__(self, memo):
        clone = copy.copy(self)
        memo[id(self)] = clone
        clone.shards = {k: copy.deepcopy(v, memo) for k, v in self.shards.items()}
        clone.pre_syncs = [copy.deepcopy(s, memo) for s in self.pre_syncs]
        clone.post_syncs = [copy.deepcopy(s, memo) for s in self.post_syncs]
        clone.annotations = copy.deepcopy(self.annotations, memo)
        return clone

    @property
    def synced_output_layout(self) -> Layout | None:
        layout = self.output_layout
        for s in self.post_syncs:
            layout = _layout_after(s, layout)
        return layout

    @property
    def changes_forward(self) -> bool:
        return self.compute is not None or self.checkpointed or self.forks_rng


def state_of(module: nn.Module, create: bool = False) -> ModuleState | None:
    """The schedule state stored on ``module`` (None if no primitive touched it)."""
    state = module.__dict__.get("_slapo")
    if state is None and create:
        state = ModuleState()
        module.__dict__["_slapo"] = state
    return state


def _layout_after(sync: SyncSpec, layout: Layout | None) -> Layout | None:
    if callable(sync.op) or sync.mode == "bwd_post":
        return layout if sync.mode == "bwd_post" else None
    return {
        "all_reduce": REPLICATED,
        "all_gather": REPLICATED,
        "reduce_scatter": partition(sync.axis),
        "scatter": partition(sync.axis),
        "all_to_all": partition(sync.axis),
    }[sync.op]


def _first_tensor_index(args: tuple, kwargs: dict) -> tuple[str, Any]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return "arg", i
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "kw", "hidden_states"
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return "kw", k
    raise SyncError("fwd_pre/bwd_post sync found no tensor input to apply to")


class _PreHook:
    """Applies a module's fwd_pre and bwd_post syncs to its first tensor input."""

    def __init__(self, state: ModuleState):
        self.state = state

    def __call__(self, module, args, kwargs):
        if not self.state.pre_syncs:
            return None
        where, key = _first_tensor_index(args, kwargs)
        x = args[key] if where == "arg" else kwargs[key]
        for s in self.state.pre_syncs:
            x = s.apply(x)
        if where == "arg":
            args = (*args[:key], x, *args[key + 1 :])
        else:
            kwargs = {**kwargs, key: x}
        return args, kwargs


class _PostHook:
    """Applies a module's fwd_post syncs to its output, then the bias of a row-parallel layer.

    The bias is added after the reduction: added before, it would be summed once per rank.
    """

    def __init__(self, state: ModuleState):
        self.state = state

    def __call__(self, module, args, output):
        st = self.state
        if not st.post_syncs and not st.defers_bias:
            return None
        rest = None
        if isinstance(output, (tuple, list)):
            output, rest = output[0], output[1:]
        for s in st.post_syncs:
            _check_runtime_axis(s, st, output)
            output = s.apply(output)
        if st.defers_bias:
            output = output + module.bias
        return output if rest is None else (output, *rest)


def _check_runtime_axis(sync: SyncSpec, state: ModuleState, out: torch.Tensor) -> None:
    layout = state.output_layout
    if (sync.op == "all_gather" and layout is not None and layout.kind == "partition"
            and layout.axis % out.dim() != sync.axis % out.dim()):
        raise SyncError(f"all_gather along axis {sync.axis} but the output is partitioned along axis {layout.axis}")


class _ScheduledForward:
    """Instance-level ``forward`` of a module whose computation the schedule changed.

    Patching the instance (instead of wrapping the module) keeps module paths and state-dict keys
    identical to the unscheduled model.
    """

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        module = self.module
        st: ModuleState = module._slapo
        if st.compute is not None:
            fn = functools.partial(st.compute, module)
        else:
            fn = type(module).forward.__get__(module)
        if st.forks_rng:
            fn = functools.partial(_forked_rng_call, fn, st.rng_group)
        if st.checkpointed:
            return checkpointed_call(fn, st.checkpoint_policy, *args, **kwargs)
        return fn(*args, **kwargs)


def checkpointed_call(fn: Callable, policy: str, *args, **kwargs):
    """``fn(*args, **kwargs)`` under activation checkpointing with ``policy`` (when gradients are on)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    # Non-reentrant checkpointing supports keyword inputs and replays the RNG state, so dropout
    # masks are identical in the recomputation.
    policy_fn = CHECKPOINT_POLICIES[policy]
    selective = {} if policy_fn is None else {
        "context_fn": functools.partial(create_selective_checkpoint_contexts, policy_fn)}
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                                             **selective, **kwargs)


def _forked_rng_call(fn: Callable, group: ProcessGroup | None, *args, **kwargs):
    # The seed is drawn from the global generator, so all ranks draw the same number and a
    # checkpoint recomputation (which restores the global state) draws it again.
    base = int(torch.randint(0, 2**62, (1,)).item())
    seed = (base + 1_000_003 * (_comm.group_rank(group) + 1)) % 2**63
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return fn(*args, **kwargs)


def _ensure_forward_patched(module: nn.Module) -> None:
    if not isinstance(module.__dict__.get("forward"), _ScheduledForward):
        module.forward = _ScheduledForward(module)


def _ensure_hooks(module: nn.Module, state: ModuleState) -> None:
    if not state.hooks_installed:
        module.register_forward_pre_hook(_PreHook(state), with_kwargs=True)
        module.register_forward_hook(_PostHook(state))
        state.hooks_installed = True


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def copy_hooks(old: nn.Module, new: nn.Module, names: Sequence[str] = _HOOK_DICTS) -> None:
    """Register ``old``'s hooks (those in the dictionaries ``names``) on ``new`` too."""
    for name in names:
        getattr(new, name).update(getattr(old, name))
    if "_backward_hooks" in names and old._backward_hooks:
        # nn.Module runs _backward_hooks as full or legacy hooks by this flag, and none while it is None
        new._is_full_backward_hook = old._is_full_backward_hook


def direct_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``module``'s own parameters and buffers (not its children's): (name, tensor, is a parameter)."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p, True
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b, False


INIT_OWNERS_ATTR = "_slapo_init_owners"


def record_init_owners(model: nn.Module) -> None:
    """Remember which module initialises each tensor, before modules are removed from ``model``.

    A pipeline stage drops the modules of other stages; a tensor tied across stages (GPT-2's
    embedding and LM head) must still be initialised by the module that initialises it in the full
    model, or the stages would start from different weights.
    """
    owners: dict[int, tuple[str, nn.Module, str]] = model.__dict__.setdefault(INIT_OWNERS_ATTR, {})
    for path, m in model.named_modules():
        for name, t, _ in direct_tensors(m):
            owners.setdefault(id(t), (path, m, name))
