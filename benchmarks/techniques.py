"""Sequence parallelism, selective recomputation, the interleaved pipeline, the vocabulary-parallel
loss and context parallelism, side by side.

On CPU ranks (world 4, gloo, one thread each), a GPT-2-shaped and a Llama-shaped workload (the tiny
presets widened to hidden 256, sequences of 128 tokens, so that activations dominate). Ten
points each: tp=2 with ``sp`` off / on and ``loss_parallel`` on; checkpointing none / every block
``full`` / every block ``selective``; pp=2 with ``vpp`` 1 / 2 at the same 4 micro-batches; cp=2
(against cp=1, "ckpt none") and cp=2 x tp=2 with sp and the vocabulary-parallel loss. For every point:

- its measured peak memory per rank (torch's MemTracker, through
  :func:`slapo_tune.cost_model.measure.measure_points_rank` as ``benchmarks.record_grid`` uses it)
  next to the cost model's exact and analytic predictions;
- for the one-stage points, what one block keeps per micro-batch, measured around each block's
  forward with torch's MemTracker, next to the analytic model's count and Megatron's formula
  (Korthikanti et al. 2022) evaluated for the model, and their ratio;
- its step time, the points alternated step by step in one launch (median and quartiles),
  with the ratios sp on / off, selective / none, full / none and vpp=2 / vpp=1 next to the
  analytic model's, and the pipeline bubble the formulas give.

Run: ``python -m benchmarks.techniques [--rounds N] [--models gpt2,llama] [--quick]``; writes
``results/benchmarks/techniques.json``, and ``python -m benchmarks`` puts its section into
``REPORT.md`` (:func:`report_section`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks._stats import (  # noqa: E402
    RECORDED_CPU,
    alternate,
    isolated_cache,
    median_iqr,
    publish,
    ratio_summary,
)

WORLD, GLOBAL_BATCH, SEQ = 4, 16, 128
# preset, widening: GPT-2 with 4 heads of 64 and a 4h MLP (as Megatron's formula assumes); Llama
# with 8 heads of 32, 4 KV heads and a gated MLP 8h/3 wide. The tiny presets have no dropout.
WORKLOADS = {
    "gpt2": ("gpt2-tiny", {"n_embd": 256}),
    "llama": ("llama-tiny", {"hidden_size": 256, "head_dim": 32, "intermediate_size": 688}),
}
BASE = dict(tp=1, cp=1, sp="off", loss_parallel="off", pp=1, zero=0, micro_batch=4, ckpt_ratio=0.0, ckpt_policy="full",
            pipeline_schedule="1f1b", vpp=1, attn="sdpa", fuse="off")
POINTS = {
    "tp2 sp=off": dict(tp=2),
    "tp2 sp=on": dict(tp=2, sp="on"),
    "ckpt none": dict(),
    "ckpt full": dict(ckpt_ratio=1.0),
    "ckpt selective": dict(ckpt_ratio=1.0, ckpt_policy="selective"),
    "pp2 vpp=1": dict(pp=2, micro_batch=2),
    "pp2 vpp=2": dict(pp=2, vpp=2, micro_batch=2),
    "tp2 loss_parallel=on": dict(tp=2, loss_parallel="on"),
    "cp2": dict(cp=2),
    "cp2 tp2 sp lp": dict(cp=2, tp=2, sp="on", loss_parallel="on"),
}
# (numerator, denominator) of the step-time and memory ratios reported
RATIOS = (("tp2 sp=on", "tp2 sp=off"), ("ckpt selective", "ckpt none"), ("ckpt full", "ckpt none"),
          ("ckpt full", "ckpt selective"), ("pp2 vpp=2", "pp2 vpp=1"),
          ("tp2 loss_parallel=on", "tp2 sp=off"), ("cp2", "ckpt none"))
MB = 2**20


def _points() -> dict[str, dict]:
    out = {}
    for name, knobs in POINTS.items():
        point = {**BASE, **knobs}
        point["dp"] = WORLD // (point["tp"] * point["pp"] * point["cp"])
        out[name] = point
    return out


def _spec(workload: str):
    from slapo_tune.problem import ProblemSpec

    preset, widen = WORKLOADS[workload]
    return ProblemSpec(preset, WORLD, model_overrides=widen, global_batch=GLOBAL_BATCH, seq_len=SEQ)


def _block_bytes(session) -> float:
    """What one block keeps per micro-batch on this rank: torch's MemTracker's live bytes after
    each block's forward less before it (what the block keeps for backward, and its output, the
    next block's input), on one micro-batch of a training-mode forward, the median over the
    blocks between the first and the last (those also scatter / gather the sequence under sp)."""
    import torch

    from slapo_tune.memory import StepMemTracker

    stage, step = session.stage, session.step
    model = stage.model
    blocks = list(model.get_submodule(session.problem.template.blocks_path(model)))
    ids, _ = step.local_batch(session.synthetic_batch())
    micro = ids.chunk(step.n_microbatches)[0]
    tracker = StepMemTracker()
    tracker.track_external(stage)  # known storages: views forward takes of the weights (W^T) are not new
    device = torch.device(session.device)
    deltas: list[int] = []
    before: list[int] = []

    def live() -> int:
        return tracker.get_tracker_snapshot("current").get(device, {}).get("Total", 0)

    hooks = [b.register_forward_pre_hook(lambda *_: before.append(live())) for b in blocks]
    hooks += [b.register_forward_hook(lambda *_: deltas.append(live() - before.pop())) for b in blocks]
    try:
        with tracker, step.compute_context():
            out = stage(micro)
            del out
    finally:
        for h in hooks:
            h.remove()
    inner = deltas[1:-1] if len(deltas) > 2 else deltas
    return float(statistics.median(inner))


def _rank(ctx, spec, points: dict[str, dict], rounds: int, warmup: int, tracked: int) -> dict:
    import torch.distributed as dist

    from slapo_tune.cost_model.measure import measure_points_rank
    from slapo_tune.session import Session

    # peak memory, point by point, as the recorded grids measure it
    memory = measure_points_rank(ctx, spec, list(points.values()), timed_steps=0, tracked_steps=tracked)
    problem = spec.resolve()
    sessions = {name: Session(problem, problem.plan(point), seed=0, device=ctx.device)
                for name, point in points.items()}
    per_block = {}
    for name, session in sessions.items():
        if session.plan.pp == 1 and session.plan.cp == 1:  # (Megatron's formula: whole sequences)
            per_block[name] = _block_bytes(session)
        dist.barrier()
    batches = {name: s.synthetic_batch() for name, s in sessions.items()}
    variants = {name: (lambda s=s, b=batches[name]: float(s.train_step(b))) for name, s in sessions.items()}
    times = alternate(variants, rounds, warmup=warmup, sync=dist.barrier)
    return {"rank": ctx.rank, "memory": dict(zip(points, memory)), "per_block": per_block, "times": times}


# The bubble where it costs: one rank per core (world 2 on 2 cores, pp=2), a model whose micro-batch
# compute dwarfs a stage call's fixed cost (the world-4 points above share 2 cores among 4 ranks,
# where a rank waiting in the bubble lends its core to the others)
BUBBLE_MODEL = ("gpt2-tiny", {"n_embd": 768, "n_layer": 8})
BUBBLE_GLOBAL_BATCH, BUBBLE_MICRO_BATCH = 16, 4  # 4 micro-batches over pp=2
BUBBLE_POINTS = {"vpp=1 1f1b": dict(vpp=1), "vpp=2 1f1b": dict(vpp=2), "vpp=2 zb": dict(vpp=2, pipeline_schedule="zb")}


def _bubble_rank(ctx, spec, points: dict[str, dict], rounds: int, warmup: int) -> dict:
    import torch.distributed as dist

    from slapo_tune.session import Session

    problem = spec.resolve()
    sessions = {name: Session(problem, problem.plan(point), seed=0, device=ctx.device) for name, point in points.items()}
    batches = {name: s.synthetic_batch() for name, s in sessions.items()}
    variants = {name: (lambda s=s, b=batches[name]: float(s.train_step(b))) for name, s in sessions.items()}
    return alternate(variants, rounds, warmup=warmup, sync=dist.barrier)


def bubble(rounds: int, warmup: int) -> dict:
    """Step times of pp=2 with vpp 1 and 2 (interleaved 1F1B, zero bubble) side by side, one rank
    per core; the ideal ratio is (m + (pp-1)/vpp) / (m + pp - 1) slots."""
    from slapo_tune.launch import launch
    from slapo_tune.problem import ProblemSpec

    preset, widen = BUBBLE_MODEL
    spec = ProblemSpec(preset, 2, model_overrides=widen, global_batch=BUBBLE_GLOBAL_BATCH, seq_len=SEQ)
    points = {name: {"pp": 2, "micro_batch": BUBBLE_MICRO_BATCH, "pipeline_schedule": "1f1b", **knobs}
              for name, knobs in BUBBLE_POINTS.items()}
    times = launch(_bubble_rank, 2, args=(spec, points, rounds, warmup), timeout=3600, threads_per_rank=1)[0]
    m = BUBBLE_GLOBAL_BATCH // BUBBLE_MICRO_BATCH
    base = "vpp=1 1f1b"
    out = {"model": {"preset": preset, "overrides": widen}, "microbatches": m, "rounds": rounds, "rows": {}}
    for name in points:
        ratios = [t / b for t, b in zip(times[name], times[base])]
        med, lo, hi = median_iqr(ratios)
        vpp = points[name]["vpp"]
        out["rows"][name] = {"step_median": statistics.median(times[name]), "ratio_median": med, "ratio_p25": lo,
                             "ratio_p75": hi, "ideal": (m + 1 / vpp) / (m + 1)}
    return out


def _predictions(workload: str, points: dict[str, dict]) -> dict:
    """Exact and analytic peaks per stage, the analytic step time, and per block: the analytic
    count and Megatron's formula for the model."""
    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.cost_model.analytic import (
        block_activations,
        flights,
        megatron_activation_bytes,
        pipeline_bubble,
    )

    problem = _spec(workload).resolve()
    model = CostModel(problem, hardware("cpu"))
    layout, wl = model.layout, problem.workload
    out = {}
    for name, knobs in points.items():
        plan = problem.plan(knobs)
        t0 = time.perf_counter()
        exact = model.exact(plan)
        exact_seconds = time.perf_counter() - t0
        analytic = model.memory(plan)
        timing = model.time(plan)
        recompute = "none" if not plan.ckpt_ratio else plan.ckpt_policy
        row = {
            "exact": [exact[s].total for s in sorted(exact)], "exact_seconds": exact_seconds,
            "analytic": analytic.per_stage, "time": timing.step, "time_breakdown": timing.breakdown,
            "microbatches": plan.accumulation,
            "in_flight_rank0": flights(plan, 0, plan.accumulation)[0] if plan.pp > 1 else 1,
            "bubble": pipeline_bubble(plan.pp, plan.accumulation, plan.vpp) if plan.pp > 1 else 0.0,
        }
        if plan.pp == 1 and plan.cp == 1:
            row["block_analytic"] = block_activations(layout, plan, wl).kept(None if recompute == "none" else recompute)
            # one micro-batch of one data-parallel replica; Megatron's 2-byte activations
            row["block_megatron"] = megatron_activation_bytes(wl.seq_len, plan.micro_batch, layout.hidden, layout.heads,
                                                              plan.tp, plan.sp == "on", recompute)
        out[name] = row
    shape = dict(layers=layout.layers, hidden=layout.hidden, heads=layout.heads, kv_heads=layout.kv_heads,
                 head_dim=layout.head_dim, intermediate=layout.intermediate, vocab=layout.vocab,
                 token_bytes=layout.token_bytes)
    return {"points": out, "shape": shape}


def _summarise(workload: str, points: dict[str, dict], predicted: dict, per_rank: list[dict]) -> dict:
    rows = {}
    for name, point in points.items():
        p = predicted["points"][name]
        measured: dict[int, int] = {}
        for r in per_rank:
            m = r["memory"][name]
            measured[m["stage"]] = max(measured.get(m["stage"], 0), m["total"])
        stages = sorted(measured)
        worst = max(stages, key=lambda s: measured[s])
        times = per_rank[0]["times"][name]
        med, p25, p75 = median_iqr(times)
        row = {
            "point": point, "measured": [measured[s] for s in stages], "exact": p["exact"],
            "analytic": p["analytic"], "worst_stage": worst,
            "exact_error": max(abs(e / m - 1) for e, m in zip(p["exact"], (measured[s] for s in stages))),
            "analytic_error": max(abs(a / m - 1) for a, m in zip(p["analytic"], (measured[s] for s in stages))),
            "step_median": med, "step_p25": p25, "step_p75": p75, "steps": len(times),
            "time_predicted": p["time"], "bubble": p["bubble"], "in_flight_rank0": p["in_flight_rank0"],
            "microbatches": p["microbatches"],
        }
        if "block_megatron" in p:
            blocks = [r["per_block"][name] for r in per_rank if name in r["per_block"]]
            row.update(block_measured=statistics.median(blocks), block_analytic=p["block_analytic"],
                       block_megatron=p["block_megatron"])
            row["block_vs_megatron"] = row["block_measured"] / p["block_megatron"]
        rows[name] = row
    times = per_rank[0]["times"]
    ratios = {}
    for num, den in RATIOS:
        summary = ratio_summary(times, num, den)
        ratios[f"{num} / {den}"] = {
            **summary,
            "predicted_time": rows[num]["time_predicted"] / rows[den]["time_predicted"],
            "measured_memory": max(rows[num]["measured"]) / max(rows[den]["measured"]),
            "predicted_memory": max(rows[num]["analytic"]) / max(rows[den]["analytic"]),
        }
    return {"rows": rows, "ratios": ratios, "shape": predicted["shape"], "spec": dict(zip(
        ("preset", "overrides"), WORKLOADS[workload]))}


def _fmt_mb(x: float) -> str:
    return f"{x / MB:.1f}"


def report_section(data: dict) -> list[str]:
    """The benchmark's section of ``REPORT.md``: tables and the text that reads them."""
    cfg = data["config"]
    lines = ["## Techniques side by side: sequence parallelism, selective recomputation, interleaving, "
             "vocabulary-parallel loss, context parallelism", "",
             f"CPU, world {cfg['world']} (gloo, one thread per rank on {cfg['cores']} cores), global batch "
             f"{cfg['global_batch']}, {cfg['seq']} tokens a sequence, {cfg['rounds']} timed rounds (the {len(POINTS)} "
             "points alternated step by step in one launch, shuffled per round). Peak memory: the worst rank, "
             "measured by torch's MemTracker; exact and analytic: the cost model's predictions of it (error: "
             "the worst stage). Step time: median (p25-p75) over the rounds; predicted: the analytic time model "
             "(the recorded CPU's description, uncalibrated).", ""]
    for workload, w in data["workloads"].items():
        shape = w["shape"]
        lines += [f"### {workload} (`{w['spec']['preset']}` with {w['spec']['overrides']}: {shape['layers']} "
                  f"layers, hidden {shape['hidden']}, {shape['heads']} heads of {shape['head_dim']}, "
                  f"{shape['kv_heads']} KV heads, MLP {shape['intermediate']})", "",
                  "| point | peak MB measured | exact (err) | analytic (err) | step ms median (p25-p75) | "
                  "predicted ms |", "|---|---|---|---|---|---|"]
        for name, r in w["rows"].items():
            lines.append(
                f"| {name} | {_fmt_mb(max(r['measured']))} | {_fmt_mb(max(r['exact']))} ({r['exact_error']:.1%}) | "
                f"{_fmt_mb(max(r['analytic']))} ({r['analytic_error']:.1%}) | {r['step_median'] * 1e3:.0f} "
                f"({r['step_p25'] * 1e3:.0f}-{r['step_p75'] * 1e3:.0f}) | {r['time_predicted'] * 1e3:.0f} |")
        lines += ["", "| ratio | step time measured: per-round ratios, median (p25-p75) | ratio of medians | "
                  "step time predicted | peak memory measured | peak memory predicted (analytic) |",
                  "|---|---|---|---|---|---|"]
        for name, q in w["ratios"].items():
            lines.append(f"| {name} | {q['per_round_median']:.3f} ({q['per_round_p25']:.3f}-{q['per_round_p75']:.3f}) | "
                         f"{q['ratio_of_medians']:.3f} | {q['predicted_time']:.3f} | {q['measured_memory']:.3f} | "
                         f"{q['predicted_memory']:.3f} |")
        lines += ["", "What one block keeps per micro-batch (rank 0; measured: MemTracker's live bytes across each "
                  "block's forward, median over the inner blocks), against Korthikanti et al.'s formula for this "
                  "model (2-byte activations):", "",
                  "| point | measured KB | analytic KB | Megatron formula KB | measured / formula (bytes) | "
                  "(values: / 2 for fp32) |", "|---|---|---|---|---|---|"]
        for name, r in w["rows"].items():
            if "block_megatron" not in r:
                continue
            lines.append(f"| {name} | {r['block_measured'] / 1024:.0f} | {r['block_analytic'] / 1024:.0f} | "
                         f"{r['block_megatron'] / 1024:.0f} | {r['block_vs_megatron']:.2f} | "
                         f"{r['block_vs_megatron'] / 2:.2f} |")
        lines.append("")
    if "bubble" in data:
        bub = data["bubble"]
        lines += [f"### The bubble at one rank per core (world 2, pp=2, `{bub['model']['preset']}` with "
                  f"{bub['model']['overrides']}, {bub['microbatches']} micro-batches of {BUBBLE_MICRO_BATCH}, "
                  f"{bub['rounds']} rounds alternated)", "",
                  "| schedule | step ms median | / vpp=1, per-round median (p25-p75) | ideal (slots) |",
                  "|---|---|---|---|"]
        for name, r in bub["rows"].items():
            lines.append(f"| {name} | {r['step_median'] * 1e3:.0f} | {r['ratio_median']:.3f} "
                         f"({r['ratio_p25']:.3f}-{r['ratio_p75']:.3f}) | {r['ideal']:.3f} |")
        lines.append("")
    lines += _reading(data)
    return lines


def _reading(data: dict) -> list[str]:
    """The text: how much more (or less) Hugging Face blocks keep than Megatron's count and why, and
    what the step times say about the bubble."""
    out = ["### Reading", ""]
    for workload, w in data["workloads"].items():
        rows, shape = w["rows"], w["shape"]
        none = rows["ckpt none"]
        h = shape["hidden"]
        tokens = none["point"]["micro_batch"] * data["config"]["seq"]
        per_token = none["block_measured"] / tokens
        formula_token = none["block_megatron"] / tokens
        sp_gain = 1 - rows["tp2 sp=on"]["block_measured"] / rows["tp2 sp=off"]["block_measured"]
        sp_formula = 1 - rows["tp2 sp=on"]["block_megatron"] / rows["tp2 sp=off"]["block_megatron"]
        sel = rows["ckpt selective"]["block_measured"] / none["block_measured"]
        sel_formula = rows["ckpt selective"]["block_megatron"] / none["block_megatron"]
        out.append(
            f"- **{workload}**: a block keeps {per_token:.0f} bytes per token ({per_token / 4 / h:.1f} hidden-sized "
            f"fp32 values) where Megatron's formula counts {formula_token:.0f} ({formula_token / 2 / h:.1f} "
            f"hidden-sized 2-byte values): {none['block_vs_megatron']:.2f}x the bytes, "
            f"{none['block_vs_megatron'] / 2:.2f}x the values. Sequence parallelism saves {sp_gain:.0%} of a block's "
            f"bytes at tp=2 (the formula: {sp_formula:.0%}); selective recomputation keeps {sel:.0%} of them "
            f"(the formula: {sel_formula:.0%}).")
    out += ["",
            "Why Hugging Face blocks on CPU differ from Megatron's count: activations are fp32 here (4 bytes; the "
            "formula counts 2); the blocks are not fused: Q, K and V are separate tensors (or views of one "
            "projection's output that SDPA keeps), the merged-heads copy of the attention output is kept for the "
            "output projection, and the MLP activation is element-wise ops each keeping its input (GPT-2's "
            "tanh-approximated GELU keeps about three 4h-wide tensors besides its input, Llama's SiLU-gated MLP "
            "the gate, the up projection and their product; Llama's RMSNorm keeps its input, the normalised "
            "tensor and the inverse RMS). Two things go the other way: SDPA's fused attention keeps no scores "
            "(the formula's 5as/h term: Megatron's unfused softmax and its dropout mask), and the tiny presets "
            "have no dropout (the formula counts a mask after attention, after each projection). Sequence "
            "parallelism shards what lies outside the tensor-parallel regions, as Megatron's does (the regions' "
            "inputs are saved as shards and gathered again in backward), but that part is a different share of "
            "an unfused block than of Megatron's (10 of 34 bytes per token and hidden unit there); selective "
            "recomputation saves more than the formula says because it keeps only the linear layers' matmul "
            "outputs and recomputes norms, activation functions and dropout too (Megatron's keeps everything "
            "but the attention core).", ""]
    for workload, w in data["workloads"].items():
        q = w["ratios"]
        sp, sel, full = (q["tp2 sp=on / tp2 sp=off"], q["ckpt selective / ckpt none"], q["ckpt full / ckpt none"])
        versus = q["ckpt full / ckpt selective"]
        out.append(
            f"- **{workload} step times**: sp on / off {sp['per_round_median']:.2f} (predicted "
            f"{sp['predicted_time']:.2f}); selective / none {sel['per_round_median']:.2f} (predicted "
            f"{sel['predicted_time']:.2f}); full / none {full['per_round_median']:.2f} (predicted "
            f"{full['predicted_time']:.2f}); full / selective {versus['per_round_median']:.2f} (p25 "
            f"{versus['per_round_p25']:.2f}, p75 {versus['per_round_p75']:.2f}; predicted "
            f"{versus['predicted_time']:.2f}): selective recomputation was "
            + ("faster than full here." if versus["per_round_p25"] > 1 else "not clearly faster than full here."))
    out += ["",
            "Sequence parallelism costs time on gloo: it turns each region's all-reduce into an all-gather and a "
            "reduce-scatter, twice the collective calls, gathers each region's saved input again in backward "
            "(once per linear layer reading it: Llama's separate Q, K, V, gate and up projections five times a "
            "block, GPT-2's fused ones twice), and gloo's reduce-scatter costs what an all-reduce does (the "
            "analytic model charges that on CPU ranks, and one re-gather per region), while the norms and "
            "residuals it moves onto the shard are a small part of the work at this size; on 4 ranks sharing 2 "
            "cores each collective also waits for its peer to be scheduled, which the model's per-call overhead "
            "does not capture. Full "
            "recomputation runs each block's forward again; selective recomputation skips the matmuls but runs "
            "every other operator under torch's caching dispatch mode (Python for each operator, in forward and "
            "again in the recomputation), a cost the analytic model, which charges FLOPs, does not see: where "
            "operators are small and Python-bound, as on these CPU ranks, it can eat what skipping the matmuls "
            "saves. Measured step times on this shared machine are noisy (other processes share the 2 cores): "
            "compare the quartiles before the medians.",
            ""]
    for workload, w in data["workloads"].items():
        q = w["ratios"]["pp2 vpp=2 / pp2 vpp=1"]
        r1, r2 = w["rows"]["pp2 vpp=1"], w["rows"]["pp2 vpp=2"]
        m = r1["microbatches"]
        ideal = (1 + r2["bubble"]) / (1 + r1["bubble"])
        per_mb = r1["step_median"] / (m + 1)  # a micro-batch's slot on a stage: m + pp - 1 slots per step
        # what each extra stage call (a chunk's forward or backward, with its send and receive) cost, if
        # interleaving had reached the formula's bubble
        extra = (r2["step_median"] - r1["step_median"] * ideal) / (2 * m)
        out.append(
            f"- **{workload} bubble**: vpp=2 / vpp=1 step time {q['per_round_median']:.3f} (p25 "
            f"{q['per_round_p25']:.3f}, p75 {q['per_round_p75']:.3f}); the bubble formulas give "
            f"(pp-1)/m = {r1['bubble']:.3f} and (pp-1)/(v m) = {r2['bubble']:.3f}, so at best {ideal:.3f}; the "
            f"analytic model predicts {q['predicted_time']:.3f}. A micro-batch's slot on a stage is about "
            f"{per_mb * 1e3:.0f} ms here; interleaving halves each slot's work but doubles the stage calls and "
            f"point-to-point transfers per micro-batch ({2 * m * 2} instead of {2 * m} per rank and step: had the "
            f"bubble shrunk as the formula says, each of the {2 * m} extra calls cost {extra * 1e3:.0f} ms), and "
            f"holds {r2['in_flight_rank0']:.1f} micro-batches' activations on rank 0 instead of "
            f"{r1['in_flight_rank0']:.0f} (peak {_fmt_mb(max(r2['measured']))} MB vs {_fmt_mb(max(r1['measured']))} "
            "MB).")
    out += ["",
            "On 4 gloo ranks sharing 2 cores the bubble is mostly not idle time: a rank waiting for its neighbour "
            "gives its core to the other ranks, so the (pp-1)/m share of a step that interleaving removes is "
            "worth far less than on dedicated devices, while each extra stage call costs Python and gloo "
            "overhead (the schedule's per-action bookkeeping, a send and a receive) that small micro-batches do "
            "not amortise. Where the measured ratio is not below 1, that is the reason; the gain the formula "
            "promises needs ranks that own their device and micro-batches whose compute dwarfs that overhead.",
            ""]
    for workload, w in data["workloads"].items():
        q, rows = w["ratios"], w["rows"]
        lp, cp = q["tp2 loss_parallel=on / tp2 sp=off"], q["cp2 / ckpt none"]
        both = rows["cp2 tp2 sp lp"]
        out.append(
            f"- **{workload} loss_parallel and cp**: at tp=2 the vocabulary-parallel loss keeps "
            f"{lp['measured_memory']:.3f} x the peak (predicted {lp['predicted_memory']:.3f}), step time "
            f"{lp['per_round_median']:.2f} x (predicted {lp['predicted_time']:.2f}); cp=2 (dp=2) keeps "
            f"{cp['measured_memory']:.3f} x cp=1's (dp=4) peak (predicted {cp['predicted_memory']:.3f}), step time "
            f"{cp['per_round_median']:.2f} x (predicted {cp['predicted_time']:.2f}); cp=2 x tp=2 with sp and the "
            f"sharded loss peaks at {_fmt_mb(max(both['measured']))} MB (exact {both['exact_error']:.1%} off, "
            f"analytic {both['analytic_error']:.1%}).")
    out += ["", "Context parallelism halves what a rank keeps of each sequence but not the weights, gradients and "
            "optimizer state, and adds the gathered keys and values each attention keeps; on CPU its all-gathers "
            "(two per block, again in backward) are gloo calls on the critical path, where cp=1's data "
            "parallelism only all-reduces the gradients once a step.", ""]
    if "bubble" in data:
        rows = data["bubble"]["rows"]
        interleaved = rows["vpp=2 1f1b"]
        out += [f"With one rank per core and micro-batches that dwarf that overhead (the last table), interleaving "
                f"is {interleaved['ratio_median']:.3f} x the plain 1F1B step (p25 {interleaved['ratio_p25']:.3f}, "
                f"p75 {interleaved['ratio_p75']:.3f}) against the slots' ideal {interleaved['ideal']:.3f}, and zero "
                f"bubble {rows['vpp=2 zb']['ratio_median']:.3f}.", ""]
    return out


def main(argv=None) -> dict:
    from slapo_tune.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds (every point once per round)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tracked", type=int, default=2, help="memory steps per point (the smallest peak is kept)")
    parser.add_argument("--models", default=",".join(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: GPT-2 only, 2 rounds, no bubble section")
    parser.add_argument("--bubble-rounds", type=int, default=6, help="timed rounds of the one-rank-per-core bubble")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.tracked, args.models = 2, 1, 1, "gpt2"
    isolated_cache(RECORDED_CPU)  # predictions from the recorded CPU's description, no user calibration
    points = _points()
    started = time.monotonic()
    data = {"config": dict(world=WORLD, global_batch=GLOBAL_BATCH, seq=SEQ, rounds=args.rounds, warmup=args.warmup,
                           cores=os.cpu_count()),
            "workloads": {}}
    for workload in args.models.split(","):
        t0 = time.monotonic()
        predicted = _predictions(workload, points)
        per_rank = launch(_rank, WORLD, args=(_spec(workload), points, args.rounds, args.warmup, args.tracked),
                          timeout=1800, threads_per_rank=1)
        data["workloads"][workload] = _summarise(workload, points, predicted, per_rank)
        print(f"{workload}: {time.monotonic() - t0:.0f} s", flush=True)
    if not args.quick:
        t0 = time.monotonic()
        data["bubble"] = bubble(args.bubble_rounds, args.warmup)
        print(f"bubble: {time.monotonic() - t0:.0f} s", flush=True)
    data["seconds"] = time.monotonic() - started
    return publish("techniques", data, report_section(data))


if __name__ == "__main__":
    main()
