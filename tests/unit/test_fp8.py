"""Precision fp8 in the plan: FP8 linear layers over bf16 (Transformer Engine / torchao float8),
against hand-computed figures; refused where no FP8 runs (presets without it, exact mode, the runtime)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from slapo_tune.cli import main
from slapo_tune.cost_model.analytic import time_terms
from slapo_tune.cost_model.cards import preset_card
from slapo_tune.cost_model.hardware import PRESETS, GiB
from slapo_tune.plan import Workload
from slapo_tune.precision import PRECISIONS, fp8_gpu
from slapo_tune.schedule_file import make_schedule, read_schedule, write_schedule

# Llama-3-8B on 8 x H100 80GB, data parallel with ZeRO-1, one 4096-token sequence per micro-batch
# (8 micro-batches per step), no recomputation: a point of the published H100 FP8 tables' kind
KNOBS = "tp=1,pp=1,zero=1,micro_batch=1,ckpt_ratio=0"
HIDDEN, Q, KV, INTER, LAYERS, VOCAB, SEQ = 4096, 4096, 1024, 14336, 32, 128256, 4096


def _plan(precision: str, capsys, hardware: str = "h100-80gb") -> dict:
    assert main(["plan", "--model", "llama3-8b", "--world-size", "8", "--memory-budget", "80GiB", "--hardware",
                 hardware, "--precision", precision, "--knobs", KNOBS, "--global-batch", "64", "--seq-len",
                 str(SEQ), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["top"][0]


def test_fp8_keeps_less_activation_memory_and_steps_faster_by_the_hand_computed_amounts(capsys):
    bf16, fp8 = _plan("bf16", capsys), _plan("fp8", capsys)
    mb, gib = bf16["breakdown"], 2**30
    # the linear layers' saved inputs in 1 byte instead of 2, per token and block: the attention's and
    # the MLP's inputs (hidden each), the output projection's (q) and the down projection's (intermediate)
    per_block = SEQ * LAYERS
    assert mb["act_replicated"] - fp8["breakdown"]["act_replicated"] == pytest.approx(2 * HIDDEN * per_block, abs=2)
    assert mb["act_parallel"] - fp8["breakdown"]["act_parallel"] == pytest.approx((Q + INTER) * per_block, abs=2)
    assert (mb["act_replicated"] - fp8["breakdown"]["act_replicated"]) / gib == pytest.approx(1.0)
    # model states as bf16's; the FP8 casts of the largest weight (and its transpose), plus 7 linear
    # layers' 6 fp32 amax/scale scalars per block
    for term in ("master", "optimizer", "gradients", "gathered"):
        assert fp8["breakdown"][term] == mb[term]
    assert fp8["breakdown"]["compute_copies"] == 2 * HIDDEN * INTER + LAYERS * 7 * 6 * 4
    # time: the blocks' linear FLOPs at the FP8 rate (2 x bf16's on H100), the LM head at bf16's
    block_flops = 2 * (HIDDEN * (Q + 2 * KV) + Q * HIDDEN + HIDDEN * 2 * INTER + INTER * HIDDEN) * SEQ
    head_flops = 2 * HIDDEN * VOCAB * SEQ
    slots = 64 // 8  # micro-batches per step, no pipeline
    card = preset_card("llama3-8b")[1]
    point = {**bf16["point"]}
    h100 = PRESETS["h100-80gb"]
    assert h100.fp8_flops == 2 * h100.flops
    flat = dataclasses.replace(h100, gemm_half_dim=0)  # every product at the large-product rate

    def compute(hw):
        return {p: time_terms(card, point, Workload(8, 64, SEQ, p), hw)["compute"] for p in ("bf16", "fp8")}

    assert compute(flat)["bf16"] == pytest.approx(slots * 3 * (LAYERS * block_flops + head_flops) / h100.flops)
    assert compute(flat)["fp8"] == pytest.approx(slots * 3 * (LAYERS * block_flops / h100.fp8_flops
                                                              + head_flops / h100.flops))
    saved = compute(h100)["bf16"] - compute(h100)["fp8"]
    assert bf16["step_s"] - fp8["step_s"] == pytest.approx(saved, rel=1e-6)  # nothing else moves


def test_fp8_is_refused_on_presets_without_fp8_and_in_exact_mode(capsys):
    assert not PRESETS["a100-80gb"].fp8_flops and not PRESETS["v100-32gb"].fp8_flops and PRESETS["h200"].fp8_flops
    base = ["plan", "--model", "llama3-8b", "--world-size", "8", "--memory-budget", "80GiB", "--precision", "fp8",
            "--knobs", KNOBS, "--global-batch", "64", "--seq-len", "4096"]
    assert main([*base, "--hardware", "a100-80gb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["slapo-tune: error: precision fp8: a100-80gb has no FP8 tensor cores (no "
                   "fp8_flops); choose a preset with FP8 (h100-80gb, h100-96gb, h200, b200) or bf16"]
    assert main([*base, "--hardware", "h100-80gb", "--mode", "exact"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exact memory cannot run precision fp8" in err[0]


def _gpus(monkeypatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name=name, total_memory=80 * GiB))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize("command", [
    ["tune", "--model", "gpt2-tiny", "--world-size", "1", "--ray-address", "none"],
    ["verify", "--model", "gpt2-tiny", "--world-size", "1"],
])
@pytest.mark.parametrize("gpu,why", [
    (None, "cpu has no FP8 tensor cores"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB has no FP8 tensor cores"),
    ("NVIDIA H100 80GB HBM3", "the runtime does not convert linear layers to torchao float8 yet"),
])
def test_runs_refuse_fp8_in_one_line(command, gpu, why, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    if gpu:
        _gpus(monkeypatch, gpu)
    assert main([*command, "--device", "cuda" if gpu else "cpu", "--precision", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slapo-tune: error: --precision fp8: ") and why in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_fp8_gpus_are_the_presets_with_an_fp8_rate():
    assert fp8_gpu("NVIDIA H100 80GB HBM3") and fp8_gpu("NVIDIA H200")
    assert not fp8_gpu("NVIDIA A100-SXM4-40GB") and not fp8_gpu("Tesla V100-SXM2-32GB") and not fp8_gpu("cpu")
    from slapo_tune.cost_model.hardware import PRESET_MODELS, PRESETS

    # the runtime's list agrees with the cost model's presets: a preset's GPU has FP8 exactly when it has a rate
    assert {key: fp8_gpu(model) for key, model in PRESET_MODELS.items()} == \
        {key: bool(PRESETS[key].fp8_flops) for key in PRESET_MODELS}


def test_schedule_files_accept_fp8(tmp_path):
    from slapo_tune.plan import Plan

    knobs = {"tp": 1, "pp": 1, "dp": 8, "zero": 1, "micro_batch": 1, "ckpt_ratio": 0.0,
             "pipeline_schedule": "1f1b", "attn": "sdpa", "fuse": "off"}
    schedule = make_schedule(template={"name": "llama", "version": "1"}, plan=Plan.of(knobs, Workload(8, 64, SEQ)),
                             world_size=8, global_batch=64, seq_len=SEQ, precision="fp8",
                             model={"name": "llama3-8b", "fingerprint": "abc"}, device="cuda")
    write_schedule(tmp_path / "s.json", schedule)
    assert read_schedule(tmp_path / "s.json")["precision"] == "fp8"
    fp8, bf16 = PRECISIONS["fp8"], PRECISIONS["bf16"]
    assert (fp8.param_bytes, fp8.master, fp8.activation_bytes, fp8.linear_input_bytes) == (2, True, 2, 1)
    assert (bf16.linear_input_bytes, bf16.fp8, fp8.measured_as) == (2, False, "bf16")
