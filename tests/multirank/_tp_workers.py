"""Rank functions for the tensor-parallel tests (run in spawned processes)."""

from __future__ import annotations

import torch

import slapo_tune as st
from slapo_tune.parallel import _comm
from slapo_tune.parallelize import apply_tensor_parallel

from _helpers import FAMILIES, bias_then, family_module, token_batch, tp_schedule


def _verify_case(sch, preset):
    ref = st.build_model(preset)
    batch = token_batch(ref.config.vocab_size, batch=2, seq=24)
    try:
        report = st.verify(st.build(sch), ref, batch)
        return {"ok": True, "report": str(report), "grad_error": report.max_grad_error,
                "compared": report.compared}
    except st.VerificationError as exc:
        return {"ok": False, "report": str(exc)}


def _missing_sync_schedule():
    """GPT-2 tensor parallelism with the MLP output reduction of block 1 forgotten."""
    plan = dict(family_module("gpt2-tiny").TP_PLAN)
    del plan["transformer.h.*.mlp.c_proj"]
    sch = st.create_schedule(st.build_model("gpt2-tiny"))
    apply_tensor_parallel(sch, plan)
    for i in range(4):
        node = sch[f"transformer.h.{i}.mlp.c_proj"]
        node.shard("weight", 0)
        if i != 1:
            node.sync("fwd_post", "all_reduce")
    return sch


def _fused_schedule(preset):
    """Tensor parallelism on top of fusion: GPT-2's bias+GELU fused vertically, Llama's Q/K/V
    fused horizontally (then sharded block by block)."""
    sch = st.create_schedule(st.build_model(preset))
    for i in range(4):
        if preset == "gpt2-tiny":
            mlp = sch[f"transformer.h.{i}.mlp"]
            act = mlp.mod.act
            mlp["c_fc"].decompose()
            mlp = mlp.trace()
            mlp.fuse(mlp.find(bias_then(act)), compiler="eager")
        else:
            attn = sch[f"model.layers.{i}.self_attn"]
            attn.replace(st.fuse_linears, target=attn.find(r"[qkv]_proj"), name="qkv_proj")
    plan = dict(family_module(preset).TP_PLAN)
    if preset == "llama-tiny":
        for k in ("q_proj", "k_proj", "v_proj"):
            del plan[f"model.layers.*.self_attn.{k}"]
        plan["model.layers.*.self_attn.qkv_proj"] = family_module(preset).TP_PLAN["model.layers.*.self_attn.q_proj"]
    apply_tensor_parallel(sch, plan)
    return sch


def _comm_checks(ctx):
    r, w = ctx.rank, ctx.world_size
    out = {}
    x = torch.full((2, 2), float(r + 1), requires_grad=True)
    y = _comm.reduce_fwd(x, None)
    y.sum().backward()
    out["reduce_fwd"] = (y[0, 0].item(), x.grad[0, 0].item())  # (sum of ranks, 1: not world-multiplied)
    x = torch.ones(2, 2, requires_grad=True)
    y = _comm.reduce_bwd(x, None)
    (y * (r + 1)).sum().backward()
    out["reduce_bwd"] = (y[0, 0].item(), x.grad[0, 0].item())
    x = torch.full((2, 2), float(r), requires_grad=True)
    y = _comm.gather(x, -1, None)
    (y * torch.arange(2 * w, dtype=torch.float)).sum().backward()
    out["gather"] = (tuple(y.shape), y[0].tolist(), x.grad[0].tolist())
    x = torch.arange(2 * w, dtype=torch.float).repeat(2, 1).requires_grad_()
    y = _comm.reduce_scatter(x, -1, None)
    y.sum().backward()
    out["reduce_scatter"] = (tuple(y.shape), y[0].tolist(), x.grad[0].tolist())
    x = torch.arange(2 * w, dtype=torch.float).repeat(2, 1).requires_grad_()
    y = _comm.scatter(x, -1, None)
    (y * 3).sum().backward()
    out["scatter"] = (y[0].tolist(), x.grad[0].tolist())
    out["sequence_axis"] = _sequence_axis_checks(r, w)
    return out


def _sequence_axis_checks(r: int, w: int) -> dict[str, bool]:
    """Sequence parallelism splits [batch, seq, hidden] along axis 1, not the last axis: each
    collective along axis 1 (and -2) gives, values and gradients, what it gives along the last axis
    of the transposed tensor (checked above against hand-computed numbers)."""
    out = {}
    local = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(r))
    full = torch.randn(2, 4 * w, 3, generator=torch.Generator().manual_seed(100))  # the same on every rank
    weight = torch.randn(2, 4 * w, 3, generator=torch.Generator().manual_seed(200))
    for name, fn, x, scale in [("gather", _comm.gather, local, weight), ("reduce_scatter", _comm.reduce_scatter, full, None),
                               ("scatter", _comm.scatter, full, None)]:
        for axis in (1, -2):
            a = x.clone().requires_grad_()
            y = fn(a, axis, None)
            (y * (scale if scale is not None else y.detach())).sum().backward()
            b = x.transpose(1, 2).contiguous().requires_grad_()
            z = fn(b, -1, None).transpose(1, 2)
            (z * (scale if scale is not None else z.detach())).sum().backward()
            out[f"{name}@{axis}"] = torch.equal(y, z) and torch.equal(a.grad, b.grad.transpose(1, 2))
    return out


def run_tp_suite(ctx, ckpt_ratios):
    results = {"comm": _comm_checks(ctx)}
    for preset in FAMILIES:
        for ratio in ckpt_ratios:
            results[(preset, ratio)] = _verify_case(tp_schedule(preset, ckpt_ratio=ratio), preset)
    results["missing_sync"] = _verify_case(_missing_sync_schedule(), "gpt2-tiny")
    for preset in ("gpt2-tiny", "llama-tiny"):
        results[("fused", preset)] = _verify_case(_fused_schedule(preset), preset)
    return results
