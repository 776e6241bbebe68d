"""Drop-in use of a tuned schedule: at pp=1 the scheduled model is called as the Hugging Face model
is and returns what it returns; a loop of one's own written for the Hugging Face model trains as
``slapo-tune train`` does; with pipeline stages the one-call step is named; a schedule meets another
model in one line naming both fingerprints."""

from __future__ import annotations

import pytest
import torch
from _drop_in_workers import called_like_the_model, hugging_face_loop, pipeline_rank_called_like_the_model

import slapo_tune as st
from slapo_tune.cli import main
from slapo_tune.launch import launch
from slapo_tune.models import config_fingerprint, load_config
from slapo_tune.train import TrainConfig, train_rank

from _helpers import schedule_file, token_batch

# Each on 2 ranks, each with something a call of the model must do that the plain model does not:
SCHEDULES = {
    # the LM head leaves each rank half the vocabulary (the loss computed from the halves); the norms'
    # gradients are partial sums over the tensor-parallel ranks (sequence parallelism); 2 micro-batches
    "tp2-sp-loss_parallel": dict(tp=2, sp="on", loss_parallel="on", micro_batch=4),
    # replicated data parallelism: gradients averaged over the ranks; 2 micro-batches per rank
    "dp2": dict(dp=2, micro_batch=2),
    # bf16 parameters: the optimizer must step the fp32 masters, then publish them into the model
    "tp2-bf16": dict(tp=2, micro_batch=4, precision="bf16"),
}


@pytest.mark.parametrize("name, no_sync", [(name, True) for name in SCHEDULES] + [("tp2-sp-loss_parallel", False)])
def test_a_hugging_face_loop_trains_as_slapo_tune_train(tmp_path, name, no_sync, no_leftover_children):
    """The loop calls the model with input_ids/labels, backward()s its loss and steps an AdamW of its
    own (``_drop_in_workers.hugging_face_loop``). Same schedule, seed and data as the training job.
    Accumulating under ``model.no_sync()`` as with DDP, the gradients are synchronised once a step,
    as the job does: the same losses bit for bit (the same kernels in the same order on CPU).
    Synchronised after every backward instead, the sums over ranks are taken per micro-batch: the
    same up to fp32 rounding (seen: 1 ulp, 4.8e-7, at step 4; allowed: 4 ulps of 6.2)."""
    schedule = str(schedule_file(tmp_path / "s.json", **SCHEDULES[name]))
    steps, lr = 4, 1e-3
    expected = launch(train_rank, 2, args=(TrainConfig(schedule=schedule, steps=steps, lr=lr),))[0]
    ours = launch(hugging_face_loop, 2, args=(schedule, steps, lr, no_sync))
    assert ours[0] == ours[1]
    if no_sync:
        assert ours[0] == expected, (ours[0], expected)
    else:
        assert ours[0] == pytest.approx(expected, rel=0, abs=2e-6)
    assert expected[-1] < expected[0]  # it learns


@pytest.mark.parametrize("preset, knobs, output", [
    ("gpt2-tiny", dict(tp=2, sp="on", loss_parallel="on"), "CausalLMOutputWithCrossAttentions"),
    ("llama-tiny", dict(tp=2, loss_parallel="on"), "CausalLMOutputWithPast"),
])
def test_the_scheduled_model_returns_what_the_model_returns(tmp_path, preset, knobs, output, no_leftover_children):
    """At pp=1, ``session.stage(input_ids=..., labels=..., attention_mask=...)`` returns the unscheduled
    model's output type, loss and whole-vocabulary logits (fp32 on CPU: tensor parallelism only
    reorders sums: seen 1e-6 on the loss); ``gather_logits=False`` gives this rank's vocabulary slice and
    ``return_dict=False`` a tuple, as the model does."""
    schedule = str(schedule_file(tmp_path / "s.json", preset, **knobs))
    batch = token_batch(load_config(preset).vocab_size, batch=2, seq=16)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][1, -3:] = 0  # right padding, not counted in the loss
    batch["labels"][1, -3:] = -100
    for got in launch(called_like_the_model, 2, args=(schedule, batch)):
        assert got["types"] == (output, output)
        assert got["losses"][0] == pytest.approx(got["losses"][1], abs=1e-5)
        assert got["shapes"][0] == got["shapes"][1] == (2, 16, load_config(preset).vocab_size)
        assert got["logits_error"] < 1e-5 and got["slice_error"] < 1e-5  # seen: 2.4e-7
        assert got["tuple"][0] == "tuple" and got["tuple"][1] == got["losses"][0]
        assert got["tuple"][2] == got["shapes"][1] and got["config"]
        assert got["freed"]  # without waiting for the garbage collector


def test_a_pipeline_stage_names_the_one_call_step(tmp_path, no_leftover_children):
    """With pipeline stages no rank holds the model: calling a stage like the model says to run
    ``session.train_step(batch)``, which trains in one call; a stage built without a training step
    says what it needs."""
    schedule = str(schedule_file(tmp_path / "s.json", pp=2, micro_batch=2))
    for refused, untrained, loss in launch(pipeline_rank_called_like_the_model, 2, args=(schedule,)):
        assert "pipeline stages (pp=2)" in refused and "session.train_step(batch)" in refused
        assert "needs its training step" in untrained
        assert 5 < loss < 7  # ln(512) = 6.24 at initialisation


def test_a_schedule_for_another_model_is_refused_in_one_line(tmp_path, capsys):
    """A GPT-2 schedule given a Llama model: one line naming both config fingerprints, a
    ModelMismatchError from the API (before any process group is needed), exit 2 from the CLI."""
    schedule = str(schedule_file(tmp_path / "s.json", tp=2))
    gpt2, llama = (config_fingerprint(load_config(name)) for name in ("gpt2-tiny", "llama-tiny"))
    with pytest.raises(st.ModelMismatchError) as refused:
        st.apply_schedule(st.build_model("llama-tiny"), schedule)
    message = str(refused.value)
    assert gpt2 in message and llama in message and "LlamaForCausalLM" in message and "\n" not in message
    with pytest.raises(st.ModelMismatchError, match=llama):
        st.load_schedule(schedule, model="llama-tiny")
    with pytest.raises(st.UsageError, match="needs torch.distributed initialised"):  # its own model passes
        st.apply_schedule(st.build_model("gpt2-tiny"), schedule)
    assert main(["train", "--schedule", schedule, "--model", "llama-tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert gpt2 in err and llama in err and len(err.splitlines()) == 1
