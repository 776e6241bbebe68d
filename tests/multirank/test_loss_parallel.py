"""Vocabulary-parallel loss (``loss_parallel``): the sharded cross-entropy equals torch's."""

import pytest

from slapo_tune.launch import launch

from _loss_parallel_workers import run_cross_entropy, run_template_points


@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_cross_entropy_equals_torch(world):
    results = launch(run_cross_entropy, world, args=(64,), timeout=120)
    for rank, res in enumerate(results):
        assert res["bf16"].pop("grad_dtype") == "torch.bfloat16"
        for shift, case in res.items():
            assert case["loss_error"] <= 1e-6 * case["loss"], (rank, shift, case)  # fp32: an ulp or so
            assert case["grad_error"] < 1e-7, (rank, shift, case)
    assert results[0][True]["loss"] == results[1][True]["loss"]  # every rank has the whole loss


def test_on_one_rank_it_is_plain_cross_entropy():
    import torch
    import torch.nn.functional as F

    from slapo_tune.parallel._vocab_loss import vocab_parallel_cross_entropy

    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    loss = vocab_parallel_cross_entropy(logits, labels, None, shift=False)
    ref = F.cross_entropy(logits.detach().reshape(-1, 11), labels.reshape(-1))
    assert abs(loss.item() - ref.item()) < 1e-6


def _spec(model, world, template=None):
    from slapo_tune.problem import ProblemSpec

    return ProblemSpec(model, world, template=template, global_batch=4, seq_len=16)


def test_the_knob_is_offered_to_causal_lms_and_defaults_off():
    from slapo_tune.plan import Plan

    points = list(_spec("gpt2-tiny", 2).resolve().space.enumerate())
    # at tp=1 the same loss in place over the whole vocabulary (a fused cross-entropy)
    assert {p["loss_parallel"] for p in points if p["tp"] == 1} == {"off", "on"}
    assert {p["loss_parallel"] for p in points if p["tp"] == 2} == {"off", "on"}
    assert _spec("gpt2-tiny", 2).resolve().plan("tp=1").loss_parallel == "off"
    # BERT's masked-LM loss is not the causal one the sharded loss replaces
    assert {p["loss_parallel"] for p in _spec("bert-tiny", 2).resolve().space.enumerate()} == {"off"}
    # a point written before the knob (an older schedule file) means what it meant
    old = {k: v for k, v in points[-1].items() if k != "loss_parallel"}
    assert Plan.of(old, _spec("gpt2-tiny", 2).resolve().workload).loss_parallel == "off"


def test_templates_keep_the_logits_sharded_and_verify():
    """tp=2 with loss_parallel on: the last stage returns vocab/2 logits, loss and gradients equal
    the unscheduled model's (gpt2, llama, and the generic template on Llama); off: whole logits."""
    base = {"tp": 2, "micro_batch": 2}
    cases = [((model, template, lp), _spec(model, 2, template), {**base, "loss_parallel": lp})
             for model, template in (("gpt2-tiny", None), ("llama-tiny", None), ("llama-tiny", "generic"))
             for lp in ("on", "off")]
    results = launch(run_template_points, 2, args=(cases,), timeout=300)
    for key, spec, _ in cases:
        vocab = spec.resolve().info.vocab
        for r in results:
            res = r[key]
            assert res["ok"], f"{key} rank {res['rank']}:\n{res['report']}"
            assert res["loss_error"] < 1e-5 and res["max_grad_error"] < 1e-4, key
            assert res["logits_width"] == (vocab // 2 if key[2] == "on" else vocab), key


def test_at_tp1_the_loss_runs_in_place_and_verifies():
    """tp=1 (dp=2) with loss_parallel on: the whole vocabulary's logits, the loss computed in place
    (the vocabulary-parallel cross-entropy on one rank), loss and gradients equal the unscheduled
    model's on the gpt2, llama and generic templates."""
    cases = [((model, template), _spec(model, 2, template), {"tp": 1, "micro_batch": 2, "loss_parallel": "on"})
             for model, template in (("gpt2-tiny", None), ("llama-tiny", None), ("llama-tiny", "generic"))]
    results = launch(run_template_points, 2, args=(cases,), timeout=300)
    for key, spec, _ in cases:
        for r in results:
            res = r[key]
            assert res["ok"], f"{key} rank {res['rank']}:\n{res['report']}"
            assert res["loss_error"] < 1e-5 and res["max_grad_error"] < 1e-4, key
            assert res["logits_width"] == spec.resolve().info.vocab, key


def test_measured_peaks_at_tp1_exact_and_analytic():
    """Real steps at world 2 (dp=2, fp32, CPU, a 4,096-token vocabulary so that the loss matters):
    the fused loss keeps one fp32 buffer of the logits where Hugging Face's loss keeps its
    log-softmax and makes two gradients; exact mode within 3 % of torch's MemTracker on every rank,
    analytic within 10 %; on keeps less than off."""
    from _memory_workers import real_steps_rank

    from slapo_tune.cost_model import CostModel
    from slapo_tune.cost_model.hardware import Hardware
    from slapo_tune.problem import ProblemSpec

    cpu = Hardware("test-cpu", 16 * 2**30, 1e10, 1e9, 1e9, 5e-5, 2, 4e-4, 2)
    spec = ProblemSpec("llama-tiny", 2, model_overrides={"hidden_size": 128, "vocab_size": 4096}, global_batch=8,
                       seq_len=64)
    base = {"tp": 1, "pp": 1, "dp": 2, "zero": 0, "micro_batch": 4, "ckpt_ratio": 0.0, "pipeline_schedule": "1f1b",
            "attn": "sdpa", "fuse": "off"}
    points = [{**base, "loss_parallel": lp} for lp in ("off", "on")]
    per_rank = launch(real_steps_rank, 2, args=(spec, points), timeout=300)
    model = CostModel(spec.resolve(), cpu)
    measured = []
    for i, point in enumerate(points):
        exact, analytic = model.exact(point)[0].total, model.memory(point).per_stage[0]
        for reports in per_rank:
            real = reports[i]["total"]
            assert abs(exact - real) <= 0.03 * real, (point["loss_parallel"], real, exact)
            assert abs(analytic - real) <= 0.10 * real, (point["loss_parallel"], real, analytic)
        measured.append(per_rank[0][i]["total"])
    assert measured[1] < 0.9 * measured[0], measured


def test_the_cost_model_counts_a_vocab_slice_of_the_logits():
    """llama3-8b (vocab 128256), tp=8, bf16: the logits the loss keeps are 1/8 of the unsharded
    loss's fp32 log-softmax; their gradient is made in place, leaving one bf16 slice (the head's
    output, then the gradient's cast) and the head's backward beside it."""
    from slapo_tune.cost_model import CostModel
    from slapo_tune.cost_model.hardware import Hardware
    from slapo_tune.problem import ProblemSpec

    gpu = Hardware("test-gpu", 80 * 2**30, 1e14, 1e11, 1e11)
    problem = ProblemSpec("llama3-8b", 8, global_batch=8, seq_len=2048, precision="bf16").resolve()
    point = problem.space.complete({"tp": 8, "micro_batch": 8, "ckpt_ratio": 1.0})
    model = CostModel(problem, gpu)
    off, on = (model.memory({**point, "loss_parallel": lp}).breakdown for lp in ("off", "on"))
    tokens, vocab, hidden = 8 * 2048, 128256, 4096
    assert off["logits"] == tokens * vocab * 4 and off["logits_grad"] == 2 * tokens * vocab * 4
    assert on["logits"] == off["logits"] // 8
    head_backward = 2 * tokens * hidden * 2 + vocab // 8 * hidden * 2
    assert on["logits_grad"] == tokens * vocab // 8 * 2 + head_backward
    # time: the head's all-gather of the logits (bf16, over 8 ranks) is gone, three fp32 numbers
    # per token all-reduced instead (NCCL's ring or tree, whichever is faster)
    t_off, t_on = (model.time({**point, "loss_parallel": lp}).breakdown["tp_comm"] for lp in ("off", "on"))
    bw = gpu.bandwidth(8, False)
    saved = 7 * gpu.latency + 7 / 8 * tokens * vocab * 2 / bw
    all_reduce = min(14 * gpu.latency + 14 / 8 * tokens * 4 / bw, 6 * gpu.latency + 2 * tokens * 4 / bw)
    assert t_off - t_on == pytest.approx(saved - 3 * all_reduce)


def test_measured_peaks_world4_exact_and_analytic():
    """Real steps at world 4 (tp=4, fp32, CPU), loss_parallel off and on: exact mode counts the
    sharded loss's peak byte for byte (up to gloo's late activation buffer), analytic within 10 %;
    on saves what the sharded logits save."""
    from _memory_workers import real_steps_rank

    from slapo_tune.cost_model import CostModel
    from slapo_tune.cost_model.hardware import Hardware
    from slapo_tune.problem import ProblemSpec

    cpu = Hardware("test-cpu", 16 * 2**30, 1e10, 1e9, 1e9, 5e-5, 2, 4e-4, 2)
    spec = ProblemSpec("llama-tiny", 4, model_overrides={"hidden_size": 256}, global_batch=8, seq_len=64)
    base = {"tp": 4, "pp": 1, "dp": 1, "zero": 0, "micro_batch": 4, "ckpt_ratio": 0.0, "pipeline_schedule": "1f1b",
            "attn": "sdpa", "fuse": "off"}
    points = [{**base, "loss_parallel": lp} for lp in ("off", "on")]
    per_rank = launch(real_steps_rank, 4, args=(spec, points), timeout=300)
    model = CostModel(spec.resolve(), cpu)
    late_buffer = 4 * 64 * 256 * 4
    measured = []
    for i, point in enumerate(points):
        exact, analytic = model.exact(point)[0].total, model.memory(point).per_stage[0]
        for reports in per_rank:
            real = reports[i]["total"]
            assert 0 <= real - exact <= late_buffer, (point["loss_parallel"], real, exact)
            assert abs(analytic - real) <= 0.10 * real, (point["loss_parallel"], real, analytic)
        measured.append(per_rank[0][i]["total"])
    assert measured[1] < measured[0]
