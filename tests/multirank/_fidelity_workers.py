"""Rank function of the Slapo-fidelity tests: everything that needs two gloo ranks, in one launch."""

from __future__ import annotations

import copy
import functools
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

import slapo_tune as st
import slapo_tune.compat as slapo
from slapo_tune import op
from slapo_tune.parallel import _comm

from _helpers import token_batch, uncompared


def gelu_bias_pattern(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def slapo_style_gpt2(sch, checkpointed=(0, 2)):
    """Tensor parallelism on attention and MLP with syncs, a bias+GeLU fusion and activation
    checkpointing (whole blocks, and a subgraph of the other blocks' MLPs), written only with
    Slapo's call forms (plus num_fused for GPT-2's fused QKV)."""
    world = sch.world_size
    for i in range(4):
        block = sch[f"transformer.h.{i}"]
        attn, mlp = block["attn"], block["mlp"]
        attn["c_attn"].shard("weight", axis=1, num_fused=3)
        attn["c_attn"].shard("bias", axis=0, num_fused=3)
        attn.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        attn["c_proj"].shard("weight", axis=0)
        attn["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        attn.mod.num_heads //= world
        attn.mod.split_size //= world
        mlp["c_fc"].decompose()
        mlp.trace(flatten=True)
        mlp.fuse(mlp.find(gelu_bias_pattern), compiler=None, name="BiasGeLU")
        if i not in checkpointed:  # the output projection and dropout only; c_proj is sharded below
            mlp.checkpoint(mlp.find(lambda x: nn.Dropout(0.0)(Conv1D(1, 1)(x))))
        mlp["c_fc"].shard("weight", axis=1)
        mlp["c_fc"].shard("bias", axis=0)
        mlp.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        mlp["c_proj"].shard("weight", axis=0)
        mlp["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if i in checkpointed:
            block.checkpoint()
    return sch


def _compat_gpt2() -> dict:
    ids = token_batch(512, batch=2, seq=16)["input_ids"]
    sch = slapo.create_schedule(st.build_model("gpt2-tiny"))
    with slapo.Verify(sch, example_inputs=[ids]) as verified:
        slapo_style_gpt2(sch)
    report = verified.report
    unscheduled = st.build_model("gpt2-tiny")
    model, optimizer = slapo.build(sch, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    mlp = model.transformer.h[0].mlp
    out = {"report": str(report), "grad_error": report.max_grad_error, "compared": report.compared,
           "modules_compared": report.modules_compared,
           "uncompared": uncompared(unscheduled, [report.compared]), "fused": type(mlp.BiasGeLU_0).__name__,
           "c_fc_shape": tuple(mlp.c_fc.weight.shape), "wrapper": model.transformer.h[0].mod is model.transformer.h[0],
           "checkpointed_class": (type(model.transformer.h[0]).__name__,
                                  isinstance(model.transformer.h[0], type(unscheduled.transformer.h[0]))),
           "checkpointed_subgraph": [n.target for n in model.transformer.h[1].mlp.graph.nodes if n.op == "call_module"],
           "optimizer_params": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
           "model_params": sum(p.numel() for p in model.parameters())}
    return out


def _all_to_all_values(rank: int, world: int) -> dict[str, bool]:
    """The collective against slicing the whole tensor: forward and backward, on 4-d
    [batch, seq, heads, dim] tensors as Ulysses uses them."""
    full = torch.randn(2, 4 * world, 2 * world, 3, generator=torch.Generator().manual_seed(5))
    weight = torch.randn(2, 4 * world, 2 * world, 3, generator=torch.Generator().manual_seed(6))
    seq_shard = full.chunk(world, dim=1)[rank].clone().requires_grad_()
    head_shard = _comm.all_to_all(seq_shard, 2, 1, None)  # sequence-sharded -> head-sharded
    (head_shard * weight.chunk(world, dim=2)[rank]).sum().backward()
    back = _comm.all_to_all(head_shard.detach(), 1, 2, None)
    return {"forward": torch.equal(head_shard, full.chunk(world, dim=2)[rank]),
            # d/dx of sum(all_to_all(x) * w) is w's slice that x's elements meet: the sequence slice
            "backward": torch.equal(seq_shard.grad, weight.chunk(world, dim=1)[rank]),
            "round_trip": torch.equal(back, seq_shard.detach())}


def _ulysses_attention() -> dict:
    """op.Attention with its core run DeepSpeed-Ulysses style: the sequence is scattered at the
    core's entry, re-partitioned to heads (all_to_all) for attention, back to the sequence after,
    and gathered: the same numbers as the unscheduled module, forward and backward."""
    torch.manual_seed(0)
    model = op.Attention(32, 4)
    reference = copy.deepcopy(model)
    sch = st.create_schedule(model)
    core = sch["core"]
    core.sync("fwd_pre", "scatter", axis=1)  # [batch, seq, 3, heads, dim]: this rank's tokens
    core.sync("fwd_pre", "all_to_all", axis=3, join_axis=1)  # -> all tokens, this rank's heads
    core.sync("fwd_post", "all_to_all", axis=1, join_axis=2)  # [batch, seq, heads, dim] -> tokens
    core.sync("fwd_post", "all_gather", axis=1)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    report = st.verify(model, reference, (x,), loss_fn=lambda out: (out * out).sum(), raise_on_failure=False)
    return {"ok": report.ok, "report": str(report), "params": report.params_compared}


def _reshard_scheme(rank: int, world: int) -> bool:
    """Slapo's "RS->SR" through compat: a [rows, cols] tensor sharded by columns becomes sharded by rows."""
    full = torch.arange(4.0 * world * 4 * world).view(4 * world, 4 * world)
    holder = nn.Sequential(nn.Identity())
    sch = slapo.create_schedule(holder)
    sch["0"].sync(mode="fwd_post", sync_op_or_fn="RS->SR")
    return torch.equal(holder(full.chunk(world, dim=1)[rank]), full.chunk(world, dim=0)[rank])


class ScaledMLP(nn.Module):
    """A column-parallel layer, a per-feature scale held in a buffer, a linear layer with a built-in
    sync (row-parallel once sharded)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.register_buffer("scale", torch.empty(16))
        self.out = op.LinearWithSyncFunc(16, 8)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.copy_(torch.linspace(0.5, 2.0, 16, device=self.scale.device))

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)) * self.scale)


def path_pattern_init(module: nn.Module, path: str) -> None:
    """A custom initialiser whose values a test recomputes by hand: arange / 100 + a per-path offset."""
    offset = zlib.crc32(path.encode()) % 7
    with torch.no_grad():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.copy_(torch.arange(tensor.numel(), dtype=tensor.dtype).view(tensor.shape) / 100 + offset)


def _buffers_and_custom_init(rank: int, world: int) -> dict:
    with torch.device("meta"):
        model, reference = ScaledMLP(), ScaledMLP()
    sch = st.create_schedule(model)
    sch["fc"].shard("weight", 0)
    sch["fc"].shard("bias", 0)
    sch["fc"].sync("bwd_post", "all_reduce")
    sch.shard("scale", 0)
    sch["out"].shard("weight", 1)
    sch["out"].mod.sync_fn = op.all_reduce
    built = st.build(sch, init_weights=path_pattern_init)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    report = st.verify(built, reference, (x,), loss_fn=lambda out: (out * out).sum(), raise_on_failure=False,
                       init_weights=path_pattern_init)
    expected_fc = (torch.arange(16 * 8.0).view(16, 8) / 100 + zlib.crc32(b"fc") % 7).chunk(world, dim=0)[rank]
    expected_scale = (torch.arange(16.0) / 100 + zlib.crc32(b"") % 7).chunk(world)[rank]
    return {"ok": report.ok, "report": str(report), "params": report.params_compared,
            "fc_is_hand_value": torch.equal(built.fc.weight, expected_fc),
            "scale_is_hand_value": torch.equal(built.scale, expected_scale),
            "scale_shape": tuple(built.scale.shape)}


def run_fidelity_suite(ctx) -> dict:
    r, w = ctx.rank, ctx.world_size
    return {"compat_gpt2": _compat_gpt2(), "all_to_all": _all_to_all_values(r, w), "ulysses": _ulysses_attention(),
            "reshard": _reshard_scheme(r, w), "buffers": _buffers_and_custom_init(r, w)}
