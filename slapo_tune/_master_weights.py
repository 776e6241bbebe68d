"""fp32 master weights beside replicated bf16 parameters (the ``bf16`` precision of
:mod:`slapo_tune.precision`, which re-exports this class)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn


class MasterWeights:
    """fp32 master copies of replicated bf16 parameters, with fp32 gradients.

    Made from the fp32 model, before it computes: each parameter is cast to ``dtype`` in place (the
    module keeps the same ``Parameter`` object, so tied parameters stay tied) and its fp32 value
    becomes the master. A hook adds every gradient backward writes into the master's fp32 gradient
    and frees the low-precision one, so gradients accumulate over micro-batches in fp32 and only one
    low-precision gradient exists at a time. The optimizer steps the masters; :meth:`publish`
    copies them back into the model.
    """

    def __init__(self, params: Iterable[nn.Parameter], dtype: torch.dtype = torch.bfloat16):
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._master_of: dict[int, nn.Parameter] = {}
        for p in params:
            if not p.requires_grad or id(p) in self._master_of:
                continue
            master = nn.Parameter(p.detach().float().clone())
            p.data = p.data.to(dtype)
            p.register_post_accumulate_grad_hook(self._accumulate)
            self._pairs.append((p, master))
            self._master_of[id(p)] = master

    def _accumulate(self, param: torch.Tensor) -> None:
        master = self._master_of[id(param)]
        if master.grad is None:
            master.grad = param.grad.float()
        else:
            master.grad.add_(param.grad)
        param.grad = None

    def parameters(self) -> Iterator[nn.Parameter]:
        """The fp32 masters (what the optimizer steps), in the model's parameter order."""
        return (master for _, master in self._pairs)

    def master(self, param: torch.Tensor) -> nn.Parameter:
        """The master copy of a model parameter."""
        return self._master_of[id(param)]

    def zero_grad(self) -> None:
        for _, master in self._pairs:
            master.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the masters into the model's parameters (after an optimizer step or a restore)."""
        for p, master in self._pairs:
            p.copy_(master)
