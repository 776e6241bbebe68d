"""Collectives as autograd functions, each with its conjugate backward.

``torch.distributed.nn.functional.all_reduce`` cannot be used for tensor parallelism: its backward
all-reduces too, so weight gradients come out multiplied by the group size. Megatron's pairs are
spelled out here instead:

=================  ==============================  ==============================
function           forward                         backward
=================  ==============================  ==============================
``reduce_fwd``     all-reduce (sum)                identity
``reduce_bwd``     identity                        all-reduce (sum)
``gather``         all-gather along ``axis``       keep this rank's chunk
``reduce_scatter`` reduce-scatter along ``axis``   all-gather along ``axis``
``scatter``        keep this rank's chunk          all-gather along ``axis``
``gather_reduce``  all-gather along ``axis``       reduce-scatter along ``axis``
``all_to_all``     split ``axis``, join ``joined``  split ``joined``, join ``axis``
=================  ==============================  ==============================

``gather`` suits a replicated consumer (every rank's gradient is already whole), ``gather_reduce``
a sharded one (column-parallel layers after it: each rank's gradient is a partial sum).
``all_to_all`` switches a tensor between two partitions (DeepSpeed-Ulysses: sequence-sharded
``[batch, seq/p, heads, dim]`` <-> head-sharded ``[batch, seq, heads/p, dim]``); its backward is
the reverse switch.

A group of size one makes every function the identity, so a schedule written for ``tp=2`` runs
unchanged at ``tp=1`` without any communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_DISABLED = [False]


@contextlib.contextmanager
def communication_disabled() -> Iterator[None]:
    """Make every schedule sync the identity (for shape-only dry runs under FakeTensorMode)."""
    previous = _DISABLED[0]
    _DISABLED[0] = True
    try:
        yield
    finally:
        _DISABLED[0] = previous


def is_disabled() -> bool:
    return _DISABLED[0]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly distributed) tensor this rank holds, sharing its storage: what an
    in-place collective over this rank's part works on (a gradient under FSDP is a DTensor shard)."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``; 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    # A fresh buffer: the input may have been saved by autograd for another op's backward.
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def start_all_gather(x: torch.Tensor, axis: int, group: ProcessGroup | None,
                     async_op: bool = True) -> Callable[[], torch.Tensor]:
    """Launch the all-gather of ``x`` along ``axis``; the returned function waits for it and gives
    the gathered tensor (work placed between the two overlaps the collective; ``async_op=False``:
    done before this returns)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    work = dist.all_gather(parts, x, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        return torch.cat(parts, dim=axis)

    return finish


def _all_gather(x: torch.Tensor, axis: int, group: ProcessGroup | None) -> torch.Tensor:
    return start_all_gather(x, axis, group, async_op=False)()


def _own_chunk(x: torch.Tensor, axis: int, group: ProcessGroup | None) -> torch.Tensor:
    size = group_size(group)
    if x.shape[axis] % size:
        raise ValueError(f"dimension {axis} of size {x.shape[axis]} is not divisible by the group size {size}")
    return x.chunk(size, dim=axis)[group_rank(group)].contiguous()


def start_reduce_scatter(x: torch.Tensor, axis: int, group: ProcessGroup | None,
                         async_op: bool = True) -> Callable[[], torch.Tensor]:
    """Launch the reduce-scatter of ``x`` along ``axis``; the returned function waits for it and
    gives this rank's summed chunk (``async_op=False``: done before this returns)."""
    size = group_size(group)
    if x.shape[axis] % size:
        raise ValueError(f"dimension {axis} of size {x.shape[axis]} is not divisible by the group size {size}")
    inputs = [c.contiguous() for c in x.chunk(size, dim=axis)]
    out = torch.empty_like(inputs[0])
    work = dist.reduce_scatter(out, inputs, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        return out

    return finish


def _reduce_scatter(x: torch.Tensor, axis: int, group: ProcessGroup | None) -> torch.Tensor:
    return start_reduce_scatter(x, axis, group, async_op=False)()


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def _axis_collective(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function computing ``forward(x, axis, group)``, whose backward is
    ``backward(grad, axis, group)`` (the table above)."""

    def fwd(ctx, x, axis, group):
        ctx.axis, ctx.group = axis, group
        return forward(x, axis, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.axis, ctx.group), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_Gather = _axis_collective("_Gather", _all_gather, _own_chunk)
_ReduceScatter = _axis_collective("_ReduceScatter", _reduce_scatter, _all_gather)
_Scatter = _axis_collective("_Scatter", _own_chunk, _all_gather)
_GatherReduce = _axis_collective("_GatherReduce", _all_gather, _reduce_scatter)


def _all_to_all(x: torch.Tensor, split_axis: int, join_axis: int, group: ProcessGroup | None) -> torch.Tensor:
    size = group_size(group)
    if x.shape[split_axis] % size:
        raise ValueError(f"dimension {split_axis} of size {x.shape[split_axis]} is not divisible by the group size {size}")
    inputs = [c.contiguous() for c in x.chunk(size, dim=split_axis)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=join_axis)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_axis, join_axis, group):
        ctx.split_axis, ctx.join_axis, ctx.group = split_axis, join_axis, group
        return _all_to_all(x, split_axis, join_axis, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.join_axis, ctx.split_axis, ctx.group), None, None, None


def reduce_fwd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum partial results across ``group`` (forward); pass gradients through (backward)."""
    return x if group_size(group) == 1 else _ReduceForward.apply(x, group)


def reduce_bwd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity forward; sum the partial input gradients across ``group`` in backward."""
    return x if group_size(group) == 1 else _ReduceBackward.apply(x, group)


def gather(x: torch.Tensor, axis: int, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate the ranks' partitions along ``axis``; backward keeps this rank's chunk."""
    return x if group_size(group) == 1 else _Gather.apply(x, axis % x.dim(), group)


def reduce_scatter(x: torch.Tensor, axis: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum across ranks and keep this rank's chunk along ``axis``; backward all-gathers."""
    return x if group_size(group) == 1 else _ReduceScatter.apply(x, axis % x.dim(), group)


def scatter(x: torch.Tensor, axis: int, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor along ``axis``; backward all-gathers."""
    return x if group_size(group) == 1 else _Scatter.apply(x, axis % x.dim(), group)


def gather_reduce(x: torch.Tensor, axis: int, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate the ranks' partitions along ``axis``; backward sums the gradients over the ranks
    and keeps this rank's chunk (for a sharded consumer, whose gradients are partial)."""
    return x if group_size(group) == 1 else _GatherReduce.apply(x, axis % x.dim(), group)


def all_to_all(x: torch.Tensor, split_axis: int, join_axis: int, group: ProcessGroup | None) -> torch.Tensor:
    """Re-partition: ``x`` is this rank's slice along ``join_axis``; the result is this rank's slice
    along ``split_axis`` (whole along ``join_axis``). Backward is the reverse re-partition."""
    if group_size(group) == 1:
        return x
    split_axis, join_axis = split_axis % x.dim(), join_axis % x.dim()
    if split_axis == join_axis:
        raise ValueError(f"all_to_all: the split and join axes must differ (both are {split_axis})")
    return _AllToAll.apply(x, split_axis, join_axis, group)


def all_gather_tensor(x: torch.Tensor, axis: int, group: ProcessGroup | None) -> torch.Tensor:
    """Non-differentiable all-gather (used to reassemble shards for comparison and saving)."""
    return x if group_size(group) == 1 else _all_gather(x.detach(), axis % x.dim(), group)
