"""Slapo's ``slapo.sharding.sync_ops``: collectives with their conjugate backward, by Slapo's
names and argument order, over :mod:`slapo_tune.parallel._comm`.

=================================  ================================  ==================================
function                           forward                           backward
=================================  ================================  ==================================
``all_gather_forward_output``      all-gather along ``dim``          reduce-scatter (``tensor_parallel_
                                                                     output_grad``) or keep this
                                                                     rank's chunk
``reduce_scatter_forward_output``  reduce-scatter along ``dim``      all-gather along ``dim``
``scatter_forward_output``         keep this rank's chunk            all-gather along ``dim``
``reduce_forward_output``          all-reduce (sum)                  identity
``reduce_backward_grad``           identity                          all-reduce (sum)
=================================  ================================  ==================================

``group=None`` is the whole world. Unlike Slapo's, ``reduce_forward_output`` returns a new tensor
instead of reducing its input in place (autograd may have saved the input for another backward).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ...parallel import _comm


def all_gather_forward_output(inp: torch.Tensor, dim: int, group: ProcessGroup | None,
                              tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Concatenate the ranks' partitions along ``dim``. Backward: with
    ``tensor_parallel_output_grad`` (a sharded consumer, whose gradients are partial sums) sum the
    gradients over the ranks and keep this rank's chunk; without it (a replicated consumer) keep
    this rank's chunk of the gradient."""
    gather = _comm.gather_reduce if tensor_parallel_output_grad else _comm.gather
    return gather(inp, dim, group)


def reduce_scatter_forward_output(inp: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over the ranks and keep this rank's chunk along ``dim``; backward all-gathers."""
    return _comm.reduce_scatter(inp, dim, group)


def scatter_forward_output(inp: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's chunk of a replicated tensor along ``dim``; backward all-gathers."""
    return _comm.scatter(inp, dim, group)


def reduce_forward_output(inp: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum partial results over the ranks; gradients pass through."""
    return _comm.reduce_fwd(inp, group)


def reduce_backward_grad(inp: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity; in backward the gradient is summed over the ranks."""
    return _comm.reduce_bwd(inp, group)


__all__ = ["all_gather_forward_output", "reduce_backward_grad", "reduce_forward_output",
           "reduce_scatter_forward_output", "scatter_forward_output"]
