"""checkpoint(): exact results (dropout replayed), keyword inputs, real recomputation."""

import copy

import torch
from torch import nn

import slapo_tune as st

from _helpers import token_batch


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_step(model, batch, seed=0):
    torch.manual_seed(seed)
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), _grads(model)


def test_checkpoint_with_dropout_is_exact():
    base = st.build(st.create_schedule(st.build_model("gpt2-tiny", resid_pdrop=0.3, attn_pdrop=0.3, embd_pdrop=0.1)))
    base.train()
    ckpt = copy.deepcopy(base)
    sch = st.create_schedule(ckpt)
    for i in range(4):
        sch[f"transformer.h.{i}"].checkpoint()
    batch = token_batch(512)
    loss_a, grads_a = _train_step(base, batch)
    loss_b, grads_b = _train_step(ckpt, batch)
    assert loss_a == loss_b
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], rtol=0, atol=1e-6)
    # dropout really is active: another seed gives another loss
    assert _train_step(base, batch, seed=1)[0] != loss_a


def test_checkpoint_recomputes_and_takes_keyword_inputs():
    model = st.build(st.create_schedule(st.build_model("llama-tiny")))
    calls = []
    # a pre-hook: recomputation stops early, once the last saved tensor is rebuilt
    model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    sch = st.create_schedule(model)
    sch["model.layers.0"].checkpoint()  # LlamaDecoderLayer is called with keyword arguments
    loss = model(**token_batch(512)).loss
    assert len(calls) == 1
    loss.backward()
    assert len(calls) == 2  # recomputed in backward
    with torch.no_grad():
        model(**token_batch(512))
    assert len(calls) == 3  # no checkpointing without grad


def test_checkpointing_reduces_saved_activations():
    def saved_bytes(model):
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**token_batch(512, batch=4, seq=64))
        return total

    plain = st.build(st.create_schedule(st.build_model("gpt2-tiny")))
    ckpt = copy.deepcopy(plain)
    sch = st.create_schedule(ckpt)
    for i in range(4):
        sch[f"transformer.h.{i}"].checkpoint()
    assert saved_bytes(ckpt) < 0.5 * saved_bytes(plain)


def test_fork_rng_changes_masks_per_rank_but_replays_under_checkpoint(fake_group):
    # In a fake group of 2, rank 0 and rank 1 draw different dropout masks in a forked module.
    def masks(rank):
        fake_group(rank=rank, world_size=2)
        drop = nn.Sequential(nn.Dropout(0.5))
        sch = st.create_schedule(drop)
        sch["0"].fork_rng()
        torch.manual_seed(0)
        return drop(torch.ones(1000))

    assert not torch.equal(masks(0), masks(1))
    assert torch.equal(masks(1), masks(1))

    fake_group(rank=1, world_size=2)
    lin = nn.Linear(16, 16)
    model = nn.Sequential(nn.Sequential(lin, nn.Dropout(0.5)))
    twin = copy.deepcopy(model)
    for m, ckpt in ((model, False), (twin, True)):
        sch = st.create_schedule(m)
        sch["0.1"].fork_rng()
        if ckpt:
            sch["0"].checkpoint()
    x = torch.randn(4, 16)
    grads = []
    for m in (model, twin):
        torch.manual_seed(7)
        m(x).sum().backward()
        grads.append(m[0][0].weight.grad)
    assert torch.equal(grads[0], grads[1])
