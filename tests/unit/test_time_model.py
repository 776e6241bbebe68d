"""The time model on GPUs, the planning defaults and ``plan --mode exact``: nothing runs here.

Ground truth for throughput is published (Narayanan et al. 2021, Table 1: per-GPU TFLOP/s of GPT
models trained with Megatron-LM on A100s); for MFU the conventional definition (model FLOPs over
the devices' datasheet peak, PaLM's), computed here from a meta-device model's parameter count.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.paper_tables import MEGATRON_2021_ATTN, MEGATRON_TABLE_1, megatron_flops
from slapo_tune.cli import main
from slapo_tune.cost_model import CostModel, hardware
from slapo_tune.precision import PRECISIONS
from slapo_tune.problem import DEFAULT_GLOBAL_TOKENS, ProblemSpec


def _gpt(layers: int, hidden: int, heads: int, world: int, batch: int, precision: str = "bf16"):
    spec = ProblemSpec("gpt3-175b", world, model_overrides={"n_layer": layers, "n_embd": hidden, "n_head": heads},
                       seq_len=2048, global_batch=batch, precision=precision, device="cuda")
    return spec.resolve()


@pytest.fixture(scope="module")
def megatron_rows():
    """(published, predicted) per-GPU TFLOP/s at three of Table 1's layouts: 1.7B, 18.4B, 1T."""
    out = []
    for index in (0, 3, 9):
        _, heads, hidden, layers, tp, pp, gpus, batch, published = MEGATRON_TABLE_1[index]
        problem = _gpt(layers, hidden, heads, gpus, batch)
        model = CostModel(problem, hardware("a100-80gb"))
        point = problem.plan(dict(tp=tp, pp=pp, dp=gpus // (tp * pp), zero=0, micro_batch=1, ckpt_ratio=1.0,
                                  pipeline_schedule="1f1b", attn=MEGATRON_2021_ATTN, fuse="on"))
        out.append((published, megatron_flops(batch, layers, hidden) / model.time(point).step / gpus / 1e12))
    return out


def test_gpu_time_model_is_near_megatrons_published_throughput_and_rises_with_size(megatron_rows):
    """Uncalibrated, within 12 % of each published figure (measured: -5 %, -10 %, -6 %, rows kept out
    of the fit of the GPU presets' constants; before the small-product mechanism +2 %, +1 %, +6 %;
    the flat model was 12-26 % low; with FlashAttention in place of the runs' unfused attention core and
    one NIC's bandwidth for a data-parallel ring spanning nodes, +26 % for 1.7B), and, as the
    published figures, higher for 1T (hidden 25600) than for 18.4B (hidden 6144): matrix
    products grow with h^2 per token, the memory-bound passes and communication with h."""
    for published, predicted in megatron_rows:
        assert abs(predicted / published - 1) < 0.12, (published, predicted)
    assert megatron_rows[2][1] > megatron_rows[1][1]


def test_mfu_is_model_flops_over_the_datasheet_peak():
    """6 N tokens + attention, N from the model itself, over 312 TFLOP/s per A100 (not its
    achievable GEMM rate): a step at the peak's pace is MFU 1."""
    import torch

    from slapo_tune.models import model_from_config

    problem = _gpt(2, 1024, 16, 8, 64)
    model = CostModel(problem, hardware("a100-80gb"))
    with torch.device("meta"):
        n = sum(p.numel() for p in model_from_config(problem.config, "meta").parameters())
    tokens = 64 * 2048
    flops = 6 * n * tokens + 12 * 2 * 1024 * 2048 * tokens
    step = flops / (8 * 312e12)
    assert model.mfu(step, 8) == pytest.approx(1.0, rel=1e-6)


def test_attention_kernel_and_fusion_change_gpu_step_time():
    """Eager attention writes and reads its score matrix (memory-bound passes SDPA's fused kernel
    keeps on chip); fusion makes GPT-2's tanh GELU one pass; so plan's top entries are not the same
    layout four times as exact ties."""
    problem = _gpt(4, 4096, 32, 8, 64)
    model = CostModel(problem, hardware("a100-80gb"))
    base = dict(tp=8, pp=1, dp=1, zero=0, micro_batch=1, ckpt_ratio=0.0)
    times = {(attn, fuse): model.time(problem.plan({**base, "attn": attn, "fuse": fuse})).step
             for attn in ("eager", "sdpa") for fuse in ("off", "on")}
    assert times[("eager", "off")] > times[("sdpa", "off")] > times[("sdpa", "on")]
    assert times[("eager", "off")] > times[("eager", "on")]
    assert len(set(times.values())) == 4


def test_fsdp_communication_hides_behind_compute_on_gpus_only():
    """ZeRO-3 on a GPU prefetches gathers and reduces on their own streams: only what compute cannot
    cover (at least one block's) is exposed. On CPU ranks (gloo) nothing overlaps."""
    problem = _gpt(4, 4096, 32, 16, 64)
    point = problem.plan(dict(tp=1, pp=1, dp=16, zero=3, micro_batch=1, ckpt_ratio=0.0))
    gpu = CostModel(problem, hardware("a100-80gb")).time(point).breakdown
    lan = CostModel(problem, hardware("a100-80gb"))
    import dataclasses

    lan.device = dataclasses.replace(lan.device, cores=64)  # the same rates, as CPU ranks
    cpu = lan.time(point).breakdown
    assert 0 < gpu["dp_comm"] < cpu["dp_comm"]


def test_plan_defaults_are_a_real_runs_and_the_header_says_so(capsys):
    """On GPUs: the model's context length and the multiple of the world size closest to 2^22
    tokens; on CPU the tiny defaults stay (8 per rank, at most 128 tokens). (One point: the workload
    is the same for every point, and the whole space is a million points.)"""
    one = ["--knobs", "tp=8"]
    assert main(["plan", "--model", "llama-7b", "--world-size", "64", "--memory-budget", "80GiB", "--top", "1",
                 "--json", *one]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["seq_len"] == 4096 and data["global_batch"] % 64 == 0
    assert abs(data["global_batch"] * 4096 - DEFAULT_GLOBAL_TOKENS) <= 64 * 4096 / 2
    assert data["defaults"] == ["global_batch", "seq_len"]
    assert main(["plan", "--model", "llama-7b", "--world-size", "64", "--memory-budget", "80GiB", "--top", "1", *one]) == 0
    workload = capsys.readouterr().out.splitlines()[1]  # (the first line: the model, world and counts)
    assert "global batch 1024 (4.2M tokens, default)" in workload and "seq 4096 (default: the model's context length)" in workload
    cpu = ProblemSpec("gpt2-tiny", 2).resolve().workload
    assert (cpu.seq_len, cpu.global_batch) == (128, 16)


def test_plan_exact_mode_rechecks_the_shown_points_with_a_fake_step(capsys):
    argv = ["plan", "--model", "gpt2-tiny", "--world-size", "2", "--memory-budget", "64MiB", "--device", "cpu",
            "--hardware", "a100-80gb", "--top", "2", "--json"]
    assert main([*argv, "--mode", "exact"]) == 0
    rows = json.loads(capsys.readouterr().out)["top"]
    assert len(rows) == 2 and all(r["exact_peak"] > 0 for r in rows)
    # the analytic peak is a prediction of the exact one: close, not the same number
    assert all(abs(r["exact_peak"] / r["peak"] - 1) < 0.25 for r in rows)
    assert main(argv) == 0
    assert "exact_peak" not in json.loads(capsys.readouterr().out)["top"][0]


def test_fusion_saves_no_time_on_cpu_ranks():
    """On a CPU the templates fuse with the eager backend: the same operators run, so the fused and
    unfused points cost the same; on a GPU (inductor) the fused one is faster."""
    import dataclasses

    problem = _gpt(2, 1024, 16, 1, 64)  # the shape of the other tests here: its layout measured once
    gpu = CostModel(problem, hardware("a100-80gb"))
    cpu = CostModel(problem, hardware("a100-80gb"))
    cpu.device = dataclasses.replace(cpu.device, cores=16)  # the same rates, as CPU ranks
    base = dict(tp=1, pp=1, dp=1, zero=0, micro_batch=1, ckpt_ratio=0.0, attn="sdpa")
    on, off = (problem.plan({**base, "fuse": fuse}) for fuse in ("on", "off"))
    assert cpu.time(on).step == cpu.time(off).step
    assert gpu.time(on).step < gpu.time(off).step


def test_a_ring_across_nodes_drives_every_nic_of_its_ranks_in_a_node():
    """NCCL runs a ring per NIC (rail): 64 consecutive ranks, 8 to a node, move bytes at 8 NICs'
    rate (capped by NVLink's), ranks a node apart at one NIC's; so a 13B model under FSDP keeps its
    per-GPU throughput from 8 to 64 H100s, as llm-foundry's published 4,792 and 4,800 tokens/s/GPU
    (one NIC's bandwidth predicted 3.7x less at 64)."""
    from benchmarks.published_runs import evaluate, load_runs
    from slapo_tune.cost_model.analytic import _ring

    hw = hardware("h100-80gb")
    size = 2**30
    rails = min(hw.devices_per_node * hw.inter_bandwidth, hw.intra_bandwidth)
    # FSDP's reduce-scatter (a ring: NCCL's all-reduce may take its tree, see below)
    assert _ring(size, 64, hw, "reduce_scatter") == pytest.approx(63 * hw.latency + 63 / 64 * size / rails)
    assert _ring(size, 8, hw, "reduce_scatter", stride=8) == pytest.approx(
        7 * hw.latency + 7 / 8 * size / hw.inter_bandwidth)
    assert _ring(size, 8, hw, "reduce_scatter") == pytest.approx(7 * hw.latency + 7 / 8 * size / hw.intra_bandwidth)
    runs = {r["id"]: r for r in load_runs()}
    eight, sixty_four = (evaluate(runs[f"mpt-13b h100-80gb x{n} s2048"], rank=False) for n in (8, 64))
    assert sixty_four["predicted_tokens"] == pytest.approx(eight["predicted_tokens"], rel=0.05)


def test_published_runs_fit_and_are_predicted_within_15_percent():
    """Every published run (benchmarks/data/published_runs.json: llm-foundry's MPT 760M-70B on 8-128
    A100s and H100s, FSDP, with and without recomputation; NVIDIA's Llama-3 8B and 70B in FP8 on 8
    and 64 GPUs: TP 4 with sequence parallelism, an interleaved PP 8 x VP 5, the distributed optimizer
    or Megatron FSDP; Llama-3.1 405B on 1,024: TP 8, CP 2, PP 8 x VP 8 with the end stages one block
    short) is kept by the cost model at tune's default budget on its GPU, fits the GPU, and is
    predicted within 15 % of its published tokens/s/GPU, the held-out runs too (the mechanisms'
    constants were fitted on the others: benchmarks/fit_constants.py), except the runs whose ``miss``
    note says what their prediction, or our runtime, lacks (405B: our context parallelism keeps the
    gathered K and V repeated to the query heads, and does not fit): those must still miss, by not
    fitting or by their ratio (whoever fixes one removes its note).
    FSDP fully hidden behind compute (FSDP_OVERLAP = 1) put 13B on 8 H100s 34 % fast; the 70B rows
    were 113.8 and 131.8 GiB and 0.82 before the runtime freed its pipeline sends, fused its norms and
    SwiGLU, upcast ZeRO-1's gradients block by block and overlapped the sequence-parallel backward
    collectives."""
    from benchmarks.published_runs import evaluate, load_runs

    rows = [evaluate(run, rank=False) for run in load_runs()]
    assert any("llama3" in r["id"] for r in rows)
    assert all(r["kept"] for r in rows), [r["id"] for r in rows if not r["kept"]]
    off = {r["id"]: (r["fits"], round(r["ratio"], 3)) for r in rows if not (r["fits"] and 0.85 <= r["ratio"] <= 1.15)}
    noted = {r["id"] for r in rows if r["miss"]}
    assert set(off) == noted, (off, noted)


def test_an_activation_counts_the_passes_of_the_ops_it_runs():
    """The elements an activation's ops read and write per element of its input, counted by torch's
    dispatcher as Hugging Face's ACT2FN runs them (not by the model): torch's one-kernel activations
    read and write once; GPT-2's NewGELU composes eight ops; so an MPT-like block (exact GELU)
    moves fewer bytes than GPT-2's."""
    import dataclasses

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.activations import ACT2FN

    from slapo_tune.cost_model.analytic import activation_passes, block_traffic

    class Count(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.elements += sum(a.numel() for a in (*args, out) if isinstance(a, torch.Tensor))
            return out

    gpt2 = CostModel(_gpt(2, 1024, 16, 8, 64), hardware("a100-80gb")).layout
    x = torch.randn(4, 8)
    for name in ("gelu", "relu", "silu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "quick_gelu"):
        with Count() as count:
            ACT2FN[name](x)
        assert activation_passes(dataclasses.replace(gpt2, activation=name)) == count.elements / x.numel(), name
    point = dict(tp=1, sp="off", attn="sdpa", fuse="off")
    exact = dataclasses.replace(gpt2, activation="gelu")
    bf16 = PRECISIONS["bf16"]
    assert block_traffic(exact, point, 2048, bf16, gpu=True) < block_traffic(gpt2, point, 2048, bf16, gpu=True)


def test_a_linear_layers_product_reaches_less_of_the_rate_the_smaller_it_is():
    """A product's smallest dimension D sets its share of the GPU's rate, D^2 / (D^2 + D0^2) with
    D0 = gemm_half_dim: per FLOP a D0-wide product takes (64 / 65) / (1 / 2) = 1.97 times an
    8 D0-wide one; attention's batched products (not linear) keep the roofline alone."""
    from slapo_tune.cost_model.analytic import gemm_seconds

    hw = hardware("h100-80gb")
    d0 = int(hw.gemm_half_dim)
    assert d0 > 0

    def per_flop(d, linear=True):
        return gemm_seconds(hw, 16384, d, d, 2, linear=linear) / (2 * 16384 * d * d)

    assert per_flop(d0) / per_flop(8 * d0) == pytest.approx((64 / 65) / (1 / 2))
    assert per_flop(8192, linear=False) == pytest.approx(1 / hw.flops)


def test_a_node_drives_no_more_nics_than_it_has():
    """DGX-1 (V100) has 4 NICs for 8 GPUs: a ring over 16 consecutive ranks crosses nodes at 4 NICs'
    rate, not 8."""
    from slapo_tune.cost_model.analytic import _ring

    v100 = hardware("v100-32gb")
    assert v100.nics_per_node == 4
    size = 2**30
    assert _ring(size, 16, v100, "all_gather") == pytest.approx(15 * v100.latency + 15 / 16 * size / (4 * v100.inter_bandwidth))


def test_an_all_reduce_on_gpus_takes_the_tree_when_it_is_faster():
    """NCCL's all-reduce: a ring (2(n-1) steps, 2(n-1)/n of the bytes) or a double binary tree
    (2 log2 n steps, twice the bytes), whichever is faster. A small gradient all-reduce over 1,024
    ranks costs 20 tree steps, not 2,046 ring steps; a large one stays the ring's; a CPU's gloo
    all-reduce stays a ring."""
    from slapo_tune.cost_model.analytic import _ring

    h100 = hardware("h100-80gb")
    small, large = 2**10, 2**30
    bw = h100.bandwidth(1024, True, 8)
    assert _ring(small, 1024, h100) == pytest.approx(20 * h100.latency + 2 * small / bw)
    assert _ring(small, 1024, h100) < _ring(small, 64, h100) * 2  # log n, not n
    bw16 = h100.bandwidth(16, True, 8)  # two nodes: the ring's 15/16 of the bytes beat the tree's 8 fewer steps
    assert _ring(large, 16, h100) == pytest.approx(30 * h100.latency + 2 * 15 / 16 * large / bw16)
    assert _ring(large, 16, h100) < 8 * h100.latency + 2 * large / bw16
    cpu = hardware("a100-80gb")
    cpu = type(cpu)(**{**cpu.as_dict(), "name": "cpu", "cores": 64})  # a CPU's (gloo's) all-reduce: a ring
    assert _ring(small, 64, cpu) == pytest.approx(126 * cpu.latency + 2 * 63 / 64 * small / cpu.bandwidth(64, True, 8))


def test_hardware_presets_are_data_with_sources(tmp_path):
    """Each preset's figures come from hardware_presets.json with its sources (B200 among them); a
    preset missing a figure or its sources is refused, naming what it needs."""
    from slapo_tune.cost_model.hardware import PRESETS, PRESETS_FILE, load_presets

    data = json.loads(PRESETS_FILE.read_text())
    assert set(data["presets"]) == set(PRESETS) >= {"a100-40gb", "a100-80gb", "h100-80gb", "h100-96gb", "h200", "b200"}
    for name, entry in data["presets"].items():
        assert entry["sources"] and PRESETS[name].memory == entry["memory_gib"] * 2**30
    for broken in ({"sources": []}, {"flops": None}):
        entry = {**data["presets"]["b200"], **broken}
        if entry.get("flops", 0) is None:
            del entry["flops"]
        path = tmp_path / "presets.json"
        path.write_text(json.dumps({"presets": {"b200": entry}}))
        with pytest.raises(ValueError, match="b200 needs"):
            load_presets(path)


def _sp_tp_comm(problem, hw, fuse: str, sp: str = "on") -> float:
    point = problem.plan(dict(tp=4, pp=1, dp=problem.workload.world_size // 4, zero=1, micro_batch=1, ckpt_ratio=0.0, sp=sp,
                              fuse=fuse))
    return CostModel(problem, hw).time(point).breakdown["tp_comm"]


def test_a_fused_projection_hides_its_backward_regather_and_reduce_scatter_behind_its_products():
    """Sequence parallelism on GPUs, tp=4 inside a node: Megatron's overlap (the runtime's
    _GatheredLinear) hides a fused projection's backward re-gather behind its input-gradient
    product and its reduce-scatter behind its weight-gradient product. A micro-batch's all-gather
    and reduce-scatter of a block's [b, s, h] bf16 input each take (tp - 1) latencies and
    (tp - 1) / tp of its bytes over NVLink (alpha-beta); Llama-70B's products at s = 4096 outlast
    them, so fuse=on saves 4 of them per block and micro-batch (QKV, gate/up), GPT-3's ungated MLP
    2 (only the QKV projection is one layer more under fusion). Where the link is 10^4 times
    slower, only each product's own time is saved (two products of each fused layer, the compute
    model's seconds). Nothing moves with sp off, nor on a CPU, whose collectives share the cores."""
    from dataclasses import replace

    from slapo_tune.cost_model._time import gemm_seconds

    h100 = hardware("h100-80gb")
    llama = ProblemSpec("llama-70b", 8, seq_len=4096, global_batch=8, precision="bf16", device="cuda").resolve()
    gpt = _gpt(8, 12288, 96, 8, 8)
    for problem, regions in ((llama, 2), (gpt, 1)):
        config = problem.model.build("meta").config
        layers, m, s = config.num_hidden_layers, 4, problem.workload.seq_len
        collective = 3 * h100.latency + 3 / 4 * s * config.hidden_size * 2 / h100.intra_bandwidth
        saved = _sp_tp_comm(problem, h100, "off") - _sp_tp_comm(problem, h100, "on")
        assert saved == pytest.approx(2 * regions * collective * layers * m, rel=1e-9), problem.model.name
        assert _sp_tp_comm(problem, h100, "off", "off") == _sp_tp_comm(problem, h100, "on", "off")

    slow = replace(h100, intra_bandwidth=h100.intra_bandwidth / 1e4)
    config = llama.model.build("meta").config
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    product = sum(gemm_seconds(slow, 4096, h, n / 4, 2, ranks=8, linear=True)
                  for n in (q + 2 * kv, 2 * config.intermediate_size))
    saved = _sp_tp_comm(llama, slow, "off") - _sp_tp_comm(llama, slow, "on")
    assert saved == pytest.approx(2 * product * config.num_hidden_layers * 4, rel=1e-9)

    cpu = ProblemSpec("llama-tiny", 8, seq_len=64, global_batch=8).resolve()
    assert _sp_tp_comm(cpu, hardware("cpu"), "off") == _sp_tp_comm(cpu, hardware("cpu"), "on")


def test_a_causal_decoders_fused_attention_is_charged_the_causal_masks_kept_pairs():
    """On a GPU, SDPA with ``is_causal`` (FlashAttention-2) skips the blocks above the diagonal: the
    attention term of a causal decoder's layout is the same layout's non-causal one times the causal
    mask's kept entries over s^2 (ground truth: torch counts the lower triangle), under context
    parallelism too (its chunked flash kernels: a cp-th of those pairs per rank). Where context
    parallelism gathers the keys (attention dropout) the runtime calls SDPA with an explicit boolean
    mask, which no fused kernel skips blocks of, and eager attention computes every score: both
    charged the whole rectangle. BERT's encoder is not causal."""
    import dataclasses

    import torch

    from slapo_tune.cost_model.analytic import time_terms
    from slapo_tune.cost_model.cards import preset_card

    problem = _gpt(24, 2048, 16, 8, 64)
    model = CostModel(problem, hardware("h100-80gb"))
    assert model.layout.causal and not preset_card("bert-base")[1].causal
    s = problem.workload.seq_len
    kept = torch.ones(s, s, dtype=torch.bool).tril().sum().item()
    # GPT-3's config trains with attention dropout 0.1 (GPT-2's default)
    dropout, plain = model.layout, dataclasses.replace(model.layout, attention_dropout=0.0)
    assert dropout.attention_dropout == 0.1
    for attn, cp, share, layout in (("sdpa", 1, kept / s**2, dropout), ("sdpa", 2, kept / s**2, plain),
                                    ("sdpa", 2, 1.0, dropout), ("eager", 1, 1.0, plain)):
        point = problem.plan(dict(attn=attn, cp=cp, dp=8 // cp))
        causal, full = (time_terms(one, point, model.workload, model.device)["attention"]
                        for one in (layout, dataclasses.replace(layout, causal=False)))
        assert causal / full == pytest.approx(share, rel=1e-12), (attn, cp, layout.attention_dropout)
