"""The generic template on a decoder with fused projections (Phi-3: Q|K|V in one linear sliced at
the config's offsets, gate|up in one linear cut with chunk): tp > 1 is refused with the reason, by
the space, by verify (exit 2) and by the schedule itself (its tp=1 points verify on 2 ranks in
test_templates_verify); GPT-NeoX's fused QKV, viewed head by head, stays shardable."""

import pytest
import transformers

import slapo_tune as st
from slapo_tune.cli import main
from slapo_tune.models import build_model
from slapo_tune.parallelize import apply_tensor_parallel
from slapo_tune.problem import ProblemSpec

from _helpers import TINY_DECODER, phi3_config


def test_fused_projections_refuse_tp_in_space_verify_and_schedule(tmp_path, capsys, fake_group):
    path = phi3_config(tmp_path)
    problem = ProblemSpec(path, 2, global_batch=4, seq_len=16).resolve()
    assert problem.template.name == "generic"
    assert {p["tp"] for p in problem.space.enumerate()} == {1}
    assert main(["verify", "--model", path, "--world-size", "2", "--knobs", "tp=2", "--seq-len", "16"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "tp=2 is not legal for this model and world; legal values: 1 (" in err
    for layer, how in (("self_attn.qkv_proj", "128 output features for a width of 64; the model slices it"),
                       ("mlp.gate_up_proj", "256 output features for a width of 128; the model cuts it with chunk()")):
        assert f"'model.layers.*.{layer}' is a fused projection ({how}" in err
    # a schedule given tp=2 by hand refuses too, before anything is sharded
    model = build_model(path)
    sch = st.create_schedule(model)
    with pytest.raises(st.ScheduleError, match=r"'model.layers.0.self_attn.qkv_proj': .* is a fused projection"):
        apply_tensor_parallel(sch, problem.template.plan(model))
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (128, 64)


def test_head_interleaved_fused_qkv_stays_shardable(tmp_path):
    transformers.GPTNeoXConfig(intermediate_size=256, **{k: v for k, v in TINY_DECODER.items()
                                                          if k != "num_key_value_heads"}).save_pretrained(tmp_path)
    problem = ProblemSpec(str(tmp_path), 2, global_batch=4, seq_len=16).resolve()
    assert problem.info.tp_refusal == "" and {p["tp"] for p in problem.space.enumerate()} == {1, 2}
