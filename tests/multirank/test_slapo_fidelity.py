"""What Slapo users write runs here: subgraph checkpointing, custom initialisers, all-to-all
resharding, registered primitives, ready modules (``slapo_tune.op``), sharded buffers, and Slapo's
call forms through ``slapo_tune.compat``. Two-rank checks share one gloo launch."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo_tune as st
import slapo_tune.compat as slapo
from slapo_tune import op
from slapo_tune.launch import launch
from slapo_tune.schedule import _graph
from slapo_tune.schedule._schedule import state_of

from _fidelity_workers import run_fidelity_suite


@pytest.fixture(scope="module")
def ranks():
    return launch(run_fidelity_suite, 2, timeout=300)


# ------------------------------------------------------------------ two ranks
def test_slapo_style_gpt2_schedule_verifies_on_two_ranks(ranks):
    """TP on attention and MLP with syncs, a bias+GeLU fusion and checkpointing, written with
    Slapo's call forms, verified by compat.Verify: loss, outputs and every gradient."""
    for rank, res in enumerate(ranks):
        case = res["compat_gpt2"]
        assert "verify: OK" in case["report"], f"rank {rank}:\n{case['report']}"
        assert case["grad_error"] < 1e-4 and case["modules_compared"] > 40
        assert case["compared"] and not case["uncompared"]  # every gradient of the unscheduled model
        assert case["fused"] == "BiasGeLU" and case["c_fc_shape"] == (64, 128)  # [in, out / 2]: sharded
        assert case["wrapper"]  # sch[block].mod.mod, as under Slapo's checkpoint wrapper
        assert case["checkpointed_class"] == ("CheckPointWrapper", True)  # Slapo's name, still a GPT2Block
        # Slapo's names for what fuse and checkpoint(subgraph) insert (c_proj and dropout inside the latter)
        assert case["checkpointed_subgraph"] == ["BiasGeLU_0", "CheckPointWrapper_0"]
        assert case["optimizer_params"] == case["model_params"]  # the built (sharded) parameters


def test_all_to_all_switches_sequence_and_head_partitions(ranks):
    for res in ranks:
        assert res["all_to_all"] == {"forward": True, "backward": True, "round_trip": True}
        assert res["reshard"]


def test_ulysses_attention_matches_unscheduled(ranks):
    for res in ranks:
        case = res["ulysses"]
        assert case["ok"] and case["params"] == 4, case["report"]


def test_sharded_buffer_and_custom_initialiser(ranks):
    for res in ranks:
        case = res["buffers"]
        assert case["ok"] and case["params"] == 4, case["report"]
        assert case["fc_is_hand_value"] and case["scale_is_hand_value"] and case["scale_shape"] == (8,)


# ------------------------------------------------------------------ one process
class TinyMLP(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(16, 64), nn.Linear(64, 16), nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(x)))) + x


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward (counted by torch, not by slapo-tune)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return total[0]


def test_checkpointing_a_subgraph_recomputes_it_with_the_same_dropout_masks():
    torch.manual_seed(0)
    model = TinyMLP(p=0.3)
    reference = copy.deepcopy(model)
    sch = st.create_schedule(model).trace()
    pattern = lambda x: nn.Dropout(0.3)(F.gelu(nn.Linear(1, 1)(x)))  # noqa: E731
    name = sch.checkpoint(target=sch.find(pattern))
    model, x = sch.mod, torch.randn(32, 16)  # the traced module
    assert name == "checkpointed" and isinstance(model.get_submodule(name), nn.Module)
    # at least two [32, 64] fp32 activations of the subgraph (gelu in, dropout out) are not kept
    assert _saved_bytes(model, x) <= _saved_bytes(reference, x) - 2 * 32 * 64 * 4
    # dropout on (deterministic=False): the recomputation must replay the first masks
    report = st.verify(model, reference, (x,), loss_fn=lambda out: (out ** 2).sum(), deterministic=False)
    assert report.params_compared == 4 and report.max_grad_error < 1e-6
    assert sorted(model.state_dict()) == sorted(reference.state_dict())  # no new keys


def test_build_with_a_custom_initialiser():
    with torch.device("meta"):
        model = TinyMLP()
    real = nn.Linear(16, 64)
    model.fc1 = real
    before = real.weight.detach().clone()
    st.build(st.create_schedule(model), init_weights=lambda m: [nn.init.constant_(p, 0.5) for p in m.parameters(False)])
    assert torch.equal(model.fc1.weight, before)  # real tensors are never re-initialised
    assert torch.all(model.fc2.weight == 0.5) and torch.all(model.fc2.bias == 0.5)
    with slapo.init_empty_weights():  # Slapo's spelling: the module's path is passed to a two-argument initialiser
        meta = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    paths = []
    built, _ = slapo.build(slapo.create_schedule(meta), init_weights=lambda m, path: paths.append(path) or [
        nn.init.constant_(p, len(path)) for p in m.parameters(False)])
    assert paths == ["0", "1", ""] and torch.all(built[1].weight == 1.0)


def test_shard_names_parameters_and_buffers_it_could_shard():
    m = nn.BatchNorm1d(4)
    with pytest.raises(st.ShardingError, match="'running_mean'"):
        st.create_schedule(nn.Sequential(m))["0"].shard("nope", 0)


def test_all_to_all_and_gather_reduce_sync_arguments_are_checked():
    sch = st.create_schedule(nn.Sequential(nn.Identity()))
    with pytest.raises(st.SyncError, match="join_axis"):
        sch["0"].sync("fwd_post", "all_to_all", axis=1)
    with pytest.raises(st.SyncError, match="reduce_grad applies to all_gather only"):
        sch["0"].sync("fwd_post", "scatter", reduce_grad=True)
    with pytest.raises(st.SyncError, match="only all_reduce"):
        sch["0"].sync("bwd_post", "all_to_all", axis=1, join_axis=2)
    assert state_of(sch["0"].mod) is None  # refused: nothing recorded


def test_register_and_list_primitives():
    @st.register_primitive
    def scale_weight(sch, factor):
        """Multiply the weight by a factor."""
        with torch.no_grad():
            sch.mod.weight.mul_(factor)

    @st.register_primitive()
    class TagPrimitive:  # Slapo's form; through compat it receives the compat node
        @staticmethod
        def name():
            return "tag_kind"

        @staticmethod
        def apply(sch, value):
            sch.annotate("weight", "kind", (type(sch).__module__, value))

    try:
        assert st.list_primitives()[-2:] == ["scale_weight", "tag_kind"] and "shard" in st.list_primitives()
        assert slapo.list_primitives(name_only=False)["tag_kind"] is TagPrimitive.apply
        model = nn.Sequential(nn.Linear(2, 2))
        before = model[0].weight.detach().clone()
        sch = st.create_schedule(model)
        sch["0"].scale_weight(3.0)
        assert torch.allclose(model[0].weight, 3 * before)
        assert st.Schedule.scale_weight.__doc__ == "Multiply the weight by a factor."  # a real method
        slapo.create_schedule(model)["0"].tag_kind("x")
        assert sch["0"].get_annotation("weight", "kind") == ("slapo_tune.compat", "x")
        with pytest.raises(st.ScheduleError, match="built-in"):
            st.register_primitive(lambda s: None, name="shard")
    finally:
        st.unregister_primitive("scale_weight")
        st.unregister_primitive("tag_kind")
    assert not hasattr(st.Schedule, "tag_kind")


def test_op_attention_matches_attention_written_out():
    torch.manual_seed(0)
    attn = op.Attention(32, 4)
    x = torch.randn(2, 6, 32)
    q, k, v = attn.qkv(x).view(2, 6, 3, 4, 8).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32))
    assert torch.allclose(attn(x), expected, atol=1e-5)


def test_op_print_fused_mlp_and_linear_with_sync():
    sink = io.StringIO()

    class Printed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.print = nn.Linear(2, 2, bias=False), op.Print(file=sink)

        def forward(self, x):
            return self.print(self.fc(x), "sum:", x.sum())

    model = Printed()
    sch = st.create_schedule(model).trace()
    assert any(n.op == "call_module" and n.target == "print" for n in sch.mod.graph.nodes)
    sch.mod(torch.ones(1, 2))
    assert sink.getvalue() == "sum: tensor(2.)\n"  # the real value, not a tracing proxy

    mlp = op.FusedMLP(8, 32, "gelu_new")
    sch = st.create_schedule(mlp)
    sch["fc_in"].decompose()
    sch = sch.trace()
    assert len(sch.find(st.bias_then(mlp.act))) == 1

    layer = op.LinearWithSyncFunc(4, 3, sync_fn=lambda t: t * 0)
    assert torch.equal(layer(torch.randn(2, 4)), layer.bias.expand(2, 3))  # the sync comes before the bias


# ------------------------------------------------------------------ compat, one process
def test_compat_find_shapes_and_empty_result():
    sch = slapo.create_schedule(TinyMLP())
    found = sch.find(lambda x: F.gelu(x))
    assert len(found) == 1 and [n.name for _, n in found[0]] == ["gelu"] and found[0][0][0] == ""
    assert sch.find(lambda x: F.relu(x) * 3) == []
    assert [n.target for _, n in sch.find(r"fc")] == ["fc1", "fc2"]
    with pytest.raises(st.PatternError):
        sch.find(lambda x: (x, x))


class _FcThenGelu(slapo.Pattern):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x):
        return F.gelu(slapo.call_module(self.name, x))


def test_compat_pattern_class_with_a_module_named_by_a_regex():
    """Slapo's Pattern subclass calling call_module(regex): it matches the module the expression
    names (from the start of its path), and nothing when the expression names a module whose
    output is not what the pattern computes next."""
    sch = slapo.create_schedule(nn.Sequential(TinyMLP(), TinyMLP()))
    sch["0"].trace()
    found = sch["0"].find(_FcThenGelu(r"fc\d"))
    assert len(found) == 1 and [n.target for _, n in found[0]] == ["fc1", F.gelu]
    assert sch["0"].find(_FcThenGelu("fc2")) == []  # fc2's output is added to x, not GELU'd
    assert sch["0"].find(_FcThenGelu("drop")) == []
    with pytest.raises(NotImplementedError):
        slapo.Pattern()(torch.ones(1))
    with pytest.raises(RuntimeError, match="for patterns"):
        slapo.call_module("fc1", torch.ones(1))


def test_compat_primitive_forms():
    model = nn.Sequential(TinyMLP(), TinyMLP())
    sch = slapo.create_schedule(model)
    seen = []
    sch.replace_all(nn.Linear, lambda name, mod, width: seen.append(name) or nn.Linear(mod.in_features, width),
                    width=64)
    assert seen == ["0.fc1", "0.fc2", "1.fc1", "1.fc2"] and model[0].fc2.out_features == 64
    sch["1.fc1"].sync(mode="fwd_post", sync_op_or_fn="all_gather")
    spec = state_of(model[1].fc1).post_syncs[0]
    assert (spec.axis, spec.reduce_grad) == (0, True)  # Slapo's defaults
    calls = []
    sch["0.fc1"].sync(mode="fwd_post", sync_op_or_fn=lambda mod, inp, out: calls.append(out.shape) or out * 0)
    assert torch.equal(model[0].fc1(torch.ones(1, 16)), torch.zeros(1, 64)) and calls == [torch.Size([1, 64])]
    sch["0"].checkpoint()
    assert sch["0"].mod.mod is model[0] and "0.mod.fc1.weight" not in model.state_dict()
    built, optimizer = slapo.build(sch, init_weights=False)
    assert built is model and optimizer is None
    with pytest.raises(st.ScheduleError, match="topology"):
        slapo.build(sch, target="deepspeed")


def test_compat_fuse_compilers_and_verify_context(monkeypatch):
    sch = slapo.create_schedule(TinyMLP())
    with slapo.Verify(sch, example_inputs=[torch.randn(4, 16)]) as fused_ok:
        sch.fuse(sch.find(lambda x: F.gelu(x)), compiler=None, name="G")
    assert fused_ok.report.ok and fused_ok.report.params_compared == 4
    x = torch.randn(4, 16)
    expected = sch.mod(x)
    sch.fuse(sch.find(lambda x, y: nn.Linear(1, 1)(x) + y), compiler="TorchScript", name="T")
    assert isinstance(sch.mod.T_0, torch.jit.ScriptModule) and torch.equal(sch.mod(x), expected)
    compilers = []
    monkeypatch.setattr(_graph, "compile_fn", lambda fn, compiler: compilers.append(compiler) or fn)
    sch.fuse(sch.find(lambda x: F.dropout(x)), compiler="inductor", name="T")  # other names: torch.compile backends
    assert compilers == ["inductor"] and hasattr(sch.mod, "T_1") and torch.equal(sch.mod(x), expected)
    with pytest.raises(st.VerificationError, match="first divergent module: act"):
        net = nn.Sequential()
        net.add_module("lin", nn.Linear(4, 4))
        net.add_module("act", nn.GELU())
        wrong = slapo.create_schedule(net)
        with slapo.Verify(wrong, example_inputs=[torch.randn(2, 4)]):
            wrong["act"].replace(nn.ReLU())
