"""fuse=on's fused RMSNorm and SwiGLU (slapo_tune.op): the values and gradients of Hugging Face's
Llama modules, less kept for backward, as Transformer Engine's and Megatron's fused kernels keep.

Ground truth: Hugging Face's own LlamaRMSNorm and LlamaMLP under plain autograd; the untouched model
(verify, on 2 gloo ranks); what a block keeps measured by the activation probe (saved-tensor hooks
on fake tensors), with the llama template's fused norms and SwiGLU MLPs turned off for comparison.
"""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

import slapo_tune as st
from search_spaces.llama import LlamaTemplate
from slapo_tune.cost_model._probe import ProbeRun, probe_block
from slapo_tune.launch import launch
from slapo_tune.models import build_model
from slapo_tune.op import FusedRMSNorm, SwiGLUMLP
from slapo_tune.problem import ProblemSpec
from slapo_tune.space import format_point

from _helpers import uncompared
from _template_workers import verify_points

DTYPES = [torch.float32, torch.bfloat16]


def _grads(module, x, grad):
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    params = module.named_parameters() if isinstance(module, torch.nn.Module) else ()
    return out, x.grad, {n: p.grad for n, p in params}


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm_computes_what_llama_rms_norm_does(dtype):
    gen = torch.Generator().manual_seed(0)
    ref = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(96, generator=gen))
    fused = FusedRMSNorm.from_module(ref)
    assert fused.weight is ref.weight and fused.variance_epsilon == 1e-5
    x = (3 * torch.randn(2, 9, 96, generator=gen) + 1).to(dtype)
    grad = torch.randn(2, 9, 96, generator=gen).to(dtype)
    out_ref, gx_ref, gw_ref = _grads(ref, x, grad)
    ref.weight.grad = None
    out, gx, gw = _grads(fused, x, grad)
    assert out.dtype == out_ref.dtype == dtype and torch.equal(out, out_ref)
    # the backward's formula is autograd's up to fp32 rounding, in bf16 at most one ulp of the result
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3 * gx_ref.abs().max().item()}
    torch.testing.assert_close(gx, gx_ref, **tol)
    torch.testing.assert_close(gw["weight"], gw_ref["weight"], **{**tol, "atol": tol["atol"] * 10})
    with pytest.raises(st.ScheduleError, match="not a Llama-style RMSNorm"):
        FusedRMSNorm.from_module(torch.nn.LayerNorm(96))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_mlp_computes_what_llama_mlp_does(dtype):
    config = build_model("llama-tiny", device="meta").config
    torch.manual_seed(0)
    ref = LlamaMLP(config).to(dtype)
    fused = SwiGLUMLP(st.fuse_linears([ref.gate_proj, ref.up_proj]), ref.down_proj)
    x = torch.randn(2, 9, config.hidden_size).to(dtype)
    grad = torch.randn(2, 9, config.hidden_size).to(dtype)
    out, gx, gw = _grads(fused, x, grad)
    # over the same fused projection, plain autograd's SwiGLU: the same operations, identical values
    for p in fused.parameters():
        p.grad = None

    def plain(y):
        gate, up = fused.gate_up_proj(y).split(fused.gate_up_proj.split_sizes, dim=-1)
        return fused.down_proj(torch.nn.functional.silu(gate) * up)

    out_plain, gx_plain, _ = _grads(plain, x, grad)
    assert torch.equal(out, out_plain) and torch.equal(gx, gx_plain)
    gw_plain = {n: p.grad for n, p in fused.named_parameters()}
    assert all(torch.equal(gw[n], gw_plain[n]) for n in gw)
    # and Hugging Face's MLP, whose two projections' products round apart from the fused one's
    for p in fused.parameters():
        p.grad = None
    out_ref, gx_ref, gw_ref = _grads(ref, x, grad)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, out_ref, **tol)
    torch.testing.assert_close(gx, gx_ref, **tol)
    torch.testing.assert_close(gw["gate_up_proj.weight"],
                               torch.cat([gw_ref["gate_proj.weight"], gw_ref["up_proj.weight"]]), **tol)
    with pytest.raises(st.ScheduleError, match="fused from two"):
        SwiGLUMLP(ref.gate_proj, ref.down_proj)


def test_fuse_on_schedules_fused_norms_and_swiglu_that_verify_on_two_ranks():
    spec = ProblemSpec("llama-tiny", 2, global_batch=8, seq_len=16)
    problem = spec.resolve()
    model = problem.model.build("meta")
    problem.template.schedule(model, problem.plan({"tp": 1, "fuse": "on"}).knobs())
    layers = model.model.layers
    assert all(isinstance(m, FusedRMSNorm) for layer in layers for m in (layer.input_layernorm,
                                                                          layer.post_attention_layernorm))
    assert isinstance(model.model.norm, FusedRMSNorm) and all(isinstance(layer.mlp, SwiGLUMLP) for layer in layers)
    cases = []
    for precision, knobs in (("fp32", {"tp": 2, "sp": "on", "fuse": "on", "micro_batch": 2}),
                             ("fp32", {"pp": 2, "fuse": "on", "ckpt_ratio": 0.5, "ckpt_policy": "selective",
                                       "micro_batch": 2}),
                             ("fp32", {"tp": 2, "fuse": "on", "ckpt_ratio": 1.0, "micro_batch": 2}),
                             ("bf16", {"tp": 2, "sp": "on", "fuse": "on", "micro_batch": 2}),
                             ("amp-bf16", {"pp": 2, "fuse": "on", "zero": 0, "micro_batch": 2})):
        case_spec = ProblemSpec("llama-tiny", 2, global_batch=8, seq_len=16, precision=precision)
        point = case_spec.resolve().plan(knobs).knobs()
        cases.append(((precision, format_point(point)), case_spec, point))
    results = launch(verify_points, 2, args=(cases,), timeout=600)
    for key, case_spec, _ in cases:
        for r in results:
            assert r[key]["ok"], r[key]["report"]
            if case_spec.precision == "fp32":
                assert r[key]["max_grad_error"] < 1e-4 and r[key]["loss_error"] < 1e-4
        # every norm weight and fused projection's gradient was compared on some rank
        assert not uncompared(case_spec.model_spec.build("meta"), [r[key]["compared"] for r in results]), key


class _UnfusedKernels(LlamaTemplate):
    """The llama template with fuse=on's projection fusion only, as before the fused kernels."""

    fused_norms = ()
    swiglu_mlps = {}


@pytest.mark.parametrize("precision,bytes_", [("fp32", 4), ("bf16", 2)])
def test_a_block_keeps_what_the_fused_kernels_say_less(precision, bytes_):
    """Per token and block, the two fused norms keep 4h bytes less each (no fp32 copy of the input,
    no normalised tensor; the input itself, which a bf16 block did not keep, now kept), and SwiGLU
    one element of the MLP width less (silu(gate)); on a tensor-parallel rank the MLP's part is
    divided by tp."""
    problem = ProblemSpec("llama-tiny", 2, global_batch=8, seq_len=16).resolve()
    config = problem.config
    h, inter = config.hidden_size, config.intermediate_size
    seq = 64
    run = ProbeRun("sdpa", precision, seq)
    for tp in (1, 2):
        point = {"tp": tp, "fuse": "on"}
        fused = probe_block(config, problem.template, point, [run])[run]
        plain = probe_block(config, _UnfusedKernels(), point, [run])[run]
        assert plain - fused == seq * (2 * 4 * h + inter * bytes_ / tp), (tp, plain, fused)
