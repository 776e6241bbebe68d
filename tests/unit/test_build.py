import pytest
import torch
from torch import nn

import slapo_tune as st
import slapo_tune.schedule._build as build_mod

from _helpers import token_batch, tp_schedule


def _weights(model):
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny", "opt-tiny"])
def test_materialize_is_deterministic_and_runs(name):
    a = st.build(st.create_schedule(st.build_model(name)), seed=3)
    b = st.build(st.create_schedule(st.build_model(name)), seed=3)
    c = st.build(st.create_schedule(st.build_model(name)), seed=4)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    assert all(t.device.type == "cpu" for t in wa.values())
    out = a(**token_batch(a.config.vocab_size))
    assert torch.isfinite(out.loss)


def test_materialize_follows_the_model_init_rules():
    model = st.build(st.create_schedule(st.build_model("gpt2-tiny")), seed=0)
    h0 = model.transformer.h[0]
    assert torch.equal(h0.ln_1.weight, torch.ones_like(h0.ln_1.weight))
    assert torch.equal(h0.attn.c_attn.bias, torch.zeros_like(h0.attn.c_attn.bias))
    std = h0.mlp.c_fc.weight.std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02
    # GPT-2's scaled init of the residual projections: 0.02 / sqrt(2 * n_layer)
    assert h0.mlp.c_proj.weight.std().item() < 0.6 * std
    assert model.lm_head.weight is model.transformer.wte.weight
    llama = st.build(st.create_schedule(st.build_model("llama-tiny")))
    inv_freq = llama.model.rotary_emb.inv_freq
    assert torch.isfinite(inv_freq).all() and inv_freq[0].item() == 1.0


def test_build_never_overwrites_real_weights():
    model = st.build_model("gpt2-tiny", device="cpu")
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.fill_(0.125)
    before = _weights(model)
    st.build(st.create_schedule(model), seed=9)
    after = _weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_partially_real_model_keeps_its_real_part():
    model = st.build_model("gpt2-tiny")
    real = nn.Linear(64, 256)
    with torch.no_grad():
        real.weight.fill_(0.5)
    model.transformer.h[1].mlp.c_fc = real
    st.build(st.create_schedule(model))
    assert torch.all(model.transformer.h[1].mlp.c_fc.weight == 0.5)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_materialization_is_the_slice_of_the_full_tensor(fake_group, rank):
    fake_group(rank=rank, world_size=2)
    sharded = st.build(tp_schedule("gpt2-tiny"), seed=5)
    import torch.distributed as dist

    dist.destroy_process_group()
    full = st.build(st.create_schedule(st.build_model("gpt2-tiny")), seed=5)
    h = 64
    qkv = full.transformer.h[0].attn.c_attn.weight  # [h, 3h] = [q | k | v]
    mine = torch.cat([qkv[:, b * h + rank * h // 2: b * h + (rank + 1) * h // 2] for b in range(3)], dim=1)
    assert torch.equal(sharded.transformer.h[0].attn.c_attn.weight, mine)
    assert torch.equal(sharded.transformer.h[0].mlp.c_proj.weight, full.transformer.h[0].mlp.c_proj.weight.chunk(2, 0)[rank])
    assert torch.equal(sharded.transformer.wte.weight, full.transformer.wte.weight.chunk(2, 0)[rank])
    assert sharded.lm_head.weight is sharded.transformer.wte.weight
    assert torch.equal(sharded.transformer.h[0].ln_1.weight, full.transformer.h[0].ln_1.weight)
    # a shard owns its memory: no shard keeps the full tensor's storage alive
    for name, p in sharded.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name


def test_small_units_give_the_same_weights_across_units_and_ties(monkeypatch):
    monkeypatch.setattr(build_mod, "_UNIT_ELEMENTS", 5000)  # forces many units, the tie across two
    units = list(build_mod._init_units(st.build_model("gpt2-tiny")))
    assert len(units) > 10
    a = st.build(st.create_schedule(st.build_model("gpt2-tiny")), seed=1)
    b = st.build(st.create_schedule(st.build_model("gpt2-tiny")), seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.lm_head.weight is a.transformer.wte.weight


class _NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, x):
        return x * self.scale


def test_meta_tensor_without_initializer_is_a_clear_error():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoInit())
    with pytest.raises(st.MaterializeError, match=r"_NoInit.scale is on the meta device and its initialiser did not set it"):
        st.build(st.create_schedule(model))


@pytest.mark.parametrize("preset,template", [("gpt2-tiny", None), ("llama-tiny", "generic")])
def test_zero3_makes_every_block_its_own_sharded_unit(fake_group, preset, template):
    """ZeRO-3 at pp=1 finds the block list itself and shards each block apart from the root, so a
    block is gathered only while it runs (what the memory model's ``gathered`` term counts); one
    unit for the whole model would gather everything at once and still compute the same numbers."""
    from torch.distributed.fsdp import FSDPModule

    from search_spaces import load_template, template_for
    from slapo_tune.topology import init_topology

    topology = init_topology(pp=1, tp=1)  # the fake group's 2 ranks: dp=2
    model = st.build_model(preset)
    chosen = load_template(template) if template else template_for(model.config)
    stage = st.build(st.create_schedule(model), topology=topology, zero=3, seed=0)
    blocks = stage.model.get_submodule(chosen.blocks_path(stage.model))
    assert topology.dp == 2 and len(blocks) == 4
    assert all(isinstance(block, FSDPModule) for block in blocks) and isinstance(stage, FSDPModule)
    assert not any(isinstance(m, FSDPModule) for m in blocks[0].modules() if m is not blocks[0])


def test_the_block_list_is_the_module_list_holding_the_most_parameters():
    from slapo_tune.parallel._data_parallel import largest_module_list

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
            self.heads = nn.ModuleList([nn.Linear(4, 4)])  # a later, smaller list (per-task heads)
            self.hooks = nn.ModuleList()  # and an empty one

    path, found = largest_module_list(Model())
    assert path == "blocks" and len(found) == 4
    assert largest_module_list(nn.Sequential(nn.Linear(2, 2))) is None


def test_data_parallel_all_reduces_gradients_in_buckets_of_32_mib(fake_group, monkeypatch):
    """Replicated data parallelism all-reduces gradients in flat buckets that close once they reach
    32 MiB (DDP's default is 25): few collectives, and at most one bucket's copy held at a time."""
    import weakref

    import torch.distributed as dist

    from slapo_tune.parallel import _data_parallel

    sizes, made, alive_at_cat = [], [], []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: sizes.append(t.numel() * t.element_size()))
    concatenate = torch.cat

    def cat(tensors):  # how many earlier buckets are still alive while the next is made
        alive_at_cat.append(sum(ref() is not None for ref in made))
        flat = concatenate(tensors)
        made.append(weakref.ref(flat))
        return flat

    monkeypatch.setattr(torch, "cat", cat)
    quarter = 4 * 2**20  # 16 MiB of fp32
    params = [nn.Parameter(torch.empty(quarter)) for _ in range(5)]
    for i, p in enumerate(params):
        p.grad = torch.full((quarter,), float(i + 1))
    _data_parallel.average_gradients(params, None)  # the fake group has 2 ranks
    assert sizes == [32 * 2**20, 32 * 2**20, 16 * 2**20]
    assert alive_at_cat == [0, 0, 0]  # (two buckets at once measured 56.7 MB over the model's one)
    assert [p.grad[0].item() for p in params] == [0.5, 1.0, 1.5, 2.0, 2.5]  # (the fake sum is the rank's own)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_data_parallel_rank_takes_its_own_rows_of_the_global_batch(fake_group, rank):
    """The global batch is the same on every rank; data-parallel rank r trains rows [r*n, (r+1)*n),
    and a batch that does not split into dp x micro-batches equal parts is refused, not truncated."""
    from slapo_tune.runtime import TrainStep
    from slapo_tune.topology import init_topology

    fake_group(rank=rank)
    topology = init_topology(pp=1, tp=1)  # dp=2
    stage = st.build(st.create_schedule(st.build_model("gpt2-tiny")), topology=topology, seed=0)
    step = TrainStep(stage, n_microbatches=2)
    ids = torch.arange(8)[:, None].repeat(1, 4)  # row i holds i
    local, labels = step.local_batch({"input_ids": ids})
    assert local[:, 0].tolist() == labels[:, 0].tolist() == [4 * rank + i for i in range(4)]
    with pytest.raises(st.ScheduleError, match=r"global batch 6 is not divisible by dp x micro-batches = 2 x 2"):
        step.local_batch({"input_ids": ids[:6]})
