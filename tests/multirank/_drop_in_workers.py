"""Rank functions for the drop-in tests: the scheduled model used as the Hugging Face model is."""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
import torch.distributed as dist

import slapo_tune as st
from slapo_tune.apply import apply_schedule, load_schedule
from slapo_tune.data import TrainingData


def hugging_face_loop(ctx, schedule: str, steps: int, lr: float, no_sync: bool) -> list[float]:
    """A training loop of one's own, written as for the Hugging Face model: the model called with
    ``input_ids``/``labels``, ``loss.backward()``, a ``torch.optim.AdamW`` of one's own; ``no_sync``:
    gradient accumulation as with DDP (all micro-batches but the last under ``model.no_sync()``).
    Returns each step's loss over the global batch, as ``slapo-tune train`` reports it (the
    data-parallel mean)."""
    loaded = load_schedule(schedule, world_size=dist.get_world_size())
    torch.manual_seed(0)  # as the training job seeds the ranks
    session = apply_schedule(None, loaded, seed=0)
    model = session.stage
    optimizer = torch.optim.AdamW(session.trained_parameters().values(), lr=lr)  # bf16: the fp32 masters
    data = TrainingData("synthetic", model.config.vocab_size, loaded.workload.global_batch, loaded.workload.seq_len,
                        seed=0)
    losses = []
    for step in range(steps):
        micro_batches = session.micro_batches(data.batch(step))
        total = torch.zeros(())
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with model.no_sync() if no_sync and not last else contextlib.nullcontext():
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss / len(micro_batches)
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total, group=session.topology.dp_group)
        total /= session.topology.dp
        optimizer.step()
        optimizer.zero_grad()
        if model.master is not None:
            model.master.publish()
        losses.append(total.item())
    return losses


def called_like_the_model(ctx, schedule: str, batch: dict[str, torch.Tensor]) -> dict:
    """The pp=1 scheduled model and the unscheduled one (same weights: both initialised from seed 0)
    called on the same batch: what each returns."""
    loaded = load_schedule(schedule, world_size=dist.get_world_size())
    session = apply_schedule(None, loaded, seed=0)
    reference = st.build(st.create_schedule(loaded.model.build("meta")), seed=0)
    expected = reference(**batch)
    got = session.stage(**batch)
    sliced = session.stage(**batch, gather_logits=False).logits
    as_tuple = session.stage(**batch, return_dict=False)
    tp, rank = session.topology.tp, session.topology.tp_rank
    width = expected.logits.shape[-1] // tp
    result = {
        "types": (type(got).__name__, type(expected).__name__),
        "losses": (got.loss.item(), expected.loss.item()),
        "shapes": (tuple(got.logits.shape), tuple(expected.logits.shape)),
        "logits_error": (got.logits - expected.logits).abs().max().item(),
        "slice_error": (sliced - expected.logits[..., rank * width:(rank + 1) * width]).abs().max().item()
        if sliced.shape[-1] == width else None,
        "tuple": (type(as_tuple).__name__, as_tuple[0].item(), tuple(as_tuple[1].shape)),
        "config": session.stage.config is session.stage.model.config,
    }
    # what the drop-in call added holds no cycle: a dropped session's model goes at once. Garbage
    # already unreachable (cycles other code left while the calls ran: a caught exception's frames)
    # may still point at the model: collected first, so that only the session's own references count
    stage = weakref.ref(session.stage)
    gc.collect()
    gc.disable()
    try:
        del session, got, sliced, as_tuple
        result["freed"] = stage() is None
    finally:
        gc.enable()
    return result


def pipeline_rank_called_like_the_model(ctx, schedule: str) -> tuple[str, str, float]:
    """At pp > 1: what calling the stage like the model says, what a bare ``build`` stage says,
    and the loss of the one-call step."""
    from slapo_tune.topology import init_topology

    loaded = load_schedule(schedule, world_size=dist.get_world_size())
    session = apply_schedule(None, loaded, seed=0)
    batch = session.synthetic_batch()
    try:
        session.stage(**batch)
        refused = ""
    except st.PipelineError as exc:
        refused = str(exc)
    bare = st.build(st.create_schedule(st.build_model(loaded.model.name)), seed=0,
                    topology=init_topology(pp=1, tp=1, dp=dist.get_world_size()))
    try:
        bare(**batch)
        untrained = ""
    except st.PipelineError as exc:
        untrained = str(exc)
    return refused, untrained, float(session.train_step(batch))
