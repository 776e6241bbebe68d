"""Exact memory: run one training step per rank role on fake tensors with a fake process group.

No memory is allocated and nothing is computed or communicated: ``FakeTensorMode`` carries shapes
and dtypes, the ``fake`` process-group backend completes every collective instantly, and
:class:`~slapo_tune.cost_model._tracker.PeakTracker` follows every tensor. It runs exactly the
code a real rank runs (template, build, the runtime's pipeline schedule, AdamW), so on CPU its
peak equals a real step's peak byte for byte, once it makes up for three things fakes do not do:
the branches a real step takes on the *values* of tensors (:func:`fake_mask_decisions`), the
buffers a real backend's pending sends keep (:func:`_works_hold_their_tensors`) and the
temporaries of its collectives (:func:`_backend_temporaries`). What it cannot know is when gloo's
threads let go of a collective's buffer: under tensor parallelism a real rank may hold one
activation all-reduce's buffer a moment longer, so exact mode is the optimistic end, the right one
for pruning (a point is pruned only when even that does not fit).

Ranks that hold the same pipeline stage behave alike (tensor- and data-parallel ranks are
symmetric), so one run per stage is enough; the worst stage is the one that must fit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import SlapoTuneError, UsageError
from ..plan import Plan, Workload, accumulation, knob_value
from ..problem import Problem
from ..session import Session
from ..topology import init_topology
from ._tracker import MemoryBreakdown, fake_friendly_optimizers, tracked_step


@contextlib.contextmanager
def _static_pipeline_warmup() -> Iterator[None]:
    """A fake group cannot answer the pipeline's warm-up vote; our stages always give their
    shapes, so the answer is known: static mode."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    original = schedules._PipelineSchedule._warmup_p2p

    def static(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = static
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original


@contextlib.contextmanager
def fake_mask_decisions() -> Iterator[None]:
    """Take the attention-mask branch a real step takes.

    Before building a causal mask, transformers checks the position ids for packed sequences
    (several sequences in one row) by reading their values, which a fake tensor cannot give; it
    then assumes packing and materialises a full mask, which SDPA keeps for backward (seen: +3.6 %
    on a GPT-2 step). The runtime passes token ids only, so the model numbers every row 0..s-1 and
    no row is packed: the answer a real step computes is "not packed", and SDPA runs ``is_causal``
    without a mask. The check's own tensors are still computed (a real step allocates them too);
    only the read of its answer is replaced.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor
    from transformers import masking_utils

    original, is_tracing = masking_utils.find_packed_sequence_indices, masking_utils.is_tracing

    def find_packed_sequence_indices(position_ids):
        if not isinstance(position_ids, FakeTensor):
            return original(position_ids)
        # compute what a real step computes (its temporaries count), up to the read of the answer
        masking_utils.is_tracing = lambda tensor=None: False
        try:
            return original(position_ids)
        except DataDependentOutputException:
            return None  # the real step's answer: not packed
        finally:
            masking_utils.is_tracing = is_tracing

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


class _HeldWork:
    """A point-to-point work of the fake backend that, like a real backend's, keeps its buffers
    alive until the work object is dropped (the fake one finishes at once and keeps nothing)."""

    def __init__(self, work, tensors: list[torch.Tensor]):
        self._work, self._tensors = work, tensors

    def __getattr__(self, name: str):
        return getattr(self._work, name)


@contextlib.contextmanager
def _works_hold_their_tensors() -> Iterator[None]:
    """Pipeline sends and receives keep their buffers while the schedule holds their works (a
    GPipe stage waits for its backward sends only at the end of the step: with a real backend,
    every gradient it sent is alive until then)."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        works = original(p2p_ops, desc)
        tensors = [op.tensor for op in p2p_ops]
        if len(works) == len(tensors):
            return [_HeldWork(w, [t]) for w, t in zip(works, tensors)]
        return [_HeldWork(w, tensors) for w in works]  # one work for the whole batch

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


@contextlib.contextmanager
def _backend_temporaries(backend: str) -> Iterator[None]:
    """Allocate what a real backend allocates inside a collective: gloo has no reduce-scatter, and
    emulates one on a full-size copy of its input (+2.5x the input's bytes in flight, seen on
    FSDP's gradient reduction); NCCL reduces in place."""
    if backend != "gloo":
        yield
        return
    original = dist.reduce_scatter_single

    def reduce_scatter_single(output, input, *args, **kwargs):
        scratch = torch.empty_like(input)  # noqa: F841 - alive for the collective, as gloo's copy
        return original(output, input, *args, **kwargs)

    dist.reduce_scatter_single = reduce_scatter_single
    try:
        yield
    finally:
        dist.reduce_scatter_single = original


@contextlib.contextmanager
def _fused_attention(backend: str) -> Iterator[None]:
    """On CUDA ranks (NCCL) SDPA runs FlashAttention-2 or the memory-efficient kernel, attention
    dropout included: neither writes the scores. The fake step runs CPU kernel choices, where
    dropout sends SDPA to its math fallback, which does; so under NCCL the step's SDPA calls run
    without dropout, which the CPU's fused kernel takes (a seed and an offset are all the CUDA
    kernels keep of their dropout)."""
    if backend == "gloo":
        yield
        return
    original = torch.nn.functional.scaled_dot_product_attention

    def scaled_dot_product_attention(*args, **kwargs):
        if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
            args = (*args[:4], 0.0, *args[5:])
        kwargs.pop("dropout_p", None)
        return original(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def steady_state_workload(point: Mapping[str, Any], workload: Workload) -> Workload:
    """The same workload with only as many micro-batches as it takes to reach the peak.

    Without a pipeline, accumulating over more micro-batches repeats the second one's pattern (it
    already runs with the gradients alive). A pipeline runs them all: how many are in flight, and
    what an interleaved schedule keeps of its sends until the step ends, depend on the count.
    """
    if point["pp"] > 1:
        return workload
    kept = min(accumulation(workload, point["dp"], point["micro_batch"]), 2)
    return replace(workload, global_batch=kept * point["micro_batch"] * point["dp"])


def stage_rank(point: Mapping[str, Any], stage: int) -> int:
    """A global rank holding pipeline ``stage`` (mesh order: pp, dp, cp, tp)."""
    return stage * point["dp"] * knob_value(point, "cp") * point["tp"]


FP8_EXACT_REFUSAL = ("exact memory cannot run precision fp8: FP8 kernels do not run on fake CPU tensors; "
                     "use --mode analytic (fp8's activations: bf16's probe less the linear layers' FP8 inputs)")


def exact_memory(problem: Problem, point: Mapping[str, Any], *, stages: list[int] | None = None, seed: int = 0,
                 steady_state: bool = True, backend: str = "gloo") -> dict[int, MemoryBreakdown]:
    """Peak tensor memory per pipeline stage of ``point`` (one fake step per stage role).

    With ``steady_state`` the step runs only the micro-batches that reach the peak (see
    :func:`steady_state_workload`), which gives the same bytes in a fraction of the time (but for
    the one-element losses of the micro-batches it skips: bytes, against tens of megabytes).
    ``backend``: the collective backend whose temporaries to count (``gloo`` on CPU, ``nccl``).
    Runs in the calling process, which must not be part of a process group already. Precision fp8
    is refused (:data:`FP8_EXACT_REFUSAL`): FP8 kernels do not run on fake CPU tensors.
    """
    if problem.workload.mode.fp8:
        raise UsageError(FP8_EXACT_REFUSAL)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise SlapoTuneError("exact_memory() runs its own fake process group; call it outside a distributed job")
    workload = problem.workload
    run_workload = steady_state_workload(point, workload) if steady_state else workload
    plan = Plan.of(point, run_workload)
    results: dict[int, MemoryBreakdown] = {}
    for stage in stages if stages is not None else range(point["pp"]):
        dist.init_process_group("fake", store=FakeStore(), rank=stage_rank(point, stage),
                                world_size=workload.world_size)
        try:
            topology = init_topology(pp=point["pp"], tp=point["tp"], cp=knob_value(point, "cp"))
            with FakeTensorMode(allow_non_fake_inputs=True), fake_friendly_optimizers(), fake_mask_decisions(), \
                    _static_pipeline_warmup(), _works_hold_their_tensors(), _backend_temporaries(backend), \
                    _fused_attention(backend):
                torch.manual_seed(seed)
                session = Session(problem, plan, seed=seed, topology=topology)
                # the whole global batch is alive in a real step, even if fewer micro-batches run
                batch = {k: v[:run_workload.global_batch] for k, v in session.synthetic_batch().items()}
                session.train_step(batch)  # the first step creates the optimizer state
                results[stage] = tracked_step(session, batch)
        finally:
            dist.destroy_process_group()
    return results
