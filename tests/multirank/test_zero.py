"""ZeRO levels 0-3 and bf16 master weights: what each keeps alive, measured on real steps.

The measured side is torch's MemTracker on real CPU steps (gloo, four ranks), a tool neither the
runtime nor exact mode uses to decide anything; the closed forms are written out here from the
model's parameter count.
"""

from __future__ import annotations

import pytest
import torch

from slapo_tune.cost_model import CostModel, hardware
from slapo_tune.cost_model.measure import measure_points_rank
from slapo_tune.launch import launch
from slapo_tune.precision import MasterWeights
from slapo_tune.problem import ProblemSpec

WORLD = 4


def _spec(precision: str) -> ProblemSpec:
    # hidden 256 so that model states are a good part of the peak, as in real models
    return ProblemSpec("gpt2-tiny", WORLD, model_overrides={"n_embd": 256}, global_batch=8, seq_len=16,
                       precision=precision)


@pytest.fixture(scope="module")
def zero_steps() -> dict[str, list[tuple[dict, list[dict]]]]:
    """precision -> (point, each rank's measured step) for zero 0, 1, 2, 3 over dp=4 (one launch)."""
    specs = {p: _spec(p) for p in ("fp32", "bf16")}
    points = {p: [s.resolve().plan({"tp": 1, "pp": 1, "zero": z, "micro_batch": 1}).knobs() for z in range(4)]
              for p, s in specs.items()}
    out = {}
    for precision, spec in specs.items():
        # no timed steps: a warm-up step (it creates the optimizer state), then two tracked ones: gloo's
        # threads drop a collective's buffer a moment after it returns, so one step can count a
        # block's buffer twice on a busy machine (CI once measured +789,248 B at zero=3); the
        # smaller peak is kept, as trials keep it
        per_rank = launch(measure_points_rank, WORLD, args=(spec, points[precision], 0, 2), timeout=900)
        out[precision] = [(point, [ranks[i] for ranks in per_rank]) for i, point in enumerate(points[precision])]
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_zero_level_keeps_less_and_exact_mode_predicts_it(zero_steps, precision):
    """dp=4, two micro-batches per rank: every level below the previous one, and exact mode (a fake
    step) within 3 % of each measured peak."""
    problem = _spec(precision).resolve()
    model = CostModel(problem, hardware("cpu"))
    peaks = []
    for point, ranks in zero_steps[precision]:
        measured = max(r["total"] for r in ranks)
        predicted = model.exact(point)[0].total
        assert abs(predicted - measured) <= 0.03 * measured, (point["zero"], predicted, measured)
        peaks.append(measured)
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks


def test_each_level_gathers_and_reduces_as_often_as_zero_says():
    """dp=2, two micro-batches per rank, gpt2-tiny (4 blocks + the root: 5 units at every level).
    Level 1 keeps its units gathered and their gradients whole across the micro-batches: one
    all-gather and one reduce-scatter per unit per step. Level 2 gathers each unit once per micro-batch and
    reduce-scatters each micro-batch's gradients; level 3 also gathers every block again for its
    backward (the root stays gathered)."""
    from _zero_workers import count_collectives

    spec = ProblemSpec("gpt2-tiny", 2, global_batch=8, seq_len=16)
    problem = spec.resolve()
    points = [problem.plan({"tp": 1, "pp": 1, "zero": z, "micro_batch": 2}).knobs() for z in (1, 2, 3)]
    assert problem.plan(points[0]).accumulation == 2
    per_rank = launch(count_collectives, 2, args=(spec, points), timeout=600)
    micro_batches, units, blocks = 2, 5, 4
    expected = [{"all_gather": units, "reduce_scatter": units},
                {"all_gather": micro_batches * units, "reduce_scatter": micro_batches * units},
                {"all_gather": micro_batches * (units + blocks), "reduce_scatter": micro_batches * units}]
    assert per_rank == [expected, expected]


def test_master_weights_accumulate_in_fp32_and_publish_bf16():
    """bf16 parameters with fp32 masters: two backward passes add up in the master's fp32 gradient
    (the bf16 one is freed as soon as it is made), and publishing rounds the masters into the model."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    fp32 = torch.nn.Linear(8, 4)
    fp32.load_state_dict(layer.state_dict())
    masters = MasterWeights(layer.parameters())
    assert layer.weight.dtype == torch.bfloat16 and {m.dtype for m in masters.parameters()} == {torch.float32}
    assert torch.equal(masters.master(layer.weight), fp32.weight)  # the fp32 values, not rounded ones
    x = torch.randn(3, 8)
    for _ in range(2):
        layer(x.bfloat16()).float().sum().backward()
        fp32(x).sum().backward()
    assert layer.weight.grad is None
    grad = masters.master(layer.weight).grad
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, fp32.weight.grad, rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        masters.master(layer.weight).add_(1.0)
    masters.publish()
    assert torch.equal(layer.weight, (fp32.weight + 1.0).bfloat16())


def test_zero1_upcasts_each_blocks_bf16_gradients_as_its_backward_ends():
    """bf16 parameters, dp=2, two micro-batches per rank: ZeRO-1's bf16 gradients (``.grad`` of the
    gathered parameters, read as autograd writes them) never outgrow one block's and the root's
    (embeddings, final norm: theirs wait for the end of the backward), where one unit for the stage
    kept every block's until the backward ended (replicated master weights take each bf16 gradient
    as it is made: none stays); the losses of three steps match replicated data
    parallelism (zero=0, fp32 master weights) to bf16 rounding."""
    from _zero_workers import bf16_gradients_alive

    from slapo_tune.parallel._data_parallel import largest_module_list

    spec = ProblemSpec("gpt2-tiny", 2, model_overrides={"n_layer": 6, "vocab_size": 512}, global_batch=8,
                       seq_len=16, precision="bf16")
    problem = spec.resolve()
    points = [problem.plan({"tp": 1, "pp": 1, "zero": z, "micro_batch": 2}).knobs() for z in (1, 0)]
    assert problem.plan(points[0]).accumulation == 2
    zero_1, replicated = launch(bf16_gradients_alive, 2, args=(spec, points), timeout=600)[0]
    model = spec.model_spec.build("meta")
    _, blocks = largest_module_list(model)
    block = max(sum(p.numel() for p in b.parameters()) for b in blocks) * 2
    stage = sum(p.numel() for p in model.parameters()) * 2
    root = stage - len(blocks) * block
    assert len(blocks) == 6 and root > 0
    # one unit for the stage: every gradient bf16 until the backward ends (all the stage's bytes)
    assert block <= zero_1["peak_bf16_grads"] <= block + root < stage, (zero_1["peak_bf16_grads"], root, block)
    torch.testing.assert_close(zero_1["losses"], replicated["losses"], rtol=2e-2, atol=0)
