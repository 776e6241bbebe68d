"""Uneven pipeline stages: any ``pp`` up to the number of blocks is legal; the blocks split as
evenly as possible, the stages that hold the embedding and the head taking the fewer (as
Megatron-LM's first/last-stage layer counts); the runtime cuts those stages and verifies against
the unscheduled model; exact mode matches a measured step and the analytic model is within the
usual 10 % of exact mode on every stage; ``plan`` accepts a 126-block model at pp=16 and shows the
counts."""

import json
import re

import pytest

from slapo_tune._partition import rank_block_count, stage_block_counts, stage_boundaries
from slapo_tune.cli import main
from slapo_tune.cost_model import CostModel
from slapo_tune.cost_model.hardware import Hardware
from slapo_tune.launch import launch
from slapo_tune.problem import ProblemSpec
from slapo_tune.space import format_point

from _template_workers import verify_points

CPU = Hardware("test-cpu", 16 * 2**30, 1e10, 1e9, 1e9, 5e-5, 2, 4e-4, 2)
TOLERANCE = 0.10  # analytic peak per stage relative to exact mode's (test_cost_model_techniques)


@pytest.mark.parametrize(("layers", "pp", "counts"), [
    (126, 16, [7] + [8] * 14 + [7]),
    (4, 3, [1, 2, 1]),
    (6, 4, [1, 2, 2, 1]),
    (5, 4, [1, 1, 2, 1]),
    (7, 7, [1] * 7),
    (8, 4, [2, 2, 2, 2]),
])
def test_blocks_split_evenly_with_the_fewer_on_the_first_and_last_stages(layers, pp, counts):
    assert stage_block_counts(layers, pp) == counts
    assert [rank_block_count(layers, pp, r) for r in range(pp)] == counts


def test_every_split_is_even_within_one_block_and_the_even_cuts_are_unchanged():
    for layers in range(1, 41):
        for pp in range(1, layers + 1):
            counts = stage_block_counts(layers, pp)
            assert sum(counts) == layers and min(counts) >= 1 and max(counts) - min(counts) <= 1
            # the k short stages (if any): the first ceil(k/2) and the last floor(k/2)
            k = counts.count(min(counts)) if layers % pp else 0
            assert counts == counts[: (k + 1) // 2] + [max(counts)] * (pp - k) + counts[pp - k // 2:]
            if layers % pp == 0:  # the cuts every earlier version made
                assert stage_boundaries(layers, pp) == [(s + 1) * (layers // pp) - 1 for s in range(pp - 1)]


def _spec(model: str, world: int, template: str | None = None, **overrides) -> ProblemSpec:
    width = {"n_embd": 256} if model.startswith("gpt2") else {"hidden_size": 256}
    return ProblemSpec(model, world, model_overrides={**width, **overrides}, template=template, global_batch=8,
                       seq_len=32)


def test_the_space_offers_uneven_pp_and_interleaves_equal_chunks_or_short_ends():
    """(Megatron's split with the end stages one block short: tests/unit/test_space.py)"""
    space = _spec("gpt2-tiny", 3).resolve().space  # 4 blocks, 3 ranks: pp=3 was refused before
    assert space.legal_given("pp", {"tp": 1}) == [3]  # (pp=1: dp=3 does not divide the global batch 8)
    plan = _spec("gpt2-tiny", 3).resolve().plan("pp=3,pipeline_schedule=1f1b")
    # 4 blocks at pp=3: neither 4 nor 4 + 2 = 6 splits into 3 v chunks of a block or more
    assert plan["vpp"] == 1 and space.legal_given("vpp", plan.knobs()) == [1]
    six = _spec("llama-tiny", 4, num_hidden_layers=6).resolve().space
    assert six.legal_given("pp", {"tp": 1}) == [1, 2, 4]
    # interleaving where the chunks are equal: 8 blocks at pp=2, vpp 2 and 4
    eight = _spec("llama-tiny", 2, num_hidden_layers=8).resolve()
    assert eight.space.legal_given("vpp", eight.plan("pp=2,micro_batch=1,pipeline_schedule=1f1b").knobs()) == [1, 2, 4]


def _cases(world, model, knobs, templates, **overrides):
    out = []
    for template in templates:
        spec = ProblemSpec(model, world, model_overrides=overrides, template=template, global_batch=8, seq_len=16)
        point = spec.resolve().plan(knobs)
        out.append(((template, format_point(point)), spec, point))
    return out


def _held_blocks(result) -> set[int]:
    """The blocks whose gradients a rank compared (those its stages hold)."""
    return {int(m.group(1)) for n in result["compared"] if (m := re.search(r"\.(?:h|layers)\.(\d+)\.", n))}


@pytest.mark.parametrize("world", [3, 4])
def test_uneven_pipelines_verify_on_the_gpt2_llama_and_generic_templates(world):
    """4 blocks at pp=3 (1, 2, 1) and 6 blocks at pp=4 (1, 2, 2, 1): losses and gradients of every
    rank's stage match the unscheduled model's (the generic template on Llama: GPT-2's Conv1D
    projections are not linears it shards)."""
    layers = {"n_layer": 6} if world == 4 else {}
    cases = _cases(world, "gpt2-tiny", f"pp={world},pipeline_schedule=1f1b", ["gpt2"], **layers)
    layers = {"num_hidden_layers": 6} if world == 4 else {}
    cases += _cases(world, "llama-tiny", f"pp={world},pipeline_schedule=1f1b", ["llama", "generic"], **layers)
    results = launch(verify_points, world, args=(cases,), timeout=600)
    for key, *_ in cases:
        held = []
        for r in results:
            assert r[key]["ok"], r[key]["report"]
            assert r[key]["max_grad_error"] < 1e-4 and r[key]["loss_error"] < 1e-4
            held.append(len(_held_blocks(r[key])))
        assert held == {3: [1, 2, 1], 4: [1, 2, 2, 1]}[world], (key, held)  # the ends hold the fewer


def test_exact_mode_matches_a_measured_uneven_step_and_analytic_is_within_10_percent():
    """gpt2-tiny (4 blocks) at pp=3: stages of 1, 2 and 1 blocks. Exact mode equals torch's
    MemTracker on a real step of every rank; every stage's analytic peak is within 10 % of exact
    mode's, and the middle stage (two blocks) is the peak in all three."""
    from _memory_workers import real_steps_rank

    spec = _spec("gpt2-tiny", 3)
    point = dict(tp=1, pp=3, dp=1, zero=0, micro_batch=2, ckpt_ratio=0.0, pipeline_schedule="1f1b", attn="sdpa",
                 fuse="off")
    measured = launch(real_steps_rank, 3, args=(spec, [point]), timeout=600)
    model = CostModel(spec.resolve(), CPU)
    plan = model.problem.plan(point)
    exact = model.exact(plan)
    analytic = model.memory(plan).per_stage
    for (m,) in measured:
        assert m["total"] == exact[m["stage"]].total, (m["stage"], exact[m["stage"]].total, m["total"])
    peaks = [exact[s].total for s in range(3)]
    errors = [a / e - 1 for a, e in zip(analytic, peaks, strict=True)]
    assert max(map(abs, errors)) <= TOLERANCE, (peaks, analytic, errors)
    assert max(range(3), key=peaks.__getitem__) == max(range(3), key=analytic.__getitem__) == 1


def test_six_blocks_at_pp4_analytic_within_10_percent_of_exact_on_every_stage():
    spec = _spec("llama-tiny", 4, num_hidden_layers=6)
    model = CostModel(spec.resolve(), CPU)
    plan = model.problem.plan("pp=4,micro_batch=2,pipeline_schedule=1f1b,ckpt_ratio=0.5")
    exact = model.exact(plan)
    peaks = [exact[s].total for s in range(4)]
    analytic = model.memory(plan).per_stage
    errors = [a / e - 1 for a, e in zip(analytic, peaks, strict=True)]
    assert max(map(abs, errors)) <= TOLERANCE, (peaks, analytic, errors)


def test_interleaved_stages_with_the_ends_one_block_short_verify():
    """6 blocks at pp=2, vpp=2, Megatron-LM's split counting the embedding and the loss as a layer
    each: 8 "layers" in 4 chunks of 2, so stages of 1, 2, 2, 1 blocks. Rank 0 runs stages 0 and 2
    (blocks 0; 3, 4), rank 1 stages 1 and 3 (blocks 1, 2; 5); losses and gradients match the
    unscheduled model's (Llama with half the blocks checkpointed, GPT-2 with fused projections)."""
    knobs = "pp=2,vpp=2,micro_batch=1,pipeline_schedule=1f1b"
    cases = _cases(2, "llama-tiny", knobs + ",ckpt_ratio=0.5", ["llama"], num_hidden_layers=6)
    cases += _cases(2, "gpt2-tiny", knobs + ",fuse=on", ["gpt2"], n_layer=6)
    results = launch(verify_points, 2, args=(cases,), timeout=600)
    for key, _, point in cases:
        assert point["vpp"] == 2
        for r in results:
            assert r[key]["ok"], r[key]["report"]
            assert r[key]["max_grad_error"] < 1e-4 and r[key]["loss_error"] < 1e-4
        assert [_held_blocks(r[key]) for r in results] == [{0, 3, 4}, {1, 2, 5}], key


def test_exact_mode_matches_a_measured_step_with_short_end_chunks_and_analytic_is_within_10_percent():
    """The same split (llama-tiny, 6 blocks, pp=2, vpp=2, 8 micro-batches, half the blocks
    checkpointed): exact mode equals torch's MemTracker on a real step of both ranks, and each
    rank's analytic peak is within 10 % of exact mode's (the in-flight chunks weighted by their
    blocks: rank 0's warm-up runs its one-block chunk most)."""
    from _memory_workers import real_steps_rank

    spec = _spec("llama-tiny", 2, num_hidden_layers=6)
    point = dict(tp=1, pp=2, dp=1, zero=0, micro_batch=1, ckpt_ratio=0.5, pipeline_schedule="1f1b", vpp=2,
                 attn="sdpa", fuse="off")
    measured = launch(real_steps_rank, 2, args=(spec, [point]), timeout=600)
    model = CostModel(spec.resolve(), CPU)
    plan = model.problem.plan(point)
    assert rank_block_count(6, 2, 0, 2) == rank_block_count(6, 2, 1, 2) == 3
    exact = model.exact(plan)
    for (m,) in measured:
        assert m["total"] == exact[m["stage"]].total, (m["stage"], exact[m["stage"]].total, m["total"])
    peaks = [exact[s].total for s in range(2)]
    analytic = model.memory(plan).per_stage
    errors = [a / e - 1 for a, e in zip(analytic, peaks, strict=True)]
    assert max(map(abs, errors)) <= TOLERANCE, (peaks, analytic, errors)


LLAMA_405B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16384,
              "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "bos_token_id": 128000, "eos_token_id": 128001}


def test_plan_accepts_126_blocks_at_pp16_and_shows_the_stage_counts(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_405B))
    argv = ["plan", "--model", str(tmp_path), "--world-size", "8192", "--seq-len", "8192", "--global-batch", "2048",
            "--knobs", "tp=8,pp=16,sp=on,zero=1,ckpt_ratio=1.0,pipeline_schedule=1f1b", "--memory-budget", "80GiB",
            "--hardware", "h100-80gb"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "blocks per stage: 7, 8 x14, 7" in out, out
    assert main([*argv, "--json"]) == 0
    top = json.loads(capsys.readouterr().out)["top"][0]
    assert top["stage_blocks"] == [7] + [8] * 14 + [7] and top["point"]["pp"] == 16


def test_the_schedule_file_records_the_stage_counts_and_loading_checks_them():
    """A schedule of gpt2-tiny at pp=3 (world 3) loads; its layout records 1, 2, 1 blocks, and a
    file whose counts are not the cuts this version makes is refused in one line."""
    from slapo_tune import UsageError
    from slapo_tune._partition import rank_block_counts
    from slapo_tune.apply import load_schedule
    from slapo_tune.models import config_fingerprint
    from slapo_tune.schedule_file import make_schedule

    problem = ProblemSpec("gpt2-tiny", 3, global_batch=6, seq_len=16).resolve()
    plan = problem.plan("pp=3,pipeline_schedule=1f1b")
    schedule = make_schedule(template=problem.template.record(), plan=plan, world_size=3, global_batch=6, seq_len=16,
                             precision="fp32", device="cpu", stage_blocks=rank_block_counts(4, plan.pp),
                             model={"name": "gpt2-tiny", "fingerprint": config_fingerprint(problem.config)})
    assert schedule["layout"]["stage_blocks"] == [1, 2, 1]
    assert load_schedule(schedule).plan["pp"] == 3
    schedule["layout"]["stage_blocks"] = [2, 1, 1]  # earlier stages took the remainder
    with pytest.raises(UsageError, match=r"stages hold \[2, 1, 1\] blocks but this slapo-tune cuts \[1, 2, 1\]"):
        load_schedule(schedule)


def test_verify_cli_names_each_stages_block_count(capsys):
    assert main(["verify", "--model", "gpt2-tiny", "--world-size", "3", "--knobs", "pp=3", "--global-batch", "6",
                 "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    for line in ("rank 0 (stage 0, 1 block): loss", "rank 1 (stage 1, 2 blocks): loss", "rank 2 (stage 2, 1 block): loss"):
        assert line in out, out
    assert out.endswith("verify: OK\n")
