"""Vocabulary-parallel loss (``loss_parallel``): the sharded cross-entropy equals torch's."""

import pytest

from slapo_tune.launch import launch

from _loss_parallel_workers import run_cross_entropy, run_template_points


@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_cross_entropy_equals_torch(world):
    results = launch(run_cross_entropy, world, args=(64,), timeout=120)
    for rank, res in enumerate(results):
        for shift, case in res.items():
            assert case["loss_error"] <= 1e-6 * case["loss"], (rank, shift, case)  # fp32: an ulp or so
            assert case["grad_error"] < 1e-7, (rank, shift, case)
    assert results[0][True]["loss"] == results[1][True]["loss"]  # every rank has the whole loss


def test_on_one_rank_it_is_plain_cross_entropy():
    import torch
    import torch.nn.functional as F

    from slapo_tune._vocab_loss import vocab_parallel_cross_entropy

    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    loss = vocab_parallel_cross_entropy(logits, labels, None, shift=False)
    ref = F.cross_entropy(logits.detach().reshape(-1, 11), labels.reshape(-1))
    assert abs(loss.item() - ref.item()) < 1e-6


def _spec(model, world, template=None):
    from slapo_tune.problem import ProblemSpec

    return ProblemSpec(model, world, template=template, global_batch=4, seq_len=16)


def test_the_knob_is_offered_with_tp_only_and_defaults_off():
    from slapo_tune.plan import Plan

    points = list(_spec("gpt2-tiny", 2).resolve().space.enumerate())
    assert {p["loss_parallel"] for p in points if p["tp"] == 1} == {"off"}
    assert {p["loss_parallel"] for p in points if p["tp"] == 2} == {"off", "on"}
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
