"""Does the schedule language cost anything at run time?

1. A model passed through ``create_schedule`` + ``build`` with no primitives vs the plain model
   (target ratio <= 1.02).
2. A tensor-parallel GPT-2 block (2 ranks, gloo) built with our primitives vs the same plan through
   PyTorch DTensor ``parallelize_module`` (target ratio <= 1.0).

Both measured in one run, alternating the variants step by step. Run:
``python -m benchmarks.schedule_overhead [--steps 30]``.
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks._stats import alternate, describe, ratio_summary, save_json  # noqa: E402


def _step(model, batch):
    def run():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    return run


def no_primitive_overhead(steps: int) -> dict:
    import slapo_tune as st

    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    plain = st.build_model("gpt2", device="cpu", n_layer=4, n_embd=256, n_head=4, vocab_size=8192)
    scheduled = st.build(st.create_schedule(copy.deepcopy(plain)))
    ids = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    times = alternate({"plain": _step(plain, batch), "scheduled (no primitives)": _step(scheduled, batch)}, steps)
    return {"times": times, **ratio_summary(times, "scheduled (no primitives)", "plain")}


def _gpt2_block(hidden: int, heads: int):
    import transformers
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    import slapo_tune as st

    config = transformers.GPT2Config(n_embd=hidden, n_head=heads, n_layer=1, attn_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(0)
    block = transformers.models.gpt2.modeling_gpt2.GPT2Block(config, layer_idx=0)

    def to_linear(conv: Conv1D) -> nn.Linear:  # DTensor's styles only know nn.Linear
        lin = nn.Linear(conv.nx, conv.nf)
        with torch.no_grad():
            lin.weight.copy_(conv.weight.t())
            lin.bias.copy_(conv.bias)
        return lin

    st.create_schedule(block).replace_all(Conv1D, to_linear)
    return block


def _rank_major_qkv(block, world: int) -> None:
    """Reorder the fused QKV rows so that a plain contiguous split gives each rank whole q/k/v heads."""
    lin = block.attn.c_attn
    with torch.no_grad():
        for p in (lin.weight, lin.bias):
            q, k, v = p.chunk(3, dim=0)
            parts = [t.chunk(world, dim=0) for t in (q, k, v)]
            p.copy_(torch.cat([parts[b][r] for r in range(world) for b in range(3)], dim=0))


def _tp_rank(ctx, hidden: int, heads: int, batch: int, seq: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import slapo_tune as st
    from slapo_tune.parallelize import Colwise, DivideAttr, Rowwise, apply_tensor_parallel

    ours = _gpt2_block(hidden, heads)
    theirs = copy.deepcopy(ours)
    apply_tensor_parallel(st.create_schedule(ours), {
        "attn": DivideAttr("split_size", "num_heads"),
        "attn.c_attn": Colwise(num_fused=3),
        "attn.c_proj": Rowwise(),
        "mlp.c_fc": Colwise(),
        "mlp.c_proj": Rowwise(),
    })
    _rank_major_qkv(theirs, ctx.world_size)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    parallelize_module(theirs, mesh, {
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    })
    theirs.attn.split_size //= ctx.world_size
    theirs.attn.num_heads //= ctx.world_size
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1))
    same = torch.allclose(ours(x), theirs(x), rtol=1e-4, atol=1e-5)

    def step(block):
        def run():
            inp = x.clone().requires_grad_()
            block.zero_grad(set_to_none=True)
            block(inp).sum().backward()

        return run

    times = alternate({"ours": step(ours), "dtensor": step(theirs)}, steps, warmup=3,
                      sync=torch.distributed.barrier)
    return {"times": times, "same_output": same}


def tp_vs_dtensor(steps: int, hidden: int = 512, heads: int = 8, batch: int = 4, seq: int = 128) -> dict:
    from slapo_tune.launch import launch

    results = launch(_tp_rank, 2, args=(hidden, heads, batch, seq, steps), timeout=900, threads_per_rank=1)
    times = results[0]["times"]
    return {"times": times, "same_output": all(r["same_output"] for r in results),
            "shape": {"hidden": hidden, "heads": heads, "batch": batch, "seq": seq},
            **ratio_summary(times, "ours", "dtensor")}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    a = no_primitive_overhead(args.steps)
    print("1. schedule with no primitives vs plain model (GPT-2 4x256, batch 4, seq 128, fwd+bwd)")
    for name, values in a["times"].items():
        print("   " + describe(name, values))
    print(f"   ratio scheduled/plain: {a['ratio_of_medians']:.3f} (per-step ratio median {a['per_round_median']:.3f}, "
          f"p25 {a['per_round_p25']:.3f}, p75 {a['per_round_p75']:.3f}); target <= 1.02")
    b = tp_vs_dtensor(args.steps)
    print(f"2. tensor-parallel GPT-2 block, 2 ranks gloo, {b['shape']}, fwd+bwd; outputs equal: {b['same_output']}")
    for name, values in b["times"].items():
        print("   " + describe(name, values))
    print(f"   ratio ours/DTensor: {b['ratio_of_medians']:.3f} (per-step ratio median {b['per_round_median']:.3f}, "
          f"p25 {b['per_round_p25']:.3f}, p75 {b['per_round_p75']:.3f}); target <= 1.0")
    out = {"no_primitives": a, "tp_vs_dtensor": b}
    print(f"saved {save_json('schedule_overhead', out)}")
    return out


if __name__ == "__main__":
    main()
