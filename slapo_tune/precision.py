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
``fp8``
    ``bf16`` with the linear layers' matrix products in FP8, as Transformer Engine and torchao's
    float8 training (tensorwise scaling) run them: the forward product and both backward ones
    (input and weight gradients) in FP8 on H100-class tensor cores; each weight cast to FP8 from
    its bf16 parameter when its layer runs (a transient copy), each linear layer's input saved for
    backward as its FP8 cast (1 byte an element instead of 2), a few fp32 amax/scale scalars per
    linear layer. Norms, the attention core, softmax, the residual stream, the LM head and the
    model states stay as ``bf16`` keeps them. The plan models it (H100-class presets only: a
    preset's ``fp8_flops``); the runtime does not run it (``tune``, ``train`` and ``verify``
    refuse it).

fp16 is not offered: it needs a dynamic loss scaler agreed on by every rank, which the runtime
does not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ScheduleError, UsageError

if TYPE_CHECKING:  # the modes are plain data (plan reads their sizes); torch only where they run
    import torch

    from ._master_weights import MasterWeights  # noqa: F401  (re-exported below)

# bytes per element of the dtypes the modes name (as torch names them)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class Precision:
    """How one precision mode stores and computes (see the module docstring)."""

    name: str
    param_type: str  # the parameters the model computes with (a torch dtype's name)
    autocast_type: str | None = None  # autocast's compute dtype over ``param_type`` parameters
    master: bool = False  # fp32 master weights (and fp32 gradients) beside ``param_type`` parameters
    linear_type: str | None = None  # the linear layers' matrix products' operands, if not the compute dtype (fp8)
    doc: str = ""

    @property
    def fp8(self) -> bool:
        """Whether the linear layers' matrix products run in FP8 (the plan models it; nothing runs it)."""
        return self.linear_type is not None

    @property
    def linear_input_bytes(self) -> int:
        """Bytes per element of what a linear layer saves of its input for backward (fp8: its FP8 cast)."""
        return _DTYPE_BYTES[self.linear_type] if self.linear_type else self.activation_bytes

    @property
    def measured_as(self) -> str:
        """The precision whose activation-probe measurements this one's are derived from (fp8: bf16's,
        less what the FP8 casts of the linear layers' inputs save; the probe cannot run FP8 on fake tensors)."""
        return "bf16" if self.fp8 else self.name

    @property
    def param_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.param_type)

    @property
    def autocast(self) -> torch.dtype | None:
        import torch

        return None if self.autocast_type is None else getattr(torch, self.autocast_type)

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of what forward keeps for backward (matrix-product outputs)."""
        return _DTYPE_BYTES[self.autocast_type or self.param_type]

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the parameters the model computes with."""
        return _DTYPE_BYTES[self.param_type]

    def mixed_precision_policy(self):
        """FSDP2's policy for this precision (None: FSDP2's default, parameters as they are)."""
        if not self.master:
            return None
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)


PRECISIONS: dict[str, Precision] = {
    p.name: p for p in (
        Precision("fp32", "float32", doc="fp32 parameters, activations, gradients and optimizer state"),
        Precision("amp-bf16", "float32", autocast_type="bfloat16",
                  doc="autocast to bf16 over fp32 parameters, gradients and optimizer state"),
        Precision("bf16", "bfloat16", master=True,
                  doc="bf16 parameters and activations; fp32 master weights, optimizer state and gradient "
                      "reduction"),
        Precision("fp8", "bfloat16", master=True, linear_type="float8_e4m3fn",
                  doc="bf16 with the linear layers' matrix products in FP8 (Transformer Engine / torchao float8, "
                      "tensorwise scaling; H100-class GPUs; plan only)"),
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


def runnable(name: str, setup) -> None:
    """Refuse, in one line (a :class:`~slapo_tune.errors.UsageError`), a precision the runtime cannot
    run on ``setup`` (a :class:`~slapo_tune.device.DeviceSetup`): fp8 everywhere for now; on a device
    without FP8 tensor cores (a CPU, GPUs before Hopper and Ada) the line says that first."""
    if not precision(name).fp8:
        return
    if not setup.cuda or (setup.gpus and not any(fp8_gpu(g.name) for g in setup.gpus)):
        raise UsageError(f"--precision fp8: {setup.name} has no FP8 tensor cores (H100/H200-class GPUs have); plan "
                         f"it with slapo-tune plan --precision fp8 --hardware h100-80gb, or run bf16")
    raise UsageError(f"--precision fp8: the runtime does not convert linear layers to torchao float8 yet; plan it "
                     f"with slapo-tune plan --precision fp8, or run bf16 on {setup.name}")


# GPU models with FP8 tensor cores among those the cost model has presets for (the runtime's layer
# cannot ask the cost model's presets; a test holds the two in agreement)
FP8_GPU_MODELS = ("h100", "h200", "b200")


def fp8_gpu(name: str) -> bool:
    """Whether a GPU of this name (``torch.cuda.get_device_properties(i).name``) has FP8 tensor cores:
    the models of the presets with an FP8 rate (H100, H200, B200)."""
    lowered = name.lower()
    return any(model in lowered for model in FP8_GPU_MODELS)


def default_precision(device_type: str) -> str:
    """bf16 parameters on GPUs, fp32 on CPUs."""
    return DEFAULT_GPU if device_type == "cuda" else DEFAULT_CPU


def __getattr__(name: str):
    if name != "MasterWeights":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # torch-free: `import slapo_tune` imports this module (through plan); _master_weights imports torch
    from ._master_weights import MasterWeights

    return MasterWeights
