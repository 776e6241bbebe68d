"""The generic template on decoders with fused projections. Phi-3's Q|K|V, one linear sliced at
its config's offsets: tp > 1 is refused with the reason, by the space, by verify (exit 2) and by
the schedule itself. Gate|up cut with chunk(2) (Phi-3, GLM) is sharded part by part. GPT-NeoX's
fused QKV, viewed head by head, stays an ordinary column-parallel layer. (Phi-3's tp=1 points and
GLM's tp=2 points verify on 2 gloo ranks in test_templates_verify.)"""

import pytest
import transformers

import slapo_tune as st
from slapo_tune.cli import main
from slapo_tune.cost_model.analytic import probe_tp
from slapo_tune.models import build_model
from slapo_tune.parallelize import Colwise, apply_tensor_parallel
from slapo_tune.problem import ProblemSpec

from _helpers import TINY_DECODER, glm_config, phi3_config


def test_fused_projections_refuse_tp_in_space_verify_and_schedule(tmp_path, capsys, fake_group):
    path = phi3_config(tmp_path)
    problem = ProblemSpec(path, 2, global_batch=4, seq_len=16).resolve()
    assert problem.template.name == "generic"
    assert {p["tp"] for p in problem.space.enumerate()} == {1}
    assert probe_tp(problem.config, problem.template) == 0  # the cost model's probe does not shard it either
    assert main(["verify", "--model", path, "--world-size", "2", "--knobs", "tp=2", "--seq-len", "16"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "tp=2 is not legal for this model and world; legal values: 1 (" in err
    assert ("'model.layers.*.self_attn.qkv_proj' is a fused projection (128 output features for a width of 64) "
            "that the model slices at fixed offsets, which a shard would not shrink: tp=1 only") in err
    assert "gate_up_proj" not in err  # cut with chunk(2): sharded part by part
    # a schedule given tp=2 by hand refuses too, before anything is sharded
    model = build_model(path)
    sch = st.create_schedule(model)
    with pytest.raises(st.ScheduleError, match=r"'model.layers.0.self_attn.qkv_proj': .* is a fused projection"):
        apply_tensor_parallel(sch, problem.template.tensor_parallel_plan(model))
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (128, 64)


def test_head_interleaved_fused_qkv_stays_shardable(tmp_path):
    transformers.GPTNeoXConfig(intermediate_size=256, **{k: v for k, v in TINY_DECODER.items()
                                                          if k != "num_key_value_heads"}).save_pretrained(tmp_path)
    problem = ProblemSpec(str(tmp_path), 2, global_batch=4, seq_len=16).resolve()
    assert problem.info.tp_refusal == "" and {p["tp"] for p in problem.space.enumerate()} == {1, 2}


def test_projection_cut_into_equal_parts_is_sharded_part_by_part(tmp_path):
    problem = ProblemSpec(glm_config(tmp_path), 2, global_batch=4, seq_len=16).resolve()
    assert problem.template.name == "generic" and problem.info.tp_refusal == ""
    assert {p["tp"] for p in problem.space.enumerate()} == {1, 2}
    assert probe_tp(problem.config, problem.template) == 2
    plan = problem.template.tensor_parallel_plan(problem.model.build())
    assert plan["model.layers.*.mlp.gate_up_proj"] == Colwise(num_fused=2, reduce_input_grad=False)
    assert plan["model.layers.*.self_attn.q_proj"] == Colwise(reduce_input_grad=False)
