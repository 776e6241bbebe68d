"""Rank functions for the 3D-parallelism tests (run in spawned processes)."""

from __future__ import annotations

import torch.distributed as dist

import slapo_tune as st
from slapo_tune.topology import init_topology

from _helpers import parallel_schedule, token_batch


def run_cases(ctx, cases):
    """Each case: (preset, pp, tp, zero, pipeline schedule, checkpoint ratio, micro-batches)."""
    results = {}
    for case in cases:
        preset, pp, tp, zero, schedule, ckpt, nmb = case
        topo = init_topology(pp=pp, tp=tp)
        model = st.build(parallel_schedule(preset, topo, ckpt), topology=topo, zero=zero)
        ref = st.build_model(preset)
        batch = token_batch(ref.config.vocab_size, batch=8, seq=16)
        try:
            rep = st.verify(model, ref, batch, n_microbatches=nmb, pipeline_schedule=schedule)
            results[case] = {"ok": True, "report": str(rep), "compared": rep.compared,
                             "tied": list(model.info.tied), "stage": model.info.index,
                             "grad_error": rep.max_grad_error}
        except st.VerificationError as exc:
            results[case] = {"ok": False, "report": str(exc)}
        dist.barrier()
    return results
