"""Slapo's ``trace`` call forms through ``slapo_tune.compat`` on Hugging Face modules of
transformers 5 (which ``torch.fx`` alone cannot trace), and Slapo's ``slapo.pipeline`` helpers.
Each traced module is checked against the untouched model's own output."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import fx, nn

import slapo_tune.compat as slapo
from slapo_tune.compat import pipeline
from slapo_tune.compat.framework_dialect.deepspeed.pipeline import analyze_tie_ranks
from slapo_tune.errors import TraceError

transformers = pytest.importorskip("transformers")


def slapo_concrete_args(module: nn.Module, inputs: list[str]) -> dict:
    """What Slapo's tests pass: every other parameter at its default (``**kwargs``: ``empty``)."""
    return {p.name: p.default for p in inspect.signature(module.forward).parameters.values() if p.name not in inputs}


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)
    return transformers.BertModel(config).eval()


def tiny_neo():
    torch.manual_seed(0)
    config = transformers.GPTNeoConfig(hidden_size=64, num_heads=4, num_layers=2, use_cache=False,
                                       attention_types=[[["global", "local"], 1]])
    return transformers.GPTNeoModel(config).eval()


def test_hf_bert_attention_traces_level_by_level_and_computes_the_same():
    model = tiny_bert()
    reference = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    attention = sch["encoder.layer.0.attention"]
    assert attention.trace(tracer="pytorch", concrete_args=slapo_concrete_args(attention.mod, ["hidden_states",
                                                                                               "attention_mask"]))
    for path in ("encoder.layer.0.attention", "encoder.layer.0.attention.self", "encoder.layer.0.attention.output"):
        assert isinstance(sch[path].mod, fx.GraphModule), path
    assert not isinstance(sch["encoder.layer.0.intermediate"].mod, fx.GraphModule)
    # the attention's graph calls its children; the child's graph does the arithmetic
    calls = {n.target for n in sch["encoder.layer.0.attention"].mod.graph.nodes if n.op == "call_module"}
    assert calls == {"self", "output"}
    # another batch and sequence length than the examples it was traced with: shapes stay symbolic
    ids = torch.randint(0, 100, (3, 9))
    torch.testing.assert_close(model(ids).last_hidden_state, reference(ids).last_hidden_state)


def test_flatten_keeps_only_the_traced_modules_children_as_schedules():
    sch = slapo.create_schedule(tiny_bert())
    attention = sch["encoder.layer.0.attention"]
    attention.trace(flatten=True, concrete_args=slapo_concrete_args(attention.mod, ["hidden_states"]))
    targets = {n.target for n in attention.mod.graph.nodes if n.op == "call_module"}
    assert {"self.query", "output.dense"} <= targets
    assert "encoder.layer.0.attention.self" in sch._root
    assert "encoder.layer.0.attention.self.query" not in sch._root
    assert isinstance(sch["encoder.layer.0.attention.self"].get_module("query"), nn.Linear)


def test_leaf_modules_by_type_name_stay_calls():
    sch = slapo.create_schedule(tiny_bert())
    layer = sch["encoder.layer.0"]
    layer.trace(flatten=True, concrete_args=slapo_concrete_args(layer.mod, ["hidden_states"]),
                leaf_modules=["BertSelfAttention", "BertSelfOutput"])
    targets = {n.target for n in layer.mod.graph.nodes if n.op == "call_module"}
    assert {"attention.self", "attention.output"} <= targets and "attention.self.query" not in targets


def test_gpt_neo_attention_on_meta_traces_from_shapes_and_matches_once_materialised():
    model = tiny_neo()
    with slapo.init_empty_weights():
        empty = transformers.GPTNeoModel(model.config).eval()
    sch = slapo.create_schedule(empty)
    attention = sch["h.0.attn.attention"]
    attention.trace(recursive=False, flatten=True, tracer="huggingface", config=model.config,
                    concrete_args=slapo_concrete_args(attention.mod, ["hidden_states"]))
    gm = attention.mod
    assert isinstance(gm, fx.GraphModule)
    original = model.h[0].attn.attention
    gm.load_state_dict({**original.state_dict(), "bias": original.bias}, assign=True)  # bias: non-persistent
    hidden = torch.randn(2, 5, 64)
    torch.testing.assert_close(gm(hidden)[0], original(hidden)[0])


def test_a_concrete_argument_is_checked_when_the_trace_runs():
    sch = slapo.create_schedule(tiny_neo())
    block = sch["h.0"]
    block.trace(concrete_args={"use_cache": False, "output_attentions": False, "layer_past": None})
    with pytest.raises(TraceError, match="traced with use_cache=False"):
        block.mod(torch.randn(1, 4, 64), use_cache=True)


def test_untraceable_child_stays_a_module_and_untraceable_top_raises():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # a data-dependent branch: no example decides it
                return self.linear(x)
            return x

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.branchy, self.post = Branchy(), nn.Sequential(nn.Linear(4, 4))

        def forward(self, x):
            return self.post(self.branchy(x))

    sch = slapo.create_schedule(Outer())
    sch.trace()
    assert isinstance(sch.mod, fx.GraphModule) and type(sch["branchy"].mod) is Branchy
    with pytest.raises(TraceError, match="cannot trace Branchy"):
        slapo.create_schedule(Branchy()).trace()


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return torch.relu(self.linear(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.layers, self.post = nn.Linear(6, 6), nn.ModuleList([Inner() for _ in range(4)]), nn.Linear(6, 3)

    def forward(self, x):
        x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return self.post(x)


def test_pipeline_partition_splits_into_stages_that_compose_to_the_model():
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch.trace_until("")
    sch["layers.0"].cut_pipeline_stage()
    sch["layers.2"].cut_pipeline_stage()
    sch = pipeline.generate_pipeline_partition(sch)
    stages = [name for name, _ in sch.mod.named_children()]
    assert stages == ["submod_0", "submod_1", "submod_2"]
    assert {n for n, _ in sch["submod_0"].mod.named_children()} == {"pre", "layers_0"}
    assert {n for n, _ in sch["submod_2"].mod.named_children()} == {"layers_3", "post"}
    x = torch.randn(5, 6)
    torch.testing.assert_close(sch.mod(x), reference(x))


def test_tied_weights_across_stages_and_their_rank_groups():
    model = nn.Sequential(nn.Embedding(8, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    model[2].weight = model[0].weight
    (group,) = pipeline.analyze_tie_weights(model, False).values()
    assert sorted(group) == [("0.weight", 0), ("2.weight", 0)]
    (group,) = pipeline.analyze_tie_weights(model, True).values()
    assert sorted(group) == [("weight", 0), ("weight", 2)]

    class Topology:  # pipeline stage s on ranks 2s and 2s + 1 (tensor parallelism 2)
        @staticmethod
        def filter_match(pipe):
            return [2 * pipe, 2 * pipe + 1]

    ranks, stages = analyze_tie_ranks([group], Topology())
    assert ranks == [[[0, 4], [1, 5]]] and stages == [[0, 2]]
