"""Does cutting pipeline stages with the schedule language cost anything?

A 2-stage 1F1B pipeline step (2 ranks, gloo) built by ``cut_pipeline_stage`` + ``build`` +
``TrainStep`` vs the same pipeline written directly against ``torch.distributed.pipelining``
(hand-built stage modules, the same weights, the same tied-embedding gradient sum). Target ratio
<= 1.05. The variants alternate step by step. Run: ``python -m benchmarks.pipeline_overhead``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._stats import alternate, describe, ratio_summary, save_json  # noqa: E402

SHAPE = dict(n_layer=8, n_embd=256, n_head=4, vocab_size=8192)


class _First(nn.Module):
    def __init__(self, model, blocks):
        super().__init__()
        t = model.transformer
        self.wte, self.wpe, self.drop, self.h = t.wte, t.wpe, t.drop, nn.ModuleList(t.h[i] for i in blocks)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        hidden = self.drop(self.wte(ids) + self.wpe(pos))
        for block in self.h:
            hidden = block(hidden)
        return hidden


class _Last(nn.Module):
    def __init__(self, model, blocks):
        super().__init__()
        self.h = nn.ModuleList(model.transformer.h[i] for i in blocks)
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, hidden):
        for block in self.h:
            hidden = block(hidden)
        return self.lm_head(self.ln_f(hidden))


def _rank(ctx, steps: int, batch: int, seq: int, n_mb: int) -> dict:
    import copy

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import slapo_tune as st
    from slapo_tune.parallelize import apply_pipeline_cuts
    from slapo_tune.runtime import TrainStep, default_loss_fn
    from slapo_tune.topology import init_topology

    topo = init_topology(pp=2)
    full = st.build(st.create_schedule(st.build_model("gpt2", **SHAPE)), seed=0)
    direct_model = copy.deepcopy(full)
    sch = st.create_schedule(st.build_model("gpt2", **SHAPE))
    blocks = sch["transformer.h"]
    apply_pipeline_cuts([blocks[n] for n in blocks.child], 2)
    ours = TrainStep(st.build(sch, topology=topo, seed=0), n_microbatches=n_mb, schedule="1f1b")

    half = SHAPE["n_layer"] // 2
    if topo.pp_rank == 0:
        stage_mod, tied = _First(direct_model, range(half)), direct_model.transformer.wte.weight
    else:
        stage_mod, tied = _Last(direct_model, range(half, 2 * half)), direct_model.lm_head.weight
    stage = PipelineStage(stage_mod, topo.pp_rank, 2, torch.device("cpu"), group=topo.pp_group)
    direct = Schedule1F1B(stage, n_mb, loss_fn=default_loss_fn(full))

    ids = torch.randint(0, SHAPE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    losses = {}

    def run_ours():
        losses["ours"] = ours({"input_ids": ids, "labels": ids})

    def run_direct():
        stage_mod.zero_grad(set_to_none=True)
        out = []
        if topo.pp_rank == 0:
            direct.step(ids)
        else:
            direct.step(target=ids, losses=out)
            losses["direct"] = torch.stack(out).mean().item()
        dist.all_reduce(tied.grad, group=topo.tie_group)

    times = alternate({"slapo-tune stages": run_ours, "hand-written stages": run_direct}, steps, warmup=2,
                      sync=dist.barrier)
    return {"times": times, "losses": losses}


def main(argv=None) -> dict:
    from slapo_tune.launch import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args(argv)
    results = launch(_rank, 2, args=(args.steps, args.batch, args.seq, args.microbatches), timeout=1800,
                     threads_per_rank=1)
    times = results[0]["times"]
    summary = ratio_summary(times, "slapo-tune stages", "hand-written stages")
    last = results[1]["losses"]
    print(f"2-stage 1F1B pipeline, GPT-2 {SHAPE}, batch {args.batch} x seq {args.seq}, "
          f"{args.microbatches} micro-batches, 2 gloo ranks x 1 thread")
    rel = abs(last["ours"] - last["direct"]) / abs(last["direct"])
    print(f"   loss: ours {last['ours']:.6f} vs direct {last['direct']:.6f} (relative difference {rel:.1e})")
    for name, values in times.items():
        print("   " + describe(name, values))
    print(f"   ratio ours/direct: {summary['ratio_of_medians']:.3f} (per-step ratio median "
          f"{summary['per_round_median']:.3f}, p25 {summary['per_round_p25']:.3f}, "
          f"p75 {summary['per_round_p75']:.3f}); target <= 1.05")
    out = {"times": times, "losses": last, **summary, "config": {**SHAPE, **vars(args)}}
    print(f"saved {save_json('pipeline_overhead', out)}")
    return out


if __name__ == "__main__":
    main()
