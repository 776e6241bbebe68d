"""Whether an FSDP makes the host wait once per unit (``cost_model.FsdpHost``): the facts it rests on,
read from the pinned torch's own source, and what the time model charges for each."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from slapo_tune.cost_model import (
    OUR_RUNTIME,
    CostModel,
    FsdpHost,
    GradAccumulation,
    Hardware,
    Runtime,
    hardware,
)
from slapo_tune.problem import ProblemSpec


def _calls_synchronize(function) -> bool:
    """Whether ``function``'s body calls a ``.synchronize()`` (a host wait on a CUDA event or stream)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "synchronize"
               for node in ast.walk(tree))


def test_fsdp1s_rate_limiter_waits_on_the_host_and_fsdp2s_unit_path_never_does():
    """FSDP1's ``_unshard`` synchronizes the host on a free event when ``limit_all_gathers`` is set
    (WAITS_PER_UNIT); FSDP2's per-unit path (unshard, its wait, the forward and backward hooks, the
    collectives) calls no ``synchronize`` (RUNS_AHEAD: our runtime's ZeRO levels)."""
    from torch.distributed.fsdp import _runtime_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group

    assert _calls_synchronize(_runtime_utils._unshard)
    assert "limit_all_gathers" in inspect.getsource(_runtime_utils._unshard)
    group = _fsdp_param_group.FSDPParamGroup
    per_unit = [group.unshard, group.wait_for_unshard, group.pre_forward, group.post_forward, group.pre_backward,
                group.post_backward, _fsdp_collectives.foreach_all_gather, _fsdp_collectives.foreach_reduce]
    assert [f.__qualname__ for f in per_unit if _calls_synchronize(f)] == []


@pytest.fixture(scope="module")
def llama():
    return ProblemSpec("llama3-8b", 8, model_overrides={"num_hidden_layers": 4}, seq_len=2048, global_batch=32,
                       precision="bf16", device="cuda").resolve()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_only_an_fsdp_that_waits_per_unit_pays_the_hosts_per_block_time(llama, zero):
    """On a GPU, ZeRO-2 and 3 (a unit per block) under WAITS_PER_UNIT pay ``overhead_per_layer`` per
    block and micro-batch; RUNS_AHEAD (the default: our FSDP2) pays nothing, nor does any level
    without units that free; every other term is the same under both."""
    hw = hardware("h100-80gb")
    point = llama.plan(dict(tp=1, pp=1, zero=zero, micro_batch=2, ckpt_ratio=0.0))
    ahead, waits = CostModel(llama, hw), CostModel(llama, hw, runtime=Runtime(fsdp_host=FsdpHost.WAITS_PER_UNIT))
    assert ahead.runtime.fsdp_host is FsdpHost.RUNS_AHEAD
    a, w = ahead.time(point).breakdown, waits.time(point).breakdown
    micro_batches = 32 // (8 * 2)
    expected = 4 * micro_batches * hw.overhead_per_layer if zero >= 2 else 0.0
    assert a["overhead"] == 0.0
    assert w["overhead"] == pytest.approx(expected)
    assert {k: v for k, v in a.items() if k != "overhead"} == {k: v for k, v in w.items() if k != "overhead"}
    # the array path plan ranks with says the same as the point-by-point one
    for model in (ahead, waits):
        assert float(model.throughputs([point])[0]) == pytest.approx(model.time(point).throughput(llama.workload))


def test_a_cpu_pays_its_per_block_time_whatever_the_fsdp(llama):
    """A CPU rank is its own device: the host's per-block time is on the critical path either way."""
    from slapo_tune.cost_model.analytic import time_terms

    cpu = Hardware("cpu", memory=2**34, flops=1e11, intra_bandwidth=1e9, inter_bandwidth=1e9, cores=2,
                   overhead_per_layer=4e-4)
    point = llama.plan(dict(tp=1, pp=1, zero=3, micro_batch=2, ckpt_ratio=0.0))
    terms = {host: time_terms(CostModel(llama, cpu).layout, point, llama.workload, cpu,
                              runtime=Runtime(fsdp_host=host))["overhead"] for host in FsdpHost}
    assert terms[FsdpHost.RUNS_AHEAD] == terms[FsdpHost.WAITS_PER_UNIT] > 0


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_runtime_accumulating_in_its_gemms_pays_no_accumulation_pass(llama, zero):
    """Our runtime (autograd's AccumulateGrad) pays a pass over the stage's gradients per
    micro-batch; a runtime whose weight-gradient GEMMs accumulate (Megatron's
    gradient_accumulation_fusion) pays none, and every other term is the same. A data file's
    string names the setting; a misspelt one is refused."""
    hw = hardware("h100-80gb")
    point = llama.plan(dict(tp=1, pp=1, zero=zero, micro_batch=1, ckpt_ratio=0.0))
    ours = CostModel(llama, hw)
    fused = CostModel(llama, hw, runtime=Runtime(grad_accumulation="in-gemm"))
    assert ours.runtime == OUR_RUNTIME and fused.runtime.grad_accumulation is GradAccumulation.IN_GEMM
    a, f = ours.time(point).breakdown, fused.time(point).breakdown
    assert a["grad_accumulation"] > 0 == f["grad_accumulation"]
    assert {k: v for k, v in a.items() if k != "grad_accumulation"} == \
        {k: v for k, v in f.items() if k != "grad_accumulation"}
    assert float(fused.throughputs([point])[0]) == pytest.approx(fused.time(point).throughput(llama.workload))
    with pytest.raises(ValueError, match="in_gemm"):
        Runtime(grad_accumulation="in_gemm")
