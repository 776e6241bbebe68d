"""Rank functions and process targets for the device tests (importable by spawned processes)."""

from __future__ import annotations

import time

GiB = 2**30


def wrapped_oom_on_rank_one(ctx):
    """Rank 1 runs out of memory inside a pipeline stage: torch's schedules re-raise what a stage
    raised as a generic RuntimeError ``from`` it. Rank 0 waits (and is killed)."""
    import torch

    if ctx.rank == 1:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("[Stage 0] failed to run forward") from exc
    time.sleep(60)


def report_device(ctx):
    return {"device": ctx.device, "rank": ctx.rank}


def rank_with_fake_cuda(conn, timeout_s: float) -> None:
    """Process target: one launcher rank (``slapo_tune.launch._rank_main``) on nccl, with CUDA and the
    process group faked up to where a kernel would run; sends what the rank chose over ``conn``:
    its device, the GPU it selected, the backend and timeout of its process group, its result."""
    from multiprocessing import Pipe

    import torch
    import torch.distributed as dist

    from slapo_tune import launch

    calls: dict = {}
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1  # CUDA_VISIBLE_DEVICES shows the rank its own GPU only
    torch.cuda.get_device_properties = lambda i: type("P", (), {"name": "NVIDIA H200", "total_memory": 141 * GiB})()
    torch.cuda.set_device = lambda device: calls.setdefault("set_device", str(device))
    dist.FileStore = lambda *a, **k: dist.HashStore()  # no peers: a store that answers at once
    dist.init_process_group = lambda backend, **k: calls.update(backend=backend, pg_timeout=k["timeout"].total_seconds())
    dist.destroy_process_group = lambda: calls.setdefault("destroyed", True)
    reader, writer = Pipe(duplex=False)
    launch._rank_main(report_device, 1, 2, "no-store-file", "nccl", (), writer, 1, {}, timeout_s)
    conn.send({**calls, "message": reader.recv()})
