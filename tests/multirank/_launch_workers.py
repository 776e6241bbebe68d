"""Rank functions for the launcher tests."""

import os
import signal
import time


def echo(ctx, value):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": t.item(), "value": value, "pid": os.getpid(),
            "parent": os.getppid(), "threads": torch.get_num_threads(), "mark": os.environ.get("SLAPO_TEST_MARK")}


def raise_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("bad knob on rank 1")
    time.sleep(60)


def hang(ctx):
    time.sleep(600)


def sigkill_rank_zero(ctx):
    if ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def different_inputs(ctx):
    import torch

    import slapo_tune as st

    ref = st.build_model("gpt2-tiny")
    model = st.build(st.create_schedule(st.build_model("gpt2-tiny")))
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))
    try:
        st.verify(model, ref, {"input_ids": ids, "labels": ids})
    except st.VerificationError as exc:
        return str(exc)
    return "no error"


def write_pid_and_hang(ctx, folder):
    with open(os.path.join(folder, f"rank-{ctx.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def hold_until_released(ctx, folder):
    """Rendezvous (an all-reduce), report this rank's PID and the interfaces gloo and NCCL were
    told to use, then keep the process group up until ``folder/release`` exists (at most 60 s)."""
    import json

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    report = {"pid": os.getpid(), "sum": t.item(),
              **{v: os.environ.get(v) for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}
    with open(os.path.join(folder, f"rank-{ctx.rank}.json.part"), "w") as f:
        json.dump(report, f)
    os.rename(os.path.join(folder, f"rank-{ctx.rank}.json.part"), os.path.join(folder, f"rank-{ctx.rank}.json"))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return report
