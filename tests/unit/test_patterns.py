"""Pattern matching in one normal form: module calls and functional spellings match each other,
and any pattern either matches or raises PatternError (never a raw matcher assertion)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo_tune as st
from slapo_tune.schedule._patterns import call_module

from _helpers import bias_then, token_batch


class _ModuleBlock(nn.Module):
    """A block written with modules: linear, GELU, dropout, residual, LayerNorm, then ReLU / SiLU."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU(approximate=approximate)
        self.drop = nn.Dropout(0.25)
        self.norm = nn.LayerNorm(8, eps=1e-6)
        self.relu = nn.ReLU(inplace=True)
        self.silu = nn.SiLU()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.norm(self.drop(self.act(self.fc(x))) + x)
        return self.silu(self.relu(self.bn(h) + 1.0))


class _FunctionalBlock(_ModuleBlock):
    """The same computation, written with functionals over the same parameters."""

    def forward(self, x):
        h = F.gelu(F.linear(x, self.fc.weight) + self.fc.bias, approximate="tanh")
        h = F.layer_norm(F.dropout(h, 0.25, training=True) + x, [8], self.norm.weight, self.norm.bias, 1e-6)
        return F.silu(torch.relu(self.bn(h) + 1.0))


def _traced(cls):
    model = cls()
    sch = st.create_schedule(model)
    sch["fc"].decompose()
    return sch.trace()


def _matched(sch, pattern) -> list[list[str]]:
    return [[n.target if n.op == "call_module" else n.target.__name__ for n in m.nodes] for m in sch.find(pattern)]


class _HeldBias(nn.Module):
    """A module pattern holding its own parameter: it stands for whatever tensor the model adds."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(8))
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.act(x + self.bias)


_GELU_BIAS = [bias_then(nn.GELU(approximate="tanh")), lambda x, b: F.gelu(x + b, approximate="tanh"),
              _HeldBias()]
_DROPOUT_NORM = [
    lambda x, r: nn.LayerNorm(8, eps=1e-6)(nn.Dropout(0.25)(x) + r),
    lambda x, r, w, b: F.layer_norm(F.dropout(x, p=0.25) + r, (8,), w, b, eps=1e-6),
]
_ACTIVATIONS = [lambda x: nn.SiLU()(nn.ReLU()(x)), lambda x: F.silu(F.relu(x, inplace=True))]


@pytest.mark.parametrize("cls", [_ModuleBlock, _FunctionalBlock])
@pytest.mark.parametrize("pattern", _GELU_BIAS + _DROPOUT_NORM + _ACTIVATIONS)
def test_module_and_functional_spellings_match_each_other(cls, pattern):
    sch = _traced(cls)
    (match,) = sch.find(pattern)
    names = {n.name for n in match.nodes}
    if pattern in _GELU_BIAS:
        assert names == ({"add", "act"} if cls is _ModuleBlock else {"add", "gelu"})
    elif pattern in _DROPOUT_NORM:
        assert names == ({"drop", "add_1", "norm"} if cls is _ModuleBlock else {"dropout", "add_1", "layer_norm"})
    else:
        assert names == ({"relu", "silu"} if cls is _ModuleBlock else {"relu", "silu"})
    assert match.output.name == max(match.nodes, key=list(sch.mod.graph.nodes).index).name


@pytest.mark.parametrize("pattern, why", [
    (bias_then(nn.GELU()), "exact GELU is not the model's tanh GELU"),
    (lambda x, b: F.gelu(x + b), "exact GELU is not the model's tanh GELU"),
    (lambda x, r: nn.LayerNorm(8)(nn.Dropout(0.25)(x) + r), "another eps"),
    (lambda x, r: nn.LayerNorm(8, eps=1e-6)(nn.Dropout(0.5)(x) + r), "another dropout probability"),
    (lambda x, r: F.layer_norm(F.dropout(x, 0.25) + r, (8,), eps=1e-6), "a norm without weights"),
    (lambda x: nn.ReLU()(x) + 1, "nothing adds 1 after a ReLU"),
    (lambda x: nn.BatchNorm2d(3)(x), "another module type"),
    (lambda x: nn.Linear(8, 8)(x), "the decomposed linear has no bias inside"),
    (lambda x: (x + 1, x * 2), "two results"),
    (lambda x: x, "computes nothing"),
    (lambda x: x + 1 if x.sum() > 0 else x, "does not trace"),
])
@pytest.mark.parametrize("cls", [_ModuleBlock, _FunctionalBlock])
def test_any_pattern_matches_or_raises_pattern_error(cls, pattern, why):
    sch = _traced(cls)
    with pytest.raises(st.PatternError, match=r"find\(''\): .*(matches nothing|one tensor|computes nothing|cannot trace)"):
        sch.find(pattern)


def test_module_type_patterns_match_by_type_and_linear_by_form():
    sch = _traced(_ModuleBlock)
    assert _matched(sch, lambda x: nn.BatchNorm1d(3)(x) + 1.0) == [["bn", "add"]]
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    sch = st.create_schedule(model).trace()
    (match,) = sch.find(lambda x, w, b: F.relu(F.linear(x, w, b)))
    assert [n.target for n in match.nodes] == ["0", "1"]
    assert [n.target for n in match.inputs[1:]] == ["0.weight", "0.bias"]  # the module's own parameters
    sch.replace(lambda x, w, b: torch.clamp(x @ w.T + b, min=0), target=match)
    assert not any(n.op == "call_module" and n.target in ("0", "1") for n in sch.mod.graph.nodes)
    x = torch.randn(3, 8)
    torch.testing.assert_close(sch.mod(x), torch.relu(F.linear(x, model[0].weight, model[0].bias)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls", [_ModuleBlock, _FunctionalBlock])
def test_fusing_a_match_across_forms_computes_what_the_model_computed(cls):
    reference = cls()
    sch = st.create_schedule(copy.deepcopy(reference))
    sch["fc"].decompose()
    sch = sch.trace()
    for patterns in (_GELU_BIAS, _DROPOUT_NORM):
        (match,) = sch.find(patterns[0] if cls is _FunctionalBlock else patterns[1])  # the other spelling
        sch.fuse(match, compiler="eager")
    assert not any(n.op == "call_module" and n.target in ("act", "drop", "norm") for n in sch.mod.graph.nodes)
    x = torch.randn(4, 8, requires_grad=True)
    out = {}
    for name, model in (("fused", sch.mod), ("reference", reference)):
        torch.manual_seed(7)  # the same dropout mask
        y = model(x)
        (grad,) = torch.autograd.grad(y.square().sum(), x)
        out[name] = (y, grad)
    assert torch.equal(out["fused"][0], out["reference"][0]) and torch.equal(out["fused"][1], out["reference"][1])


def test_gpt2_bias_gelu_found_with_gelu_module_or_functional_and_verified():
    reference = st.build_model("gpt2-tiny", device="cpu")
    model = copy.deepcopy(reference)
    sch = st.create_schedule(model)
    for i, pattern in enumerate(_GELU_BIAS):  # one spelling per block
        mlp = sch[f"transformer.h.{i}.mlp"]
        mlp["c_fc"].decompose()
        mlp = mlp.trace()
        with pytest.raises(st.PatternError):  # gelu_new is the tanh approximation, not exact GELU
            mlp.find(bias_then(nn.GELU()))
        (match,) = mlp.find(pattern)
        assert [n.target for n in match.nodes if n.op == "call_module"] == ["act"]
        mlp.fuse(match, compiler="eager")
        assert not any(n.op == "call_module" and n.target == "act" for n in mlp.mod.graph.nodes)
    assert st.verify(model, reference, token_batch(512)).max_grad_error == 0.0


def test_bert_bias_dropout_layernorm_fusion_with_module_pattern_verifies():
    reference = st.build_model("bert-tiny", device="cpu", hidden_dropout_prob=0.1)
    model = copy.deepcopy(reference)
    sch = st.create_schedule(model)
    out = sch["bert.encoder.layer.0.attention.output"]
    out["dense"].decompose()
    out = out.trace()
    (match,) = out.find(lambda x, b, r: nn.LayerNorm(64, eps=1e-12)(nn.Dropout(0.1)(x + b) + r))
    assert [n.target for n in match.nodes if n.op == "call_module"] == ["dropout", "LayerNorm"]
    out.fuse(match, compiler="eager")
    report = st.verify(model, reference, token_batch(512))
    assert report.ok and report.max_grad_error == 0.0


def test_a_module_the_schedule_changed_matches_nothing(fake_group):
    sch = st.create_schedule(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    sch["2"].shard("weight", 1)  # row parallel: its call now sums over ranks, not a plain linear
    sch["2"].sync("fwd_post", "all_reduce")
    sch = sch.trace()
    (match,) = sch.find(lambda x: F.relu(nn.Linear(8, 8)(x)))
    assert [n.target for n in match.nodes] == ["0", "1"]
    with pytest.raises(st.PatternError, match="matches nothing"):
        sch.find(lambda x: nn.Linear(8, 8)(F.relu(x)))


def test_a_call_module_regex_names_only_its_own_node():
    """``call_module("layer1", x)`` stands for a module whose path starts with "layer1"; a ReLU
    whose path also does ("layer1.1") is still the ``F.relu`` that follows it in the pattern."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))
    sch = st.create_schedule(model).trace()
    (match,) = sch.find(lambda x: F.relu(call_module("0", x)))
    assert [n.target for n in match.nodes] == ["0.0", "0.1"]
    x = torch.randn(2, 4)
    expected = model(x)
    sch.replace(lambda x: torch.clamp(model[0][0](x), min=0), target=match)
    torch.testing.assert_close(sch.mod(x), expected, rtol=0, atol=0)
