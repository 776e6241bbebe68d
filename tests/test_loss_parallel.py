"""Vocabulary-parallel loss (``loss_parallel``): the sharded cross-entropy equals torch's."""

import pytest

from slapo_tune.launch import launch

from _loss_parallel_workers import run_cross_entropy


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
