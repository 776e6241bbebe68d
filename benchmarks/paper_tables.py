"""The cost model against published tables (nothing runs: these are clusters we do not have).

1. **ZeRO** (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
   Models", Figure 1 / §5): model states of a 7.5B-parameter model on 64 data-parallel ranks with
   mixed-precision Adam, 120 / 31.4 / 16.6 / 1.9 GB at stages 0-3 (``(2 + 2 + 12) Psi``,
   ``4 Psi + 12 Psi / N``, ``2 Psi + 14 Psi / N``, ``16 Psi / N``). Beside them, what our ZeRO levels
   hold (:mod:`slapo_tune.parallel._data_parallel`, FSDP2 for levels 1-3) for Megatron-LM's 7.5B GPT (36
   layers, hidden 4096): the model states as the paper defines them (parameters, gradients,
   optimizer states; temporary buffers are "residual states", apart) at their largest over the
   analytic model's moments of a step. Parameters gathered for longer than one unit's compute
   (levels 1-2 keep them from forward to backward) are model states; level 3's one gathered block,
   a gradient before its reduce-scatter, the collectives' buffers and autocast's weight copies are
   buffers. ``bf16`` (16-bit parameters and gradients, fp32 master weights and Adam moments) is the
   paper's mixed-precision layout; unsharded, it accumulates gradients in fp32 (18 B/parameter,
   not 16). ``amp-bf16`` keeps fp32 parameters and gradients: 16 B/parameter unsharded too. Our
   level 1 keeps gradients whole only while it accumulates micro-batches and reduce-scatters them
   block by block as the last micro-batch's backward goes: at the paper's one micro-batch it holds
   stage 2's model states, not the paper's stage 1 (``4 Psi + 12 Psi / N``).
2. **Activations per layer** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
   Transformer Models", Table 2) for GPT-3 175B (s 2048, h 12288, 96 heads, micro-batch 1, tp 8): no
   parallelism, tensor parallelism, tensor + sequence parallelism, selective and full recomputation,
   beside exact mode (a fake bf16 step of the model cut to 4 and 8 layers: the difference of the
   most activations alive at once, at the end of the forward, per layer) and the analytic model's count. Megatron counts its own
   fused kernels; ours are Hugging Face's GPT-2 blocks under bf16 autocast.
3. **Throughput** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
   Clusters using Megatron-LM", Table 1): per-GPU TFLOP/s of GPT models from 1.7B to 1T parameters on
   A100s at their published layouts (full recomputation, micro-batch 1, sequence 2048, the unfused
   attention core of the time: ``attn=eager``), against
   the analytic time model's prediction on the ``a100-80gb`` preset, uncalibrated (FLOPs counted as
   the paper counts them: ``96 B s L h^2 (1 + s / 6h + V / 16 L h)``); and where ``plan`` ranks the
   published layout among every point of the space that fits 80 GB.

Run: ``python -m benchmarks.paper_tables [--quick]``; writes ``results/benchmarks/paper_tables.json``
and ``python -m benchmarks`` puts its section into ``REPORT.md`` (:func:`report_section`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks._stats import isolated_cache, publish  # noqa: E402

GB = 1e9
VOCAB, SEQ = 51200, 2048

# Narayanan et al. 2021, Table 1: (billions of parameters, heads, hidden, layers, tp, pp, GPUs,
# global batch, achieved TFLOP/s per GPU)
MEGATRON_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
QUICK_ROWS = (0, 3, 9)  # 1.7B, 18.4B, 1T
# the attention core those runs had: unfused (QK^T and AV as batched GEMMs, the scores written out,
# Megatron's fused scale-mask-softmax kernel between them); FlashAttention came a year later (2022)
MEGATRON_2021_ATTN = "eager"

# Rajbhandari et al. 2020: 7.5B parameters, 64 ranks, mixed-precision Adam (K = 12)
ZERO_PSI, ZERO_RANKS = 7.5e9, 64
ZERO_PUBLISHED_GB = (120.0, 31.4, 16.6, 1.9)
# the ZeRO paper's model states (the rest of the memory terms are activations or buffers);
# "gathered" parameters count at levels 0-2 only (see the module's docstring)
ZERO_STATE_TERMS = ("weights", "master", "optimizer", "gradients", "gradients_single")

# Korthikanti et al. 2022, Table 2, for GPT-3 175B at tp 8: (label, knobs, formula arguments)
ACTIVATION_CASES = (
    ("no parallelism", dict(tp=1), dict(tp=1)),
    ("tensor parallel", dict(tp=8), dict(tp=8)),
    ("tensor + sequence parallel", dict(tp=8, sp="on"), dict(tp=8, sp=True)),
    ("tp + sp + selective recompute", dict(tp=8, sp="on", ckpt_ratio=1.0, ckpt_policy="selective"),
     dict(tp=8, sp=True, recompute="selective")),
    ("tp + sp + full recompute", dict(tp=8, sp="on", ckpt_ratio=1.0), dict(tp=8, sp=True, recompute="full")),
)


def zero_paper_bytes(psi: float, level: int, ranks: int) -> float:
    """Model-state bytes per rank of ZeRO stage ``level`` (the paper's closed forms, K = 12)."""
    return (16 * psi, 4 * psi + 12 * psi / ranks, 2 * psi + 14 * psi / ranks, 16 * psi / ranks)[level]


def _gpt_spec(layers: int, hidden: int, heads: int, world: int, global_batch: int, precision: str = "bf16"):
    from slapo_tune.problem import ProblemSpec

    return ProblemSpec("gpt3-175b", world, model_overrides={"n_layer": layers, "n_embd": hidden, "n_head": heads},
                       seq_len=SEQ, global_batch=global_batch, precision=precision, device="cuda")


def zero_model_states(model, point: dict) -> tuple[float, str]:
    """(bytes, moment): the largest sum of the ZeRO paper's model states over the analytic
    model's moments of a step on stage 0 (weighted as the model weighs them)."""
    from slapo_tune.cost_model.analytic import stage_builder

    stage = stage_builder(model.layout, point, model.workload, model.backend)(0)
    weights = model._weights()
    terms = ZERO_STATE_TERMS + (("gathered",) if point["zero"] < 3 else ())
    totals = {moment: sum(weights[k] * v for k, v in alive.items() if k in terms)
              for moment, alive in stage.events.items()}
    moment = max(totals, key=totals.get)
    return totals[moment], moment


def zero_table() -> dict:
    """Section 1: the paper's figures at 7.5B, ours for Megatron's 7.5B GPT (per parameter x 7.5B too)."""
    from slapo_tune.cost_model import CostModel, hardware

    hw = hardware("a100-80gb")
    rows = []
    for precision in ("amp-bf16", "bf16"):
        problem = _gpt_spec(36, 4096, 32, ZERO_RANKS, ZERO_RANKS, precision).resolve()
        model = CostModel(problem, hw)
        psi = model.layout.parameters
        for level in range(4):
            point = problem.plan(dict(tp=1, pp=1, dp=ZERO_RANKS, zero=level, micro_batch=1)).knobs()
            ours, moment = zero_model_states(model, point)
            paper = zero_paper_bytes(psi, level, ZERO_RANKS)
            rows.append({"precision": precision, "level": level, "parameters": psi,
                         "published_gb": ZERO_PUBLISHED_GB[level], "paper_formula_gb": paper / GB,
                         "ours_gb": ours / GB, "moment": moment, "error": ours / paper - 1})
    return {"rows": rows}


def activation_table(cases: tuple[str, ...] | None = None) -> dict:
    """Section 2: per layer, per rank, GPT-3 175B at micro-batch 1 (bf16 parameters: 2-byte activations
    and no autocast copies of the weights, which exact mode would count as activations); ``cases``
    picks some of :data:`ACTIVATION_CASES` by label (all when None)."""
    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.cost_model.analytic import block_activations, megatron_activation_bytes

    hw = hardware("a100-80gb")
    h, a = 12288, 96
    rows = []
    for label, knobs, formula in ACTIVATION_CASES:
        if cases is not None and label not in cases:
            continue
        tp = knobs["tp"]
        per = {}
        for layers in (4, 8):
            problem = _gpt_spec(layers, h, a, tp, 1, "bf16").resolve()
            point = problem.plan(dict(pp=1, dp=1, zero=0, micro_batch=1, attn="sdpa", fuse="off", **knobs)).knobs()
            model = CostModel(problem, hw)
            t0 = time.perf_counter()
            per[layers] = (model.exact(point)[0].most_activations, time.perf_counter() - t0)
            if layers == 8:
                acts = block_activations(model.layout, point, problem.workload)
                checkpointed = knobs.get("ckpt_policy", "full") if knobs.get("ckpt_ratio") else None
                analytic = acts.kept(checkpointed)
        exact = (per[8][0] - per[4][0]) / 4
        published = megatron_activation_bytes(SEQ, 1, h, a, **formula)
        rows.append({"case": label, "knobs": knobs, "megatron_gb": published / GB, "exact_gb": exact / GB,
                     "analytic_gb": analytic / GB, "exact_over_megatron": exact / published,
                     "analytic_error_vs_exact": analytic / exact - 1 if exact else None,
                     "exact_seconds": per[4][1] + per[8][1]})
    return {"rows": rows}


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one step with full recomputation, as Narayanan et al. 2021 (§5.1) count them."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def throughput_table(rows: tuple[int, ...], rank: bool) -> dict:
    """Section 3: predicted per-GPU TFLOP/s at the published layouts; with ``rank``, where ``plan``
    puts each published layout among every point that fits 80 GB."""
    from slapo_tune.cost_model import CostModel, hardware

    hw = hardware("a100-80gb")
    out = []
    for index in rows:
        params, heads, hidden, layers, tp, pp, gpus, batch, published = MEGATRON_TABLE_1[index]
        problem = _gpt_spec(layers, hidden, heads, gpus, batch).resolve()
        model = CostModel(problem, hw)
        point = problem.plan(dict(tp=tp, pp=pp, dp=gpus // (tp * pp), zero=0, micro_batch=1, ckpt_ratio=1.0,
                                  pipeline_schedule="1f1b", attn=MEGATRON_2021_ATTN, fuse="on"))
        step = model.time(point).step
        predicted = megatron_flops(batch, layers, hidden) / step / gpus / 1e12
        row = {"parameters_b": params, "layout": f"tp={tp},pp={pp},dp={gpus // (tp * pp)}", "gpus": gpus,
               "batch": batch, "published_tflops": published, "predicted_tflops": predicted,
               "error": predicted / published - 1, "mfu": model.mfu(step, gpus)}
        if rank:
            row.update(_plan_rank(problem, model, point.knobs()))
        out.append(row)
    return {"rows": out}


def _plan_rank(problem, model, published: dict) -> dict:
    """``plan``'s best point for the problem and the published layout's predicted throughput against it."""
    from slapo_tune.cost_model.ranking import rank_points

    t0 = time.perf_counter()
    found = rank_points(model, problem, 80 * 2**30, 1)
    seconds = time.perf_counter() - t0
    best = found.rows[0]
    mine = model.time(problem.plan(published)).throughput(problem.workload)
    return {"plan_best": best["point"], "plan_best_throughput": best["throughput"],
            "published_over_best": mine / best["throughput"], "plan_points": found.points,
            "plan_seconds": seconds}


def run(quick: bool) -> dict:
    isolated_cache()
    t0 = time.perf_counter()
    data = {"zero": zero_table(), "activations": activation_table(),
            "throughput": throughput_table(QUICK_ROWS if quick else tuple(range(len(MEGATRON_TABLE_1))),
                                           rank=not quick)}
    errors = [abs(r["error"]) for r in data["throughput"]["rows"]]
    data["summary"] = {"throughput_median_abs_error": statistics.median(errors), "throughput_max_abs_error": max(errors),
                       "seconds": time.perf_counter() - t0}
    return data


def report_section(data: dict) -> list[str]:
    """The benchmark's section of ``REPORT.md``."""
    lines = ["## Published tables: ZeRO, activation memory, Megatron-LM throughput", "",
             "Sources: Rajbhandari et al. 2020 (ZeRO, §5 / Figure 1); Korthikanti et al. 2022 (Table 2); "
             "Narayanan et al. 2021 (Table 1). Nothing runs: exact mode is a fake step; the rest is the "
             "analytic model, uncalibrated, on the a100-80gb preset.", "",
             "### ZeRO: model states per rank, 7.5B parameters on 64 ranks (GB)", "",
             "| precision | stage | published | paper's formula (our Psi) | ours, largest over the step (err) | "
             "at |", "|---|---|---|---|---|---|"]
    for r in data["zero"]["rows"]:
        lines.append(f"| {r['precision']} | {r['level']} | {r['published_gb']:.1f} | {r['paper_formula_gb']:.1f} | "
                     f"{r['ours_gb']:.1f} ({r['error']:+.1%}) | {r['moment']} |")
    lines += ["", "Model states as the paper counts them: parameters (and gathered copies kept beyond one unit), "
              "gradients, optimizer states; bf16 is the paper's layout (stage 0: fp32 gradient accumulation, "
              "18 B/parameter; stage 1: gradients reduce-scattered block by block at one micro-batch, so stage 2's "
              "states)."]
    lines += ["", "### Activations per layer, GPT-3 175B, micro-batch 1, per rank (GB)", "",
              "| case | Megatron's formula | exact (fake step) | analytic (err vs exact) |", "|---|---|---|---|"]
    for r in data["activations"]["rows"]:
        err = f"{r['analytic_error_vs_exact']:+.1%}" if r["analytic_error_vs_exact"] is not None else "-"
        lines.append(f"| {r['case']} | {r['megatron_gb']:.3f} | {r['exact_gb']:.3f} | {r['analytic_gb']:.3f} ({err}) |")
    lines += ["", "### Per-GPU throughput at Megatron-LM's published layouts (A100, TFLOP/s)", "",
              "| model | layout | GPUs | published | predicted (err) | MFU | plan's best / published's predicted |",
              "|---|---|---|---|---|---|---|"]
    for r in data["throughput"]["rows"]:
        ranked = f"{1 / r['published_over_best']:.2f}x ({r['plan_seconds']:.1f} s)" if "plan_best" in r else "-"
        lines.append(f"| {r['parameters_b']}B | {r['layout']} | {r['gpus']} | {r['published_tflops']} | "
                     f"{r['predicted_tflops']:.0f} ({r['error']:+.0%}) | {r['mfu']:.0%} | {ranked} |")
    s = data["summary"]
    lines += ["", f"Throughput error: median {s['throughput_median_abs_error']:.0%}, max "
              f"{s['throughput_max_abs_error']:.0%}.", ""]
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three throughput rows, no plan ranking")
    args = parser.parse_args(argv)
    data = run(args.quick)
    return publish("paper_tables", data, report_section(data))


if __name__ == "__main__":
    main()
