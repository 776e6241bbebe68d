"""Slapo's ``slapo.sharding``: the sync ops a schedule's hooks call (:mod:`.sync_ops`)."""

from . import sync_ops
from .sync_ops import (
    all_gather_forward_output,
    reduce_backward_grad,
    reduce_forward_output,
    reduce_scatter_forward_output,
    scatter_forward_output,
)

__all__ = ["all_gather_forward_output", "reduce_backward_grad", "reduce_forward_output",
           "reduce_scatter_forward_output", "scatter_forward_output", "sync_ops"]
