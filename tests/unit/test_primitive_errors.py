"""Every bad use of a primitive: a clear exception, and the model left as it was."""

import pytest
import torch
from torch import nn

import slapo_tune as st
from slapo_tune.schedule._schedule import state_of


def _snapshot(model: nn.Module):
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    states = {n for n, m in model.named_modules() if state_of(m) is not None}
    attrs = {n: dict(vars(m)) for n, m in model.named_modules() if hasattr(m, "nf") or hasattr(m, "in_features")}
    attrs = {n: {k: v for k, v in d.items() if isinstance(v, int)} for n, d in attrs.items()}
    return shapes, states, attrs


@pytest.fixture
def gpt2(fake_group):
    model = st.build_model("gpt2-tiny", n_embd=66, n_head=6)  # 66 is not divisible by 4
    return model, st.create_schedule(model)


def _refused(model, exc, match, fn):
    before = _snapshot(model)
    with pytest.raises(exc, match=match):
        fn()
    assert _snapshot(model) == before


def test_shard_bad_uses(gpt2, fake_group):
    model, sch = gpt2
    mlp = sch["transformer.h.0.mlp"]
    _refused(model, st.ShardingError, "no parameter 'wieght'.*parameters: 'weight', 'bias'",
             lambda: mlp["c_fc"].shard("wieght", 1))
    _refused(model, st.ShardingError, "axis 2 is out of range", lambda: mlp["c_fc"].shard("weight", 2))
    fake_group(world_size=4)
    sch4 = st.create_schedule(model)
    _refused(model, st.ShardingError, "dimension 1 of size 66 is not divisible by 4",
             lambda: sch4["transformer.h.0.mlp.c_proj"].shard("weight", 1))
    _refused(model, st.ShardingError, r"not divisible by 12 \(tensor-parallel size 4 x 3 fused blocks\)",
             lambda: sch4["transformer.h.0.attn.c_attn"].shard("weight", 1, num_fused=3))
    # one bad name in a list refuses the whole call
    _refused(model, st.ShardingError, "no parameter 'nope'", lambda: mlp["c_fc"].shard(["weight", "nope"], 1))


def test_shard_twice_and_through_a_tie_is_refused(gpt2):
    model, sch = gpt2
    sch["transformer.h.0.mlp.c_fc"].shard("weight", 1)
    _refused(model, st.ShardingError, "already sharded; shard a parameter once",
             lambda: sch["transformer.h.0.mlp.c_fc"].shard("weight", 0))
    sch["transformer.wte"].shard("weight", 0)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives
    assert model.lm_head.weight.shape == (256, 66) and model.lm_head.out_features == 256
    _refused(model, st.ShardingError, "tied to a parameter sharded elsewhere", lambda: sch["lm_head"].shard("weight", 0))


def test_shard_axis_zero_keeps_in_features(fake_group):
    model = nn.Sequential(nn.Linear(8, 6))
    sch = st.create_schedule(model)
    sch["0"].shard(["weight", "bias"], 0)
    assert (model[0].in_features, model[0].out_features) == (8, 3)
    assert model[0].weight.shape == (3, 8) and model[0].bias.shape == (3,)
    model2 = nn.Sequential(nn.Linear(8, 6))
    st.create_schedule(model2)["0"].shard("weight", 1)
    assert (model2[0].in_features, model2[0].out_features) == (4, 6)


@pytest.mark.parametrize("bias_first", [False, True])
def test_sharded_modules_describe_their_local_shard(gpt2, bias_first):
    """After sharding at tp=2, every module's size attributes are those of its local weights (code
    that reads ``out_features``, ``nf`` or ``num_embeddings``, as Hugging Face does, sees the shard),
    and the output layout it declares is where its output is split."""
    from slapo_tune.schedule._graph import FusedLinear

    model, sch = gpt2  # n_embd 66, vocabulary 512, 256 positions
    for name, axis in [("bias", 0), ("weight", 1)][:: 1 if bias_first else -1]:  # Conv1D: weight is [in, out]
        sch["transformer.h.0.mlp.c_fc"].shard(name, axis)
    sch["transformer.h.0.mlp.c_proj"].shard("weight", 0)
    sch["transformer.wte"].shard("weight", 0)
    sch["transformer.wpe"].shard("weight", 1)
    fc, proj, wte, wpe = (model.transformer.h[0].mlp.c_fc, model.transformer.h[0].mlp.c_proj, model.transformer.wte,
                          model.transformer.wpe)
    assert (fc.nx, fc.nf) == (66, 132) == tuple(fc.weight.shape) and fc.bias.shape == (132,)
    assert (proj.nx, proj.nf) == (132, 66) == tuple(proj.weight.shape)
    assert (wte.num_embeddings, wte.embedding_dim) == (256, 66) == tuple(wte.weight.shape)
    assert (wpe.num_embeddings, wpe.embedding_dim) == (256, 33) == tuple(wpe.weight.shape)
    sch["transformer.wpe"].sync("fwd_post", "all_gather", axis=-1)  # the hidden features are what is split
    assert wpe(torch.arange(8)[None]).shape == (1, 8, 66)  # (the fake group gathers shapes, not values)
    fused = nn.Sequential(FusedLinear(8, [4, 2, 2], bias=True))  # grouped-query QKV: blocks of unequal sizes
    fused_sch = st.create_schedule(fused)
    for name in ["bias", "weight"] if bias_first else ["weight", "bias"]:
        fused_sch["0"].shard(name, 0, num_fused=[4, 2, 2])
    assert fused[0].split_sizes == [2, 1, 1] and fused[0].out_features == 4 == fused[0].weight.shape[0]
    assert fused[0].bias.shape == (4,)


def test_sync_contradicting_the_layout_is_refused(gpt2):
    model, sch = gpt2
    fc, proj = sch["transformer.h.0.mlp.c_fc"], sch["transformer.h.0.mlp.c_proj"]
    fc.shard("weight", 1)  # column parallel: output partitioned
    fc.shard("bias", 0)
    proj.shard("weight", 0)  # row parallel: output partial
    _refused(model, st.SyncError, r"output is partition\(axis=-1\), so all_reduce would be wrong",
             lambda: fc.sync("fwd_post", "all_reduce"))
    _refused(model, st.SyncError, "output is partial, so all_gather would be wrong",
             lambda: proj.sync("fwd_post", "all_gather", axis=-1))
    _refused(model, st.SyncError, "partitioned along axis -1, not -2", lambda: fc.sync("fwd_post", "all_gather", axis=-2))
    _refused(model, st.SyncError, "gradient is partitioned too", lambda: proj.sync("bwd_post", "all_reduce"))
    _refused(model, st.SyncError, "expects a replicated input, but scatter produces",
             lambda: fc.sync("fwd_pre", "scatter", axis=-1))
    _refused(model, st.SyncError, "mode must be one of", lambda: proj.sync("fwd_mid", "all_reduce"))
    _refused(model, st.SyncError, "op must be one of", lambda: proj.sync("fwd_post", "broadcast"))
    _refused(model, st.SyncError, "only all_reduce .* applies to input gradients",
             lambda: fc.sync("bwd_post", "all_gather"))
    proj.sync("fwd_post", "all_reduce")  # positional use as in the paper
    _refused(model, st.SyncError, "output is replicated, so all_reduce would be wrong",
             lambda: proj.sync("fwd_post", "all_reduce"))


def test_checkpoint_set_attr_and_build_refusals(gpt2):
    model, sch = gpt2
    sch["transformer.h.0"].checkpoint()
    _refused(model, st.ScheduleError, "already checkpointed", lambda: sch["transformer.h.0"].checkpoint())
    _refused(model, st.ScheduleError, "ModuleList has no forward", lambda: sch["transformer.h"].checkpoint())
    _refused(model, st.ScheduleError, "no plain attribute 'nheads'", lambda: sch["transformer.h.0.attn"].set_attr("nheads", 1))
    _refused(model, st.ScheduleError, "no plain attribute 'c_attn'", lambda: sch["transformer.h.0.attn"].set_attr("c_attn", 1))
    sch["transformer.h.1.mlp.c_fc"].shard("weight", 1)  # bias forgotten
    with pytest.raises(st.ScheduleError, match="weight is sharded along the output features but its bias is not"):
        st.build(sch)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing materialised


def test_replace_of_a_sharded_module_is_refused(gpt2):
    model, sch = gpt2
    sch["transformer.h.0.mlp.c_fc"].shard("weight", 1)
    _refused(model, st.ScheduleError, "are sharded; replace the module before sharding",
             lambda: sch["transformer.h.0.mlp.c_fc"].replace(nn.Linear(66, 264)))


def test_create_schedule_and_build_reject_non_modules():
    with pytest.raises(st.ScheduleError, match="expected an nn.Module"):
        st.create_schedule("gpt2")
    with pytest.raises(st.ScheduleError, match="expected a Schedule"):
        st.build(torch.nn.Linear(2, 2))
