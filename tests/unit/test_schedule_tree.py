import pytest
import torch
from torch import nn

import slapo_tune as st
from slapo_tune.schedule._schedule import state_of


def test_paths_address_submodules_and_flatten_module_lists():
    model = st.build_model("gpt2-tiny")
    sch = st.create_schedule(model)
    node = sch["transformer.h.0.attn"]
    assert node.mod is model.transformer.h[0].attn
    assert node.path == "transformer.h.0.attn"
    assert sch["transformer"]["h.1.mlp"].mod is model.transformer.h[1].mlp
    assert node.parent.mod is model.transformer.h[0]
    paths = [p for p, _ in sch.named_schedules()]
    assert paths == [p for p, _ in model.named_modules()]
    assert "transformer.h.3.mlp.c_fc" in sch and "transformer.h.9" not in sch


def test_wrong_path_names_the_closest_valid_paths():
    sch = st.create_schedule(st.build_model("gpt2-tiny"))
    with pytest.raises(KeyError) as info:
        sch["transformer.h.0.atn"]
    msg = str(info.value)
    assert "no module 'transformer.h.0.atn'" in msg and "'transformer.h.0.attn'" in msg
    with pytest.raises(st.ScheduleKeyError):
        sch["transformer"]["hh"]


def test_find_matches_full_paths_by_regex():
    sch = st.create_schedule(st.build_model("llama-tiny"))
    hits = sch.find(r"model\.layers\.\d+\.self_attn\.[qkv]_proj")
    assert len(hits) == 12 and all(isinstance(h.mod, nn.Linear) for h in hits)


class _Twice(nn.Module):
    def forward(self, x):
        return 2 * x


class _NoInput(nn.Module):
    def forward(self):
        return torch.zeros(1)


def test_replace_keeps_hooks_and_updates_the_tree():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    seen = []
    model[1].register_forward_hook(lambda m, a, o: seen.append(o.shape))
    sch = st.create_schedule(model)
    node = sch["1"].replace(_Twice())
    assert isinstance(model[1], _Twice) and sch["1"] is node and node.mod is model[1]
    out = model(torch.ones(2, 4))
    assert seen == [out.shape]


@pytest.mark.parametrize("register", ["register_full_backward_hook", "register_backward_hook"])
def test_replace_keeps_backward_hooks_running(register):
    """A backward hook moved to the new module still runs: nn.Module runs a module's backward hooks
    only when it knows their kind (full or legacy), which the new module must be told."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    grads = []
    getattr(model[1], register)(lambda m, grad_in, grad_out: grads.append(grad_out[0].clone()))
    st.create_schedule(model)["1"].replace(_Twice())
    model(torch.ones(2, 4)).sum().backward()
    assert len(grads) == 1 and torch.equal(grads[0], torch.ones(2, 4))  # d(sum)/d(output)


def test_replace_refusals_leave_the_model_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    sch = st.create_schedule(model)
    with pytest.raises(st.ScheduleError, match="cannot replace the root"):
        sch.replace(nn.Identity())
    with pytest.raises(st.ScheduleError, match="cannot take the 1 positional input"):
        sch["1"].replace(_NoInput())
    with pytest.raises(st.ScheduleError, match="expected an nn.Module"):
        sch["1"].replace(lambda x: x)
    assert isinstance(model[1], nn.ReLU)


def test_replace_all_counts_and_replaces_outermost():
    model = st.build_model("gpt2-tiny", device="cpu")
    sch = st.create_schedule(model)
    n = sch.replace_all(nn.Dropout, lambda old: nn.Identity())
    assert n == sum(1 for m in st.build_model("gpt2-tiny").modules() if isinstance(m, nn.Dropout))
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_annotations_survive_sharding_and_build(fake_group):
    sch = st.create_schedule(st.build_model("gpt2-tiny"))
    node = sch["transformer.h.0.mlp.c_fc"]
    node.annotate("weight", "lr_scale", 0.5)
    node.shard("weight", 1)
    node.shard("bias", 0)
    st.build(sch)
    assert node.get_annotation("weight", "lr_scale") == 0.5
    assert state_of(node.mod).annotations["weight"]["lr_scale"] == 0.5
    with pytest.raises(st.ScheduleError, match="no parameter 'wieght'"):
        node.annotate("wieght", "k", 1)
