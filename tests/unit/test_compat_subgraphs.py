"""Slapo's find / replace / fuse / checkpoint through ``slapo_tune.compat``: what is matched (by
operation and dataflow, as Slapo matched), the names of what is inserted, where hooks go, and that
every rewritten model still computes what plain torch computes."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo_tune as st
import slapo_tune.compat as slapo


class Residual(nn.Module):
    """``relu(linear(x)) + x``: the residual reads x, the ReLU reads the linear layer's output."""

    def __init__(self):
        super().__init__()
        self.linear, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        return self.act(self.linear(x)) + x


def _residual_by_hand(model: Residual, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ model.linear.weight.T + model.linear.bias) + x


def test_each_use_of_a_pattern_argument_matches_its_own_value_and_the_replacement_takes_both():
    model = Residual()
    x = torch.randn(3, 8)
    sch = slapo.create_schedule(model)
    (subgraph,) = sch.find(lambda x: F.relu(x) + x)  # Slapo's test_exact_match / test_mismatched_arguments
    assert [n.target for _, n in subgraph] == ["act", operator.add]
    with pytest.raises(st.PatternError, match="2 input"):  # the inputs: linear's output, then x
        sch.replace(lambda a: torch.relu(a) + a, [subgraph])
    sch.replace(lambda a, b: torch.clamp(a, min=0) + b, [subgraph])
    torch.testing.assert_close(sch.mod(x), _residual_by_hand(model, x), rtol=0, atol=0)
    # slapo-tune's own find reads the pattern exactly: one x, so relu(linear(x)) + x is not relu(x) + x
    with pytest.raises(st.PatternError, match="matches nothing"):
        st.create_schedule(Residual()).trace().find(lambda x: F.relu(x) + x)


def test_concrete_args_bind_the_arguments_the_subgraph_does_not_give():
    model = Residual()
    x = torch.randn(3, 8)
    sch = slapo.create_schedule(model)
    subgraphs = sch.find(lambda x: F.relu(x) + x)

    class Three(nn.Module):
        def forward(self, a, b, scale):
            return torch.relu(a) * scale + b

    with pytest.raises(st.PatternError, match="concrete_args"):
        sch.replace(Three(), subgraphs)
    assert not hasattr(sch.mod, "Three_0")  # a refused replacement leaves nothing behind
    sch.replace(Three(), subgraphs, concrete_args={"scale": 1.0})
    assert isinstance(sch["Three_0"].mod, Three)
    torch.testing.assert_close(sch.mod(x), _residual_by_hand(model, x), rtol=0, atol=0)


class DropoutNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout, self.ln = nn.Linear(16, 16), nn.Dropout(0.2), nn.LayerNorm(16)

    def forward(self, x, residual):
        return self.ln(self.dropout(self.linear(x)) + residual)


@pytest.mark.parametrize("compiler", ["TorchScript", None])
def test_constants_of_a_pattern_match_any_value_and_the_fused_copy_runs_the_models_own(compiler):
    """``F.dropout(x + b)`` (p=0.5 by default) and ``F.layer_norm(.., 16)`` (no weights) find the
    model's Dropout(0.2) and LayerNorm with weights; the fused copy runs the model's p and weights."""
    reference = DropoutNorm()
    sch = slapo.create_schedule(copy.deepcopy(reference))
    sch["linear"].decompose()
    sch.trace(flatten=True)
    (subgraph,) = sch.find(lambda x, bias, residual: F.layer_norm(F.dropout(x + bias) + residual, 16))
    assert [n.target for _, n in subgraph] == [operator.add, "dropout", operator.add, "ln"]
    keys = list(sch.mod.state_dict())
    sch.fuse([subgraph], compiler=compiler, name="FusedLN")
    fused = sch.mod.FusedLN_0
    if compiler == "TorchScript":
        assert isinstance(fused, torch.jit.ScriptModule)
    else:
        assert type(fused).__name__ == "FusedLN" and getattr(fused, "0") is sch.mod.dropout
        assert getattr(fused, "1") is sch.mod.ln
        assert list(sch.mod.state_dict()) == keys  # the modules it calls keep their one path
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    torch.manual_seed(3)
    out = sch.mod(x, residual)
    torch.manual_seed(3)
    torch.testing.assert_close(out, reference(x, residual), rtol=0, atol=1e-6)
    # slapo-tune's own find reads the constants: another p, and a norm without weights, are not these
    with pytest.raises(st.PatternError, match="matches nothing"):
        st.create_schedule(copy.deepcopy(reference)).trace().find(lambda x, r: F.layer_norm(F.dropout(x) + r, (16,)))


class Diamond(nn.Module):
    def forward(self, x, y):
        a = x + y
        useless = a * 5
        return useless + (a * 2 + a * 3)


def test_a_match_whose_intermediate_is_read_outside_is_found_but_not_replaced():
    sch = slapo.create_schedule(Diamond())

    def pattern(m, n):
        a = m + n
        return a * 2 + a * 3

    (subgraph,) = sch.find(pattern)  # Slapo's test_diamond
    assert [n.name for _, n in subgraph] == ["add", "mul_1", "mul_2", "add_1"]
    graph_before = str(sch.mod.graph)
    for rewrite in (lambda: sch.replace(lambda m, n: (m + n) * 5, [subgraph]),
                    lambda: sch.fuse([subgraph], compiler=None),
                    lambda: sch.checkpoint([subgraph])):
        with pytest.raises(st.PatternError, match=r"add inside the match is also used outside it \(by mul\)"):
            rewrite()
    assert str(sch.mod.graph) == graph_before  # refused before anything changed
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(sch.mod(x, y), (x + y) * 10)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(F.relu(self.fc1(x)) * F.relu(self.fc2(x)))


def test_module_pattern_and_call_module_name_modules_by_a_regex():
    from slapo_tune.compat.pattern import ModulePattern, Pattern, call_module

    class LinearReLU(Pattern):
        def __init__(self):
            super().__init__()
            self.fc = ModulePattern(r"fc\d")

        def forward(self, x):
            return F.relu(self.fc(x))

    sch = slapo.create_schedule(TwoHeads())
    found = sch.find(LinearReLU())
    assert [[n.target for _, n in s] for s in found] == [["fc1", F.relu], ["fc2", F.relu]]
    assert [[n.target for _, n in s] for s in sch.find(lambda x: F.relu(call_module("fc2", x)))] == [["fc2", F.relu]]
    assert sch.find(lambda x: F.relu(call_module("out", x))) == []


def test_several_subgraphs_become_one_call_whose_results_replace_each():
    reference = TwoHeads()
    model = copy.deepcopy(reference)
    sch = slapo.create_schedule(model)
    subgraphs = sch.find(lambda x: F.relu(slapo.call_module(r"fc[12]", x)))

    class BothHeads(nn.Module):
        def __init__(self, fc1, fc2):
            super().__init__()
            self.weight = nn.Parameter(torch.cat([fc1.weight, fc2.weight]).detach())
            self.bias = nn.Parameter(torch.cat([fc1.bias, fc2.bias]).detach())

        def forward(self, x):
            return F.relu(F.linear(x, self.weight, self.bias)).chunk(2, dim=-1)

    sch.replace(BothHeads(model.fc1, model.fc2), subgraphs, name="heads")
    calls = [n for n in sch.mod.graph.nodes if n.op == "call_module" and n.target == "heads_0"]
    reads = [n.args[1] for n in sch.mod.graph.nodes if n.target is operator.getitem and n.args[0] in calls]
    assert len(calls) == 1 and reads == [0, 1]
    x = torch.randn(5, 4)
    torch.testing.assert_close(sch.mod(x), reference(x), rtol=1e-6, atol=1e-6)


def test_subgraphs_reading_different_inputs_are_not_fused_horizontally():
    class Apart(nn.Module):
        def forward(self, x, y):
            return F.relu(x + 1) * F.relu(y + 1)

    sch = slapo.create_schedule(Apart())
    subgraphs = sch.find(lambda x: F.relu(x + 1))
    assert len(subgraphs) == 2
    with pytest.raises(st.PatternError, match="same inputs"):
        sch.replace(lambda x: (x, x), subgraphs)


def test_hooks_move_to_the_replacement_where_they_keep_their_meaning():
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(self.linear(x)).relu()

    def pattern(x):
        return slapo.call_module("bn", slapo.call_module("linear", x))

    calls = []
    model = Chain()
    model.linear.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    model.linear.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append("backward"))
    sch = slapo.create_schedule(model)
    sch.replace(nn.Identity(), sch.find(pattern))  # Slapo's test_vertical_replacement
    assert isinstance(sch["Identity_0"].mod, nn.Identity)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert calls == ["pre", "backward"]  # they ran, on the replacement

    model = Chain()
    model.linear.register_forward_hook(lambda m, args, out: out)  # reads linear's output, not the result
    sch = slapo.create_schedule(model)
    with pytest.raises(st.ScheduleError, match="linear has a fwd_post hook"):
        sch.replace(nn.Identity(), sch.find(pattern))
    with pytest.raises(st.ScheduleError, match="a function has no hooks"):
        sch.replace(lambda x: x, sch.find(pattern))
    assert not hasattr(sch.mod, "Identity_0")


def test_a_replacing_function_is_called_directly_where_its_inputs_are_ready():
    class Sums(nn.Module):
        def forward(self, a, b, c):
            return (a + b) + c * 2

    sch = slapo.create_schedule(Sums())

    def new_func(a, b, y):
        return a * b * y

    sch.replace(new_func, sch.find(lambda a, b, y: (a + b) + y))  # Slapo's test_insertion_point
    assert [n.name for n in sch.mod.graph.nodes] == ["a", "b", "c", "mul", "new_func", "output"]
    a, b, c = torch.randn(3), torch.randn(3), torch.randn(3)
    torch.testing.assert_close(sch.mod(a, b, c), a * b * (c * 2), rtol=0, atol=0)


def test_checkpoint_names_and_recomputation():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            # a block of its own, so that recomputing it calls the Linear inside again (a hook on
            # the checkpointed module itself runs once: outside the checkpoint); its Tanh keeps its
            # output for backward, which the recomputation makes again
            self.layer1, self.layer2 = nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 6)

        def forward(self, x):  # Slapo's test_checkpoint_function model (find traces one level: Slapo's default)
            return self.layer2(F.relu(self.layer1(x)))

    reference = Two()
    x = torch.randn(4, 6)
    reference(x).square().sum().backward()
    for whole in (False, True):
        model = copy.deepcopy(reference)
        model.zero_grad()
        keys = list(model.state_dict())
        sch = slapo.create_schedule(model)
        inner = model.layer1[0]
        if whole:  # Slapo's test_checkpoint_module
            sch["layer1"].checkpoint()
            assert type(sch["layer1"].mod).__name__ == "CheckPointWrapper"
            assert isinstance(model.layer1, nn.Sequential) and sch["layer1"].mod.mod is model.layer1
        else:  # Slapo's test_checkpoint_function
            sch.checkpoint(sch.find(lambda x: F.relu(slapo.call_module("layer1", x))))
            assert sch["CheckPointWrapper_0"].mod.mod.get_submodule("layer1.0") is inner
        forwards = []
        inner.register_forward_hook(lambda m, args, out, seen=forwards: seen.append(1))
        sch.mod(x).square().sum().backward()
        assert len(forwards) == 2  # recomputed in backward
        assert list(sch.mod.state_dict()) == keys
        for name, param in sch.mod.named_parameters():
            torch.testing.assert_close(param.grad, reference.get_parameter(name).grad, rtol=0, atol=0)


def test_verify_compares_a_model_with_a_torchscript_module():
    model = Residual()
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, [torch.randn(3, 8)]) as check:
        sch.fuse(sch.find(lambda x: F.relu(x) + x), compiler="TorchScript", name="T")
    assert isinstance(sch.mod.T_0, torch.jit.ScriptModule) and check.report.ok
