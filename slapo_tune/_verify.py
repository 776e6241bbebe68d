"""``verify``: does the scheduled model compute what the unscheduled one computes?

Both models run one forward and backward on the same inputs. Compared, in this order: the output
of every module (in execution order, so the report names the *first* module that diverges; a
partitioned output is gathered first), the loss, the model output, and the gradient of every
parameter (sharded gradients are reassembled from all ranks). Dropout is off during the check
(``deterministic=True``): a sharded computation draws its masks in a different order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import VerificationError
from .parallel._comm import all_gather_tensor
from .runtime import TrainStep
from .schedule._build import build, materialize
from .schedule._graph import FUSED_FROM
from .schedule._pipeline import StageModule, VirtualStages
from .schedule._schedule import Schedule, state_of

DEFAULT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-7, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# A training step against the fp32 reference, by the dtype it computes in. bf16 rounding of the
# reductions over a batch's tokens reaches several percent of a gradient's largest element (LayerNorm
# and bias gradients, which sum over every token); schedule faults (a missing reduction, a wrong
# scale, a wrong shard) are errors of 50 % and more.
TRAINING_RTOL = {torch.float32: 1e-4, torch.bfloat16: 0.1}


@dataclass
class Divergence:
    where: str
    error: float
    hint: str = ""

    def __str__(self) -> str:
        return f"{self.where}: relative error {self.error:.3g}" + (f" ({self.hint})" if self.hint else "")


@dataclass
class VerifyReport:
    """What ``verify`` measured; ``ok`` is False when anything exceeds ``tolerance``."""

    loss: float
    reference_loss: float
    tolerance: float
    loss_error: float = 0.0
    output_error: float | None = None
    max_grad_error: float = 0.0
    max_grad_param: str = ""
    params_compared: int = 0
    # the reference parameters whose gradients were compared (a tied tensor under each of its
    # names, a fused parameter's sources): what a caller checks for coverage
    compared: list[str] = field(default_factory=list)
    modules_compared: int = 0
    modules_skipped: int = 0
    first_divergent_module: Divergence | None = None
    first_divergent_param: Divergence | None = None
    missing_grads: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        errors = [self.loss_error, self.max_grad_error, self.output_error or 0.0]
        return (all(e <= self.tolerance for e in errors) and self.first_divergent_module is None
                and not self.missing_grads)

    def __str__(self) -> str:
        lines = [
            f"verify: {'OK' if self.ok else 'FAILED'} (tolerance {self.tolerance:g}, relative to each tensor's max)",
            f"  loss {self.loss:.6f} vs reference {self.reference_loss:.6f} (relative error {self.loss_error:.3g})",
        ]
        if self.output_error is not None:
            lines.append(f"  model output: relative error {self.output_error:.3g}")
        lines.append(
            f"  gradients: {self.params_compared} parameters, max relative error {self.max_grad_error:.3g}"
            + (f" at {self.max_grad_param}" if self.max_grad_param else "")
        )
        lines.append(f"  module outputs compared: {self.modules_compared} (partitioned, not comparable: {self.modules_skipped})")
        if self.first_divergent_module:
            lines.append(f"  first divergent module: {self.first_divergent_module}")
        if self.first_divergent_param:
            lines.append(f"  first divergent parameter: {self.first_divergent_param}")
        if self.missing_grads:
            lines.append(f"  parameters without a gradient (reference has one): {', '.join(self.missing_grads[:5])}")
        return "\n".join(lines)


def relative_error(value: torch.Tensor, reference: torch.Tensor, floor: float = 1e-5) -> float:
    """max|value - reference| / max(max|reference|, floor), in float64.

    The floor keeps tensors that are zero in theory (a key bias's gradient is ~1e-10 of rounding
    noise) from reporting huge relative errors.
    """
    value, reference = value.detach().double(), reference.detach().double()
    if value.shape != reference.shape:
        return float("inf")
    scale = max(reference.abs().max().item() if reference.numel() else 0.0, floor)
    diff = (value - reference).abs().max().item() if reference.numel() else 0.0
    return diff / scale


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _full_output(module: nn.Module, out: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The output as the unscheduled module would produce it, if the layout allows (else a hint)."""
    st = state_of(module)
    if st is None:
        return out, ""
    layout = st.synced_output_layout
    if layout is None or layout.kind == "replicated":
        return out, ""
    if layout.kind == "partial":
        return out, "output is partial (not summed over the tensor-parallel group): missing sync('fwd_post', 'all_reduce')?"
    spec = next(iter(st.shards.values()), None)
    if spec is None:
        return out, ""
    gathered = all_gather_tensor(out, layout.axis, spec.group)
    weight = st.shards.get("weight")
    if weight is not None:
        gathered = weight.interleave(gathered, layout.axis % out.dim())
    return gathered, ""


@contextlib.contextmanager
def _capture_outputs(model: nn.Module, store: dict[str, torch.Tensor], order: list[str],
                     transform: Callable | None = None) -> Iterator[dict[str, bool]]:
    flag = {"on": True}
    handles = []

    def make(path: str):
        def hook(module, args, output):
            if not flag["on"] or path in store:
                return None
            t = _first_tensor(output)
            if t is None or not t.is_floating_point():
                return None
            store[path] = transform(module, path, t) if transform else (t.detach().clone(), "")
            order.append(path)
            return None

        return hook

    for path, module in model.named_modules():
        if path and not isinstance(module, torch.jit.ScriptModule):  # TorchScript takes no Python hooks
            handles.append(module.register_forward_hook(make(path)))
    try:
        yield flag
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _eval_mode(*models: nn.Module) -> Iterator[None]:
    modes = [[(m, m.training) for m in model.modules()] for model in models]
    for saved in modes:
        for m, _ in saved:
            m.training = False  # not eval(): export-traced modules refuse train()/eval() calls
    try:
        yield
    finally:
        for saved in modes:
            for m, training in saved:
                m.training = training


def _run(model: nn.Module, inputs: Any, loss_fn: Callable | None, seed: int) -> tuple[torch.Tensor, Any]:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    output = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
    if loss_fn is not None:
        loss = loss_fn(output)
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise VerificationError("the model returned no loss: pass labels in the inputs or a loss_fn")
    loss.backward()
    return loss.detach(), output


def _full_gradient(module_root: nn.Module, name: str, grad: torch.Tensor) -> torch.Tensor:
    """The gradient as the unscheduled parameter would have it: FSDP shards gathered over dp,
    tensor-parallel shards over tp (both collectives; every rank of the group calls in order)."""
    if hasattr(grad, "full_tensor"):
        grad = grad.full_tensor()
    owner, short = _param_owner(module_root, name)
    st = state_of(owner)
    spec = st.shards.get(short) if st is not None else None
    return spec.assemble(grad) if spec is not None else grad


def _reference_gradient(model: nn.Module, name: str, ref_params: dict[str, torch.Tensor]
                        ) -> tuple[torch.Tensor | None, list[str]]:
    """The reference's gradient for ``name`` and the reference names it stands for; for a
    horizontally fused parameter, the gradients of the parameters it was fused from, concatenated."""
    ref = ref_params.get(name)
    if ref is not None:
        return ref.grad, [name]
    owner, short = _param_owner(model, name)
    st = state_of(owner)
    sources = st.annotations.get(short, {}).get(FUSED_FROM) if st is not None else None
    if not sources or any(ref_params.get(s) is None or ref_params[s].grad is None for s in sources):
        return None, []
    return torch.cat([ref_params[s].grad for s in sources], dim=0), list(sources)


def _compare_gradients(model: nn.Module, reference: nn.Module, report: VerifyReport,
                       gradient: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: p.grad) -> None:
    # every name of a tied tensor: a pipeline's last stage holds GPT-2's head as its own copy of
    # the embedding, under the head's name, and its gradient must be the tied tensor's whole one
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        ref_grad, covers = _reference_gradient(model, name, ref_params)
        if ref_grad is None:
            continue
        grad = gradient(param)
        if grad is None:
            report.missing_grads.append(name)
            continue
        err = relative_error(_full_gradient(model, name, grad), ref_grad)
        report.params_compared += 1
        report.compared += covers
        if err > report.max_grad_error:
            report.max_grad_error, report.max_grad_param = err, name
        if err > report.tolerance and report.first_divergent_param is None:
            report.first_divergent_param = Divergence(name, err)


def _check_same_inputs(inputs: Any, device: torch.device) -> None:
    """Every rank must feed the same batch: different batches look exactly like a wrong schedule."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for v in values:
        if isinstance(v, torch.Tensor) and v.numel():
            t = v.detach().to(device=device, dtype=torch.float64).flatten()
            weights = torch.arange(1, t.numel() + 1, device=device, dtype=torch.float64)
            total += torch.stack([t.sum(), (t * weights).sum()])
    lo, hi = total.clone(), total.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if not torch.equal(lo, hi):
        raise VerificationError(
            "verify: the ranks were given different inputs; generate them from a fixed seed "
            "(e.g. torch.Generator().manual_seed(0)) so every rank feeds the same batch"
        )


def _param_owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_path, _, param = name.rpartition(".")
    return (model.get_submodule(module_path) if module_path else model), param


def verify(
    model: nn.Module | Schedule,
    reference: nn.Module,
    inputs: Mapping[str, Any] | tuple,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    tolerance: float | None = None,
    seed: int = 0,
    deterministic: bool = True,
    raise_on_failure: bool = True,
    n_microbatches: int = 1,
    pipeline_schedule: str = "1f1b",
    step=None,
    init_weights=None,
) -> VerifyReport:
    """Compare a scheduled model with its unscheduled ``reference`` on ``inputs``.

    ``model`` may be a built module or a :class:`Schedule` (built here with ``seed``); a
    ``reference`` on the meta device is materialised with the same ``seed``, so both hold the same
    weights (``init_weights``: a custom initialiser for both, see :func:`slapo_tune.build`). Every
    rank must call ``verify`` (gathers are collectives).

    A model built with a topology (pipeline stages, data parallelism) runs one
    :class:`~slapo_tune.runtime.TrainStep` on the global batch ``inputs`` (``step``, or one made with
    ``n_microbatches`` and ``pipeline_schedule`` in fp32); its loss and the gradient the optimizer
    would step each parameter of this rank's stage with are compared with the reference's
    full-batch step in the same precision (bf16 parameters, or autocast), module outputs for pure
    tensor parallelism.
    Returns a
    :class:`VerifyReport`; raises :class:`VerificationError` with that report (on every rank) if
    anything diverges beyond ``tolerance`` (default by dtype: 1e-4 for fp32, 2e-2 for bf16).
    """
    if isinstance(model, Schedule):
        model = build(model, seed=seed, init_weights=init_weights)

    if isinstance(model, StageModule | VirtualStages):
        step = step or TrainStep(model, n_microbatches=n_microbatches, schedule=pipeline_schedule)
        return _verify_stage(model, reference, inputs, step, tolerance=tolerance, seed=seed,
                             deterministic=deterministic, raise_on_failure=raise_on_failure)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    if any(t.device.type == "meta" for t in list(reference.parameters()) + list(reference.buffers())):
        materialize(reference, seed=seed, device=device, init_weights=init_weights)
    dtype = next(model.parameters()).dtype
    tol = tolerance if tolerance is not None else DEFAULT_RTOL.get(dtype, 1e-4)
    _check_same_inputs(inputs, device)

    ref_out: dict[str, Any] = {}
    ref_order: list[str] = []
    out: dict[str, Any] = {}
    order: list[str] = []
    mode = _eval_mode(model, reference) if deterministic else contextlib.nullcontext()
    with mode:
        with _capture_outputs(reference, ref_out, ref_order) as flag:
            ref_loss, ref_output = _run(reference, inputs, loss_fn, seed)
            flag["on"] = False
        with _capture_outputs(model, out, order, lambda m, p, t: _full_output(m, t)) as flag:
            loss, output = _run(model, inputs, loss_fn, seed)
            flag["on"] = False

    report = VerifyReport(loss=loss.item(), reference_loss=ref_loss.item(), tolerance=tol)
    report.loss_error = relative_error(loss, ref_loss)
    for path in order:
        if path not in ref_out:
            continue
        value, hint = out[path]
        reference_value, _ = ref_out[path]
        if value.shape != reference_value.shape and not hint:
            # A module inside a parallel region (e.g. an activation between column- and row-parallel
            # layers) legitimately holds a slice with no recorded layout; its consumers are compared.
            report.modules_skipped += 1
            continue
        report.modules_compared += 1
        err = relative_error(value, reference_value)
        if err > tol and report.first_divergent_module is None:
            report.first_divergent_module = Divergence(path, err, hint)
    a, b = _first_tensor(output), _first_tensor(ref_output)
    if a is not None and b is not None and a is not loss:
        report.output_error = relative_error(a, b)

    _compare_gradients(model, reference, report)

    return _conclude(report, device, raise_on_failure)


def _conclude(report: VerifyReport, device: torch.device, raise_on_failure: bool) -> VerifyReport:
    """All ranks agree: if any diverged, every rank raises (with its own report)."""
    ok = report.ok
    if dist.is_available() and dist.is_initialized():
        flag_t = torch.tensor([1.0 if ok else 0.0], device=device)
        dist.all_reduce(flag_t, op=dist.ReduceOp.MIN)
        ok = bool(flag_t.item() == 1.0)
    if not ok and raise_on_failure:
        raise VerificationError(str(report) if not report.ok else f"{report}\n  (another rank diverged)")
    return report


def _verify_stage(model, reference: nn.Module, inputs: Mapping[str, Any], step, *, tolerance: float | None,
                  seed: int, deterministic: bool, raise_on_failure: bool) -> VerifyReport:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if any(t.device.type == "meta" for t in list(reference.parameters()) + list(reference.buffers())):
        materialize(reference, seed=seed, device=device)
    # The reference is the fp32 truth whatever the precision: an unscheduled bf16 step is no better
    # a reference than a scheduled one (one pass over a whole batch rounds more: measured on GPT-2 at
    # 1,024 tokens, its LayerNorm gradients were 7.5 % off the fp32 ones, the scheduled step's 1.9 %)
    precision = step.precision
    tol = tolerance if tolerance is not None else TRAINING_RTOL[precision.autocast or precision.param_dtype]
    _check_same_inputs(inputs, device)
    mode = _eval_mode(model, reference) if deterministic else contextlib.nullcontext()
    with mode:
        ref_loss, _ = _run(reference, {k: v.to(device) for k, v in inputs.items()}, None, seed)
        torch.manual_seed(seed)
        loss = step(inputs)
    report = VerifyReport(loss=loss, reference_loss=ref_loss.item(), tolerance=tol)
    report.loss_error = relative_error(torch.tensor(loss), ref_loss.cpu())
    for chunk in model.chunks:  # an interleaved pipeline rank holds several stages
        _compare_gradients(chunk.model, reference, report, step.gradient)
    return _conclude(report, device, raise_on_failure)


def reference_copy(model: nn.Module) -> nn.Module:
    """An unscheduled copy of ``model`` to verify against (call before applying primitives)."""
    import copy

    ref = copy.deepcopy(model)
    if state_of(ref) is not None or any(state_of(m) is not None for m in ref.modules()):
        raise VerificationError("reference_copy(): the model is already scheduled; copy it before applying primitives")
    return ref


__all__ = ["verify", "VerifyReport", "reference_copy"]
