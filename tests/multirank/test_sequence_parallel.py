"""Sequence parallelism (``sp=on``; Megatron's, Korthikanti et al. 2022): inside the blocks the
residual stream is cut along the sequence over the tensor-parallel group.

One launch of four ranks (tp=2 beside dp=2) verifies sp points of every template against the
unscheduled model (fp32 and bf16, replicated and FSDP, fused and checkpointed), and measures the
peak of real steps with sp off and on; the saving is checked against what the sharded activations
weigh by the model's sizes, and exact mode against the measured peaks.
"""

from __future__ import annotations

import pytest
import torch

import slapo_tune as st
from slapo_tune.cost_model import CostModel, hardware
from slapo_tune.errors import ScheduleError
from slapo_tune.launch import launch
from slapo_tune.parallelize import (
    apply_sequence_parallel,
    apply_tensor_parallel,
    gather_sequence,
    sequence_partial_parameters,
    sequence_shards,
)
from slapo_tune.problem import ProblemSpec
from slapo_tune.schedule._schedule import state_of
from slapo_tune.space import format_point

from _helpers import blocks, family_module, saved_config, uncompared

WORLD, GLOBAL_BATCH, SEQ = 4, 8, 16

# (model, template, precision, knobs as `slapo-tune verify --knobs` takes them); dp=2 beside tp=2
# unless pipelined
VERIFY = [
    ("gpt2-tiny", None, "fp32", "tp=2,sp=on"),
    ("gpt2-tiny", None, "fp32", "tp=2,sp=on,fuse=on,attn=eager,ckpt_ratio=0.5,zero=2,micro_batch=2"),
    ("llama-tiny", None, "fp32", "tp=2,sp=on"),
    ("llama-tiny", None, "bf16", "tp=2,sp=on,fuse=on,micro_batch=2"),  # fp32 master gradients
    ("qwen2", "generic", "fp32", "tp=2,sp=on"),  # llama's template claims qwen2: the generic one forced
    ("qwen2", "generic", "fp32", "tp=2,sp=on,attn=eager,ckpt_ratio=1.0,zero=3"),  # FSDP's DTensor gradients
    # llama's template: the fused, biased QKV projection overlaps its backward collectives under FSDP
    ("qwen2", "llama", "fp32", "tp=2,sp=on,fuse=on,ckpt_ratio=0.5,zero=3"),
    ("opt-tiny", None, "fp32", "tp=2,sp=on"),  # flattens [b*s, h] before its MLP
    ("bert-tiny", None, "fp32", "tp=2,sp=on"),
    # pipelines (dp=1): the hidden state crossing stages is the shard; later stages number s positions
    ("llama-tiny", None, "fp32", "tp=2,sp=on,pp=2,pipeline_schedule=gpipe,ckpt_ratio=0.5"),
    ("gpt2-tiny", None, "fp32", "tp=2,sp=on,pp=2,pipeline_schedule=1f1b,vpp=2,micro_batch=1"),
]

# GPT-2 (hidden 64, 4 layers) with residual dropout on, at 64 tokens: 4 sequences per rank in one
# micro-batch, so that the blocks' activations are a good part of the peak
MEMORY_SEQ, MEMORY_MICRO_BATCH = 64, 4


def _qwen2_config(folder) -> str:
    """A Qwen2-style decoder (grouped-query attention, biased Q/K/V projections)."""
    return saved_config(folder, "Qwen2Config", num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=512, max_position_embeddings=128,
                        bos_token_id=0, eos_token_id=2, attention_dropout=0.0)


def _memory_spec() -> ProblemSpec:
    return ProblemSpec("gpt2-tiny", WORLD, model_overrides={"resid_pdrop": 0.1}, global_batch=GLOBAL_BATCH,
                       seq_len=MEMORY_SEQ)


def _memory_points() -> list[dict]:
    """sp off and on, unfused (both regions' single column-parallel layers save their input as the
    shard in :class:`~slapo_tune.parallelize._GatheredLinear`), then fused (c_fc decomposed into the
    MLP's graph: its input kept as the shard by ``sequence_parallel_activations``)."""
    problem = _memory_spec().resolve()
    return [problem.plan({"tp": 2, "sp": sp, "pp": 1, "micro_batch": MEMORY_MICRO_BATCH, "fuse": fuse}).knobs()
            for fuse in ("off", "on") for sp in ("off", "on")]


@pytest.fixture(scope="module")
def sp_suite(tmp_path_factory):
    """One launch: the verify cases, then the memory points measured on real steps."""
    from _sp_workers import verify_and_measure

    qwen2 = _qwen2_config(tmp_path_factory.mktemp("qwen2"))
    cases = []
    for model, template, precision, knobs in VERIFY:
        path = qwen2 if model == "qwen2" else model
        spec = ProblemSpec(path, WORLD, global_batch=GLOBAL_BATCH, seq_len=SEQ, precision=precision, template=template)
        problem = spec.resolve()
        assert problem.template.name == (template or family_module(model).TEMPLATE.name)
        point = problem.plan(knobs).knobs()
        assert point["sp"] == "on" and point["tp"] == 2
        cases.append(((f"{model} {precision}", format_point(point)), spec, point))
    results = launch(verify_and_measure, WORLD, args=(cases, _memory_spec(), _memory_points()), timeout=1200)
    return cases, results


def test_sequence_parallel_points_verify_on_every_template(sp_suite):
    """Loss and every gradient the optimizer steps with match the unscheduled model (on every rank,
    every parameter compared somewhere): norms and row-parallel biases, which see only a shard of
    the tokens, included."""
    cases, results = sp_suite
    failures = []
    for key, spec, _ in cases:
        reports = [r["verify"][key] for r in results]
        failures += [f"{key} rank {rep['rank']}:\n{rep['report']}" for rep in reports if not rep["ok"]]
        if all(rep["ok"] for rep in reports):
            limit = 1e-4 if spec.precision == "fp32" else 0.1
            assert max(rep["max_grad_error"] for rep in reports) < limit, key
            assert max(rep["loss_error"] for rep in reports) < limit, key
            assert not uncompared(spec.model_spec.build("meta"), [rep["compared"] for rep in reports]), key
    assert not failures, "\n".join(failures[:3])


def _sharded_activation_bytes() -> tuple[int, int]:
    """(bytes sequence parallelism cuts into tp shards, the most it could cut) per micro-batch.

    Korthikanti et al. count per layer, in fp16 (2-byte activations, 1-byte dropout masks),
    s*b*h*(10 + 24/t + 5as/(ht)) without sequence parallelism: the 10 is what tensor parallelism
    leaves replicated (the two layer-norm inputs 4sbh, the inputs of the QKV and first MLP
    projections 4sbh, the two residual-dropout masks 2sbh), and with it s*b*h/t*(34 + 5as/h): all of
    it divided by t. Here, in fp32 on CPU, per layer:

    * the inputs of ln_1 and ln_2: 2 x 4bsh bytes;
    * the masks of the two residual dropouts: 2 x 4bsh (CPU dropout keeps its scaled fp32 noise,
      CUDA's fused kernel a 1-byte mask);
    * each layer norm's mean and reciprocal deviation: 2 x 2 x 4bs;

    * the inputs of c_attn and c_fc: 2 x 4bsh, saved by their column-parallel matmuls for the weight
      gradient; kept as the shard and gathered again in backward (``sequence_parallel_activations``,
      as Megatron does);

    = 24bsh + 16bs bytes, which sequence parallelism divides by t.
    """
    config = _memory_spec().model_spec.build("meta").config
    b, s, h, layers = MEMORY_MICRO_BATCH, MEMORY_SEQ, config.n_embd, config.n_layer
    return layers * (24 * b * s * h + 16 * b * s)


def test_sequence_parallel_keeps_a_tp_shard_of_the_replicated_activations(sp_suite):
    """tp=2: the measured peak's activations shrink by at least (1 - 1/t) of the replicated part
    (b=4, s=64, h=64, 4 layers: 24bsh + 16bs = 397,312 bytes a layer, 1,589,248 in all, so at
    least 794,624 bytes less), and by no more than 3 % beyond it (nothing else is sharded);
    unfused and fused (the two ways a region input is kept as the shard, see _memory_points)."""
    _, results = sp_suite
    t = 2
    replicated = _sharded_activation_bytes()
    expected = (1 - 1 / t) * replicated
    for fused in (0, 2):  # unfused, fused: the pairs (sp off, sp on) of _memory_points
        off, on = ([r["memory"][i] for r in results] for i in (fused, fused + 1))
        saved_activations = min(a["activations"] for a in off) - max(a["activations"] for a in on)
        saved_peak = min(a["total"] for a in off) - max(a["total"] for a in on)
        assert expected <= saved_activations <= 1.03 * expected, (fused, saved_activations, expected)
        assert expected <= saved_peak <= 1.03 * expected, (fused, saved_peak, expected)


def test_exact_mode_predicts_the_sequence_parallel_peak(sp_suite):
    """Exact mode (a fake step of the same code) within 3 % of each measured peak, sp=on predicted
    to keep fewer activation bytes than sp=off."""
    _, results = sp_suite
    model = CostModel(_memory_spec().resolve(), hardware("cpu"))
    predicted = []
    for i, point in enumerate(_memory_points()[:2]):
        measured = max(r["memory"][i]["total"] for r in results)
        exact = model.exact(point)[0]
        assert abs(exact.total - measured) <= 0.03 * measured, (point["sp"], exact.total, measured)
        predicted.append(exact)
    assert predicted[1].activations < predicted[0].activations
    assert predicted[1].total < predicted[0].total


# ------------------------------------------------------------------ the schedule, in process
def _schedule(fake_group, preset: str, sp: str, world: int = 2):
    fake_group(0, world)
    problem = ProblemSpec(preset, world, global_batch=GLOBAL_BATCH, seq_len=SEQ).resolve()
    plan = problem.plan({"tp": world, "sp": sp, "pp": 1})
    model = st.build_model(preset)
    return model, problem.template.schedule(model, plan)


def _syncs(node) -> list[tuple[str, object, int]]:
    state = state_of(node.mod)
    return [] if state is None else [(s.mode, s.op, s.axis) for s in state.pre_syncs + state.post_syncs]


def test_sequence_parallel_schedule_of_gpt2(fake_group):
    """Scatter into the first block, gather out of the last; each tensor-parallel region gathers the
    sequence where the attention module and the MLP receive it, and its row-parallel layer
    reduce-scatters; no all-reduce left in the blocks; exactly the norms and the row-parallel
    biases marked sequence-partial; the embedding and the head unchanged."""
    model, sch = _schedule(fake_group, "gpt2-tiny", "on")
    h = blocks(sch, "gpt2-tiny")
    assert _syncs(h[0]) == [("fwd_pre", "scatter", -2)] and _syncs(h[-1]) == [("fwd_post", "all_gather", -2)]
    for block in h:
        assert _syncs(block["attn"]) == _syncs(block["mlp"]) == [("fwd_pre", gather_sequence, -1)]
        assert _syncs(block["attn.c_attn"]) == _syncs(block["mlp.c_fc"]) == []
        assert _syncs(block["attn.c_proj"]) == _syncs(block["mlp.c_proj"]) == [("fwd_post", "reduce_scatter", -2)]
        assert not any(s[1] == "all_reduce" for _, node in block.named_schedules() for s in _syncs(node))
    assert _syncs(sch["transformer.wte"]) == [("fwd_post", "all_reduce", -1)]
    assert _syncs(sch["lm_head"]) == [("bwd_post", "all_reduce", -1), ("fwd_post", "all_gather", -1)]
    names = {id(p): n for n, p in model.named_parameters()}
    partial = {names[id(p)] for p in sequence_partial_parameters(model)}
    assert partial == {f"transformer.h.{i}.{m}.{p}" for i in range(4) for m, p in
                       [("ln_1", "weight"), ("ln_1", "bias"), ("ln_2", "weight"), ("ln_2", "bias"),
                        ("attn.c_proj", "bias"), ("mlp.c_proj", "bias")]}
    assert sequence_shards(model) == 2


def test_sp_off_reduces_gpt2s_input_gradient_at_the_attention_module(fake_group):
    """The same numerics with sp off: the attention module, not c_attn, all-reduces its input
    gradient; nothing is marked and the hidden state is whole."""
    model, sch = _schedule(fake_group, "gpt2-tiny", "off")
    block = blocks(sch, "gpt2-tiny")[0]
    assert _syncs(block["attn"]) == [("bwd_post", "all_reduce", -1)] and _syncs(block["attn.c_attn"]) == []
    assert _syncs(block["attn.c_proj"]) == [("fwd_post", "all_reduce", -1)]
    assert sequence_partial_parameters(model) == [] and sequence_shards(model) == 1


def test_opt_gathers_its_flattened_mlp_along_the_token_rows(fake_group):
    """OPT flattens [b, s, h] to [b*s, h] before fc1: the token axis is -2 there too (axis 0), so fc1
    gathers and fc2 reduce-scatters the rows; fc2's bias and the norms are sequence-partial."""
    model, sch = _schedule(fake_group, "opt-tiny", "on")
    layer = blocks(sch, "opt-tiny")[1]
    assert _syncs(layer["fc1"]) == [("fwd_pre", gather_sequence, -1)]
    assert _syncs(layer["fc2"]) == [("fwd_post", "reduce_scatter", -2)]
    names = {id(p): n for n, p in model.named_parameters()}
    partial = {names[id(p)] for p in sequence_partial_parameters(model) if names[id(p)].startswith(layer.path + ".")}
    assert partial == {f"{layer.path}.{n}" for n in ("self_attn.out_proj.bias", "fc2.bias", "self_attn_layer_norm.weight",
                                                     "self_attn_layer_norm.bias", "final_layer_norm.weight",
                                                     "final_layer_norm.bias")}


def test_sequence_parallelism_needs_the_sequence_parallel_tensor_plan(fake_group):
    """Blocks whose regions still all-reduce would sum whole-sequence tensors on sequence shards:
    refused, naming the module; on one rank sequence parallelism does nothing."""
    fake_group(0, 2)
    sch = st.create_schedule(st.build_model("llama-tiny"))
    apply_tensor_parallel(sch, family_module("llama-tiny").TP_PLAN)
    with pytest.raises(ScheduleError, match=r"model\.layers\.0\.self_attn' all-reduces its input gradient"):
        apply_sequence_parallel(blocks(sch, "llama-tiny"))
    fake_group(0, 1)
    sch = st.create_schedule(st.build_model("llama-tiny"))
    apply_tensor_parallel(sch, family_module("llama-tiny").TP_PLAN, sequence_parallel=True)
    apply_sequence_parallel(blocks(sch, "llama-tiny"))
    assert sequence_shards(sch.mod) == 1 and _syncs(blocks(sch, "llama-tiny")[0]) == []


def test_without_torch_distributed_the_sequence_gather_is_the_identity():
    x = torch.randn(2, 4, 3, requires_grad=True)
    assert gather_sequence(x, None) is x


# ------------------------------------------------------------------ Megatron's backward overlap
# (model, knobs, regions per block whose gathered input feeds one column-parallel layer): tp=2 on two
# ranks, two micro-batches. Llama's Q, K, V and gate, up read the gathered input each unless fused;
# GPT-2's c_attn is one layer, and its c_fc too unless fuse=on decomposes it into its MLP's graph
OVERLAP = [
    ("llama-tiny", "fp32", "tp=2,sp=on,fuse=on,micro_batch=1", 2),
    ("llama-tiny", "bf16", "tp=2,sp=on,fuse=on,micro_batch=1,ckpt_ratio=1.0", 2),
    ("llama-tiny", "fp32", "tp=2,sp=on,fuse=off,micro_batch=1", 0),
    ("gpt2-tiny", "fp32", "tp=2,sp=on,fuse=off,micro_batch=1", 2),
    ("gpt2-tiny", "fp32", "tp=2,sp=on,fuse=on,micro_batch=1,ckpt_ratio=0.5,ckpt_policy=selective", 1),
]
OVERLAP_BATCH = 2


def test_a_single_consumer_overlaps_its_backward_collectives_and_matches_the_plain_model():
    """Where a region's gathered input feeds one column-parallel layer, its backward issues the
    re-gather and the reduce-scatter asynchronously (counted at torch.distributed's functions):
    one of each per such region and micro-batch, none where several layers share the input; loss
    and gradients still match the unscheduled model (checkpointed, selective and bf16 too)."""
    from _sp_workers import count_async_collectives

    cases = []
    for model, precision, knobs, _ in OVERLAP:
        spec = ProblemSpec(model, 2, global_batch=OVERLAP_BATCH, seq_len=SEQ, precision=precision)
        cases.append(((model, precision, knobs), spec, spec.resolve().plan(knobs).knobs()))
    results = launch(count_async_collectives, 2, args=(cases,), timeout=600)
    for (_, precision, _, regions), (key, spec, _) in zip(OVERLAP, cases):
        layers = spec.model_spec.build("meta").config.num_hidden_layers
        for rank in results:
            got = rank[key]
            assert got["verify"]["ok"], (key, got["verify"]["report"])
            limit = 1e-4 if precision == "fp32" else 0.1
            assert got["verify"]["max_grad_error"] < limit and got["verify"]["loss_error"] < limit, key
            expected = regions * layers * OVERLAP_BATCH
            assert got["all_gather"] == got["reduce_scatter"] == expected, (key, got["all_gather"],
                                                                            got["reduce_scatter"], expected)
