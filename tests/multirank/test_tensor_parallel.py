"""Tensor parallelism + checkpointing give the unscheduled model's loss and gradients (gloo)."""

import pytest

import slapo_tune as st
from slapo_tune.launch import launch

from _helpers import FAMILIES, uncompared
from _tp_workers import run_tp_suite

RATIOS = (0.0, 0.5, 1.0)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def suite(request):
    results = launch(run_tp_suite, request.param, args=(RATIOS,), timeout=600)
    return request.param, results


@pytest.mark.parametrize("preset", list(FAMILIES))
@pytest.mark.parametrize("ratio", RATIOS)
def test_tensor_parallel_matches_unscheduled(suite, preset, ratio):
    world, results = suite
    for rank, res in enumerate(results):
        case = res[(preset, ratio)]
        assert case["ok"], f"rank {rank} of {world}:\n{case['report']}"
        assert not uncompared(st.build_model(preset), [case["compared"]])  # every gradient, on every rank
        assert case["grad_error"] < 1e-4


def test_missing_sync_is_caught_and_named(suite):
    world, results = suite
    for res in results:
        case = res["missing_sync"]
        assert not case["ok"]
        assert "first divergent module: transformer.h.1.mlp.c_proj" in case["report"]
        assert "missing sync('fwd_post', 'all_reduce')" in case["report"]


def test_collectives_have_conjugate_backwards(suite):
    world, results = suite
    total = sum(range(1, world + 1))
    for rank, res in enumerate(results):
        c = res["comm"]
        assert c["reduce_fwd"] == (float(total), 1.0)  # the gradient is not multiplied by the world size
        assert c["reduce_bwd"] == (1.0, float(total))
        shape, row, grad = c["gather"]
        assert shape == (2, 2 * world) and row == [float(r) for r in range(world) for _ in range(2)]
        assert grad == [float(2 * rank), float(2 * rank + 1)]
        shape, row, grad = c["reduce_scatter"]
        assert shape == (2, 2) and row == [float(world * (2 * rank)), float(world * (2 * rank + 1))]
        assert grad == [1.0] * (2 * world)
        row, grad = c["scatter"]
        assert row == [float(2 * rank), float(2 * rank + 1)]
        assert grad == [3.0] * (2 * world)
        assert c["sequence_axis"] and all(c["sequence_axis"].values()), c["sequence_axis"]


def test_without_torch_distributed_every_collective_is_the_identity():
    """A schedule written for tp=2 runs in a plain single process (a notebook, a unit test) with
    torch.distributed never initialised: every collective is the identity, nothing raises."""
    import torch
    import torch.distributed as dist

    from slapo_tune.parallel import _comm

    assert not dist.is_initialized()
    assert (_comm.group_size(None), _comm.group_rank(None)) == (1, 0)
    x = torch.randn(2, 4, 3)
    for y in (_comm.reduce_fwd(x, None), _comm.reduce_bwd(x, None), _comm.gather(x, 1, None),
              _comm.reduce_scatter(x, 1, None), _comm.scatter(x, 1, None), _comm.all_gather_tensor(x, 1, None)):
        assert y is x


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_fusion_composes_with_tensor_parallelism(suite, preset):
    world, results = suite
    for rank, res in enumerate(results):
        case = res[("fused", preset)]
        assert case["ok"], f"rank {rank} of {world}:\n{case['report']}"
