"""Training precision: which dtype parameters, activations, gradients and optimizer state are in.

A precision is a workload setting (``--precision``), the same for every schedule point:

``fp32``
    everything in fp32 (16 bytes of model state per parameter: weights 4, gradients 4, AdamW 8).
``amp-bf16``
    ``torch.autocast`` to bf16 over fp32 parameters, gradients and optimizer state: matrix
    products run in bf16, and autocast keeps bf16 copies of the weights beside the fp32 ones.
``bf16``
    bf16 parameters and activations, fp32 master weights, fp32 optimizer state and fp32 gradient
    reduction (what large-model training runs on GPUs, and the default there). Sharded data
    parallelism gets it from FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)``: the shards FSDP2 keeps are the fp32 master weights, and it gathers
    bf16 copies to compute. Replicated parameters keep a bf16 copy in the model and an fp32 master
    copy beside it (:class:`MasterWeights`); each bf16 gradient is added into the master's fp32
    gradient as soon as backward produces it, so accumulation and the data-parallel all-reduce are
    fp32. Model states per parameter: 2 (bf16 weights) + 4 (master) + 4 (gradient) + 8 (AdamW),
    over the sharding degree as far as ZeRO shards them (ZeRO-3: 16 / dp, the bf16 copy gathered
    one block at a time).

fp16 is not offered: it needs a dynamic loss scaler agreed on by every rank, which the runtime
does not run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .errors import ScheduleError


@dataclass(frozen=True)
class Precision:
    """How one precision mode stores and computes (see the module docstring)."""

    name: str
    param_dtype: torch.dtype  # the parameters the model computes with
    autocast: torch.dtype | None = None  # autocast's compute dtype over ``param_dtype`` parameters
    master: bool = False  # fp32 master weights (and fp32 gradients) beside ``param_dtype`` parameters
    doc: str = ""

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of what forward keeps for backward (matrix-product outputs)."""
        return torch.finfo(self.autocast or self.param_dtype).bits // 8

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the parameters the model computes with."""
        return torch.finfo(self.param_dtype).bits // 8

    def mixed_precision_policy(self):
        """FSDP2's policy for this precision (None: FSDP2's default, parameters as they are)."""
        if not self.master:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)


PRECISIONS: dict[str, Precision] = {
    p.name: p for p in (
        Precision("fp32", torch.float32, doc="fp32 parameters, activations, gradients and optimizer state"),
        Precision("amp-bf16", torch.float32, autocast=torch.bfloat16,
                  doc="autocast to bf16 over fp32 parameters, gradients and optimizer state"),
        Precision("bf16", torch.bfloat16, master=True,
                  doc="bf16 parameters and activations; fp32 master weights, optimizer state and gradient "
                      "reduction"),
    )
}
DEFAULT_CPU, DEFAULT_GPU = "fp32", "bf16"
# what version-1 schedule files called a precision (their "dtype": autocast over fp32 parameters)
LEGACY_DTYPES = {"fp32": "fp32", "bf16": "amp-bf16"}


def precision(name: str) -> Precision:
    """The precision called ``name``; a :class:`ScheduleError` naming the choices otherwise."""
    try:
        return PRECISIONS[name]
    except (KeyError, TypeError):
        hint = " (fp16 needs a loss scaler the runtime does not run; use bf16)" if name == "fp16" else ""
        raise ScheduleError(f"unknown precision {name!r}{hint}; choose from {', '.join(PRECISIONS)}") from None


def default_precision(device_type: str) -> str:
    """bf16 parameters on GPUs, fp32 on CPUs."""
    return DEFAULT_GPU if device_type == "cuda" else DEFAULT_CPU


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
