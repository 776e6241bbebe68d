"""Slapo's ``slapo.op``: slapo-tune's ready modules (:mod:`slapo_tune.op`) with Slapo's call forms."""

from __future__ import annotations

from ..op import *  # noqa: F403  (Slapo's op namespace: Attention, Print, LinearWithSyncFunc, ...)
from ..op import FusedMLP as _FusedMLP
from ..op import __all__ as _OP_NAMES


class FusedMLP(_FusedMLP):
    """Slapo's ``FusedMLP(hidden_size, intermediate_size, orig_act, resid_pdrop, use_torchscript=False)``:
    ``fc_in`` -> activation -> ``fc_out`` -> dropout, both linear layers with a bias.
    ``use_torchscript`` chose Slapo's kernel for the fused bias+activation and bias+dropout; the
    module here computes the same unfused (fuse it with ``sch.fuse``), so the flag changes nothing."""

    def __init__(self, hidden_size: int, intermediate_size: int, orig_act: str, resid_pdrop: float,
                 use_torchscript: bool = False):
        super().__init__(hidden_size, intermediate_size, orig_act, resid_pdrop)
        self.use_torchscript = use_torchscript


__all__ = [*_OP_NAMES]
