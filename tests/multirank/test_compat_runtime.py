"""Slapo's runtime helpers through ``slapo_tune.compat``: ``slapo.sharding``'s sync ops, the RNG
tracker and ``set_random_seed`` (replayed by ``checkpoint``), ``sch.metadata`` and
parameter tags (``orig_shape``), tied parameters sharded twice, ``op.FusedMLP``'s call form, the
embedding hooks, ``get_hooks``, ``report_memory`` and the rank-filtering logger. Expected values
come from plain torch (or transformers' own GPT-2 MLP), not from slapo-tune."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _compat_workers import run_compat_runtime
from torch import nn

import slapo_tune.compat as slapo
from slapo_tune import ShardingError
from slapo_tune.compat import op
from slapo_tune.compat.random import get_cuda_rng_tracker, set_random_seed
from slapo_tune.compat.utils.common import get_hooks
from slapo_tune.compat.utils.report import report_memory
from slapo_tune.launch import launch
from slapo_tune.schedule._schedule import state_of


@pytest.fixture(scope="module")
def ranks():
    return launch(run_compat_runtime, 2, timeout=300)


def test_sync_ops_match_hand_computed_collectives(ranks):
    for rank in ranks:
        assert rank["sync_ops"] == {"all_gather": True, "all_gather_reduce_grad": True, "reduce_scatter": True,
                                    "scatter": True, "reduce_forward": True, "reduce_backward": True}


def test_embedding_hooks_give_the_full_lookup_and_gradient(ranks):
    for rank in ranks:
        emb = rank["embedding"]
        assert emb["output"] and emb["grad"]
        assert "vocab_size 18 differs from the embedding's 16 rows" in emb["refused"]


def test_logger_logs_only_on_the_ranks_asked(ranks):
    assert ranks[0]["log"] == ["[Rank 0] only on rank 0", "[Rank 0] everywhere"]
    assert ranks[1]["log"] == ["[Rank 1] everywhere", "[Rank 1] on ranks [1]"]


def test_set_random_seed_seeds_per_stage_and_replica():
    assert set_random_seed(5, dp_rank=2, pp_rank=1) == 5 + 10 * 2 + 100 * 1
    drawn = torch.rand(4)
    torch.manual_seed(125)
    assert torch.equal(drawn, torch.rand(4))


def test_tracker_forks_a_stream_per_tensor_parallel_rank_and_restores_the_default():
    masks = {}
    for tp_rank in (0, 1):
        set_random_seed(7, tp_rank=tp_rank)
        with get_cuda_rng_tracker().fork():
            masks[tp_rank] = torch.rand(64)
        masks[f"after{tp_rank}"] = torch.rand(64)
    set_random_seed(7, tp_rank=0)
    assert not torch.equal(masks[0], masks[1])  # each tp rank drops its own elements
    assert torch.equal(masks["after0"], masks["after1"])  # the default stream is untouched by the fork
    assert torch.equal(masks["after0"], torch.rand(64))
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(64), masks[0])  # the forked stream starts where its seed says
        again = torch.rand(64)
    with get_cuda_rng_tracker().fork():
        assert not torch.equal(torch.rand(64), again)  # and advances across forks
    get_cuda_rng_tracker().reset()
    with pytest.raises(RuntimeError, match="set_random_seed"), get_cuda_rng_tracker().fork():
        pass


class _ForkedDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        with get_cuda_rng_tracker().fork():
            x = F.dropout(self.fc1(x), p=0.5)
        return F.dropout(self.fc2(x), p=0.5)


def test_checkpoint_replays_the_tracker_states():
    model = _ForkedDropout()
    x = torch.randn(8, 16)

    def grads(use_checkpoint):
        set_random_seed(3, tp_rank=0)
        out = slapo.checkpoint(model, x) if use_checkpoint else model(x)
        out.square().sum().backward()
        result = [out.detach()] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return result

    for plain, checkpointed in zip(grads(False), grads(True), strict=True):
        assert torch.equal(plain, checkpointed)
    get_cuda_rng_tracker().reset()


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return self.layer2(F.relu(self.layer1(x)) * scale)


def test_metadata_tags_and_orig_shape_survive_build():
    tied = _Pair()
    tied.layer2.weight = tied.layer1.weight
    assert list(slapo.create_schedule(tied).metadata.tie_weights) == [tied.layer1.weight]
    with slapo.init_empty_weights():
        model = _Pair()
    sch = slapo.create_schedule(model)
    assert not sch.metadata.tie_weights and not sch.metadata.param_tags
    sch["layer1"].shard("weight", axis=0)
    sch["layer1"].shard("bias", axis=0)
    sch["layer2"].annotate("bias", "owner", "layer2")
    assert sch.metadata.param_tags == {"orig_shape", "owner"}
    assert model.layer1.weight.orig_shape == torch.Size([8, 8]) and model.layer2.bias.owner == "layer2"  # at once
    built, _ = slapo.build(sch)
    assert built.layer1.weight.device.type == "cpu"  # materialised: new parameters ...
    assert built.layer1.weight.orig_shape == torch.Size([8, 8]) and built.layer2.bias.owner == "layer2"  # ... tagged
    assert not hasattr(built.layer2.weight, "owner") and not hasattr(built.layer2.weight, "orig_shape")


def test_a_tied_parameter_sharded_again_along_the_same_axis_stays_tied():
    model = _Pair()
    model.layer2.weight = model.layer1.weight
    sch = slapo.create_schedule(model)
    sch["layer1"].shard("weight", axis=0)
    sch["layer2"].shard("weight", axis=0)  # Slapo's schedules shard each holder of a tie
    assert model.layer2.weight is model.layer1.weight and len(sch.metadata.tie_weights) == 1
    with pytest.raises(ShardingError, match="already sharded"):
        sch["layer2"].shard("weight", axis=1)


def test_fused_mlp_takes_slapos_call_form_and_computes_gpt2s_mlp():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    for activation in ("gelu", "gelu_new"):
        config = GPT2Config(n_embd=16, activation_function=activation, resid_pdrop=0.25)
        reference = GPT2MLP(64, config)
        mlp = op.FusedMLP(16, 64, activation, 0.25, use_torchscript=True)
        with torch.no_grad():  # GPT-2's Conv1D stores [in, out]
            mlp.fc_in.weight.copy_(reference.c_fc.weight.T)
            mlp.fc_in.bias.copy_(reference.c_fc.bias)
            mlp.fc_out.weight.copy_(reference.c_proj.weight.T)
            mlp.fc_out.bias.copy_(reference.c_proj.bias)
        x = torch.randn(2, 5, 16)
        torch.manual_seed(0)
        expected = reference(x)
        torch.manual_seed(0)
        assert torch.allclose(mlp(x), expected, atol=1e-6)  # the same dropout mask, drawn at the same point


def test_get_hooks_lists_user_hooks_and_syncs_by_mode():
    model = _Pair()
    sch = slapo.create_schedule(model)

    def pre(module, inputs):
        return None

    sch["layer2"].sync(mode="fwd_pre", sync_op_or_fn=pre)
    sch["layer2"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["layer2"].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=1)
    hooks = get_hooks(model.layer2)
    assert hooks["fwd_pre"] == [pre] and len(hooks["bwd_post"]) == 1 and len(hooks["fwd_post"]) == 1
    syncs = state_of(model.layer2)
    assert hooks["bwd_post"][0] == syncs.pre_syncs[0].apply and hooks["fwd_post"][0] == syncs.post_syncs[0].apply
    assert get_hooks(model.layer1) == {"fwd_pre": [], "fwd_post": [], "bwd_post": []}


def test_report_memory_counts_the_bytes_of_live_cpu_tensors():
    import gc

    gc.collect()  # what earlier tests left unreachable goes now, not between the readings below
    before = report_memory("before")
    held = torch.ones(1 << 20)  # 4 MiB
    assert report_memory("held") - before == pytest.approx(4.0)
    with slapo.init_empty_weights():
        meta = nn.Linear(1024, 1024)
    assert report_memory("meta") - before == pytest.approx(4.0)  # a meta model holds no memory
    del held, meta
    assert report_memory("freed") == pytest.approx(before)

