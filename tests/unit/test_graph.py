"""trace / find / replace / fuse / decompose, and the errors that name the module."""

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import slapo_tune as st

from _helpers import bias_then, token_batch


def _pair(preset):
    ref = st.build_model(preset, device="cpu")
    return ref, copy.deepcopy(ref)


def test_trace_keeps_path_parameters_and_numerics():
    ref, model = _pair("gpt2-tiny")
    sch = st.create_schedule(model)
    before = {n: p for n, p in model.named_parameters()}
    node = sch["transformer.h.1.mlp"].trace()
    assert isinstance(model.transformer.h[1].mlp, fx.GraphModule) and node.path == "transformer.h.1.mlp"
    assert sch["transformer.h.1.mlp.c_fc"].mod is model.transformer.h[1].mlp.c_fc
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    rep = st.verify(model, ref, token_batch(512))
    assert rep.max_grad_error == 0.0 and rep.loss_error == 0.0


def test_trace_failure_names_the_module_and_export_fallback_works():
    ref, model = _pair("gpt2-tiny")
    sch = st.create_schedule(model)
    with pytest.raises(st.TraceError, match=r"trace\('transformer.h.0'\): torch.fx cannot trace GPT2Block \(.*\); pass example inputs"):
        sch["transformer.h.0"].trace()
    assert type(model.transformer.h[0]).__name__ == "GPT2Block"  # unchanged
    ids = token_batch(512, batch=2, seq=16)
    sch["transformer.h.0"].trace(model_inputs={"input_ids": ids["input_ids"]})
    assert isinstance(model.transformer.h[0], fx.GraphModule)
    rep = st.verify(model, ref, ids)
    assert rep.ok
    with pytest.raises(st.TraceError, match="already traced"):
        sch["transformer.h.0"].trace()


def test_gpt2_bias_gelu_vertical_fusion_verifies():
    ref, model = _pair("gpt2-tiny")
    sch = st.create_schedule(model)
    for i in range(4):
        mlp = sch[f"transformer.h.{i}.mlp"]
        act = mlp.mod.act
        mlp["c_fc"].decompose()
        mlp = mlp.trace()
        (match,) = mlp.find(bias_then(act))
        assert [n.name for n in match.inputs] == ["matmul", "c_fc_bias"]
        name = mlp.fuse(match, compiler="eager" if i % 2 else "aot_eager")
        targets = [n.target for n in mlp.mod.graph.nodes if n.op == "call_function"]
        assert torch.tanh not in targets and name in {n.target for n in mlp.mod.graph.nodes}
    rep = st.verify(model, ref, token_batch(512))
    assert rep.ok and rep.params_compared == len(list(ref.parameters()))


def test_llama_qkv_horizontal_fusion_verifies_with_fused_gradients():
    ref, model = _pair("llama-tiny")
    sch = st.create_schedule(model)
    for i in range(4):
        attn = sch[f"model.layers.{i}.self_attn"]
        fused = attn.replace(st.fuse_linears, target=attn.find(r"[qkv]_proj"), name="qkv_proj")
        assert fused.mod.split_sizes == [64, 32, 32]  # 8 query heads, 4 key/value heads, head_dim 8
    assert not any(n.endswith("q_proj.weight") for n, _ in model.named_parameters())
    rep = st.verify(model, ref, token_batch(512))
    assert rep.ok
    assert rep.params_compared == len(list(model.parameters()))  # fused ones compared to the concatenation


def test_replace_match_with_a_function_and_arity_errors():
    ref, model = _pair("gpt2-tiny")
    sch = st.create_schedule(model)
    mlp = sch["transformer.h.0.mlp"]
    act = mlp.mod.act
    mlp["c_fc"].decompose()
    mlp = mlp.trace()
    (match,) = mlp.find(bias_then(act))
    with pytest.raises(st.PatternError, match="must take the 2 input"):
        mlp.replace(lambda x: x, target=match)
    mlp.replace(lambda x, b: F.gelu(x + b, approximate="tanh"), target=match, name="gelu_bias")
    assert "gelu_bias" in dict(mlp.mod.named_children())
    with pytest.raises(st.PatternError, match="stale"):
        mlp.replace(lambda x, b: x, target=match)


def test_patterns_and_decompose_errors():
    _, model = _pair("gpt2-tiny")
    sch = st.create_schedule(model)
    mlp = sch["transformer.h.0.mlp"].trace()
    with pytest.raises(st.PatternError, match=r"find\('transformer.h.0.mlp'\): <lambda> matches nothing"):
        mlp.find(lambda x: torch.sigmoid(x) * 3)
    with pytest.raises(st.TraceError, match="is not traced; call trace"):
        sch["transformer.h.1.mlp"].find(lambda x: x + 1)
    with pytest.raises(st.ScheduleError, match="only Linear and Conv1D layers decompose"):
        sch["transformer.h.1.ln_1"].decompose()
    sch["transformer.h.1.mlp.c_fc"].decompose()
    with pytest.raises(st.ScheduleError, match="already decomposed"):
        sch["transformer.h.1.mlp.c_fc"].decompose()
    with pytest.raises(st.PatternError, match="two or more sibling modules"):
        sch.replace(st.fuse_linears, target=[sch["transformer.h.1.mlp.c_fc"]])


def test_decompose_refuses_a_row_parallel_layer(fake_group):
    sch = st.create_schedule(st.build_model("gpt2-tiny"))
    sch["transformer.h.0.mlp.c_proj"].shard("weight", 0)
    with pytest.raises(st.ScheduleError, match="its output is partial"):
        sch["transformer.h.0.mlp.c_proj"].decompose()


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.other = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_cut_errors_name_the_module():
    sch = st.create_schedule(_Blocks())
    with pytest.raises(st.PipelineError, match="cannot cut at the root"):
        sch.cut_pipeline_stage()
    with pytest.raises(st.PipelineError, match=r"cut_pipeline_stage\('embed'\): stages end after a block of a repeated block list"):
        sch["embed"].cut_pipeline_stage()
    with pytest.raises(st.PipelineError, match=r"cut_pipeline_stage\('layers.2'\): a cut after the last block leaves the last stage with no blocks"):
        sch["layers.2"].cut_pipeline_stage()
    sch["layers.0"].cut_pipeline_stage()
    with pytest.raises(st.PipelineError, match=r"cut_pipeline_stage\('layers.0'\): already cut here"):
        sch["layers.0"].cut_pipeline_stage()
    with pytest.raises(st.PipelineError, match=r"all cuts must be in one block list, but 'layers.0' is already cut"):
        sch["other.0"].cut_pipeline_stage()


def test_build_refuses_a_stage_count_that_is_not_pp():
    import torch.distributed as dist

    from slapo_tune.topology import init_topology

    sch = st.create_schedule(st.build_model("gpt2-tiny"))
    sch["transformer.h.1"].cut_pipeline_stage()
    with pytest.raises(st.PipelineError, match=r"2 pipeline stages; pass topology=init_topology\(pp=2"):
        st.build(sch)
    try:
        topo = init_topology(pp=1)
        with pytest.raises(st.PipelineError, match=r"2 stage\(s\) \(cuts after: 'transformer.h.1'\) but pp=1"):
            st.build(sch, topology=topo)
    finally:
        dist.destroy_process_group()
    assert all(p.device.type == "meta" for p in sch.mod.parameters())
