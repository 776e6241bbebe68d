"""One training step for any schedule: micro-batching, accumulation, pipeline, data parallelism,
precision.

A single stage (``pp=1``) runs its micro-batches in a plain loop (forward, loss, backward each), so
FSDP reduce-scatters each micro-batch's gradients block by block as its backward ends (ZeRO levels
2 and 3) or the last micro-batch's only, accumulated (level 1). Several stages run a ``torch.distributed.pipelining``
schedule (GPipe or 1F1B; interleaved 1F1B when each rank holds several stages), which defers FSDP's
gradient sync to the step's last backward at every level. Either way each micro-batch's loss is divided by the micro-batch count before its backward,
so gradients accumulate to the mean; then tied weights across stages are summed and replicated
data parallelism averaged. Trials, the training job and ``verify`` all run this one step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._partition import interleaved_microbatches_ok
from .errors import PipelineError, ScheduleError
from .parallel import _comm, _send_release
from .parallel._context_parallel import context, context_shards, cp_loss_fn, split_sequence
from .parallel._data_parallel import average_gradients
from .parallel._vocab_loss import (
    loss_parallel,
    require_causal_lm_loss,
    shift_labels,
    vocab_parallel_cross_entropy,
)
from .parallelize import (
    reduce_sequence_partial_gradients,
    sequence_parallel_activations,
    sequence_partial_parameters,
)
from .precision import precision as precision_named
from .schedule._pipeline import TRAIN_STEP, StageModule, VirtualStages
from .schedule._schedule import state_of

# "zb": interleaved zero bubble (ZB1P, Qi et al. 2024): each backward split into the input gradient,
# sent upstream at once, and the weight gradient, run later where the pipeline would idle
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zb")


def _schedule_class(name: str, interleaved: bool):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    if interleaved:
        return ScheduleInterleavedZeroBubble if name == "zb" else ScheduleInterleaved1F1B
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]


@functools.cache
def _lazy_receive_stage():
    """``PipelineStage`` whose receive buffers are made when their receive is posted and dropped
    once consumed, instead of one per micro-batch made up front and kept (torch's
    ``_setup_forward_recv_info`` / ``_setup_backward_recv_info``).

    A received activation *is* the stage's input: autograd keeps it for the backward of its
    micro-batch (the stage references it through ``fwd_cache``), so it lives exactly as long as
    that micro-batch is in flight (about ``pp`` under 1F1B, all of them under GPipe, which keeps
    every activation anyway). A received gradient lives through its micro-batch's backward (under
    zero bubble, until the weight pass that reads it). A buffer the allocator gets back is reused
    by the next receive of its size, so a rank holds only the buffers in flight."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import _make_tensor_from_meta

    class LazyReceiveStage(PipelineStage):
        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            # torch's, for one micro-batch (one buffer, dropped at once), copied to the others
            super()._setup_forward_recv_info(1, has_backward)
            self._drop(self.args_recv_info)
            for chunk in range(1, num_microbatches):
                self.args_recv_info[chunk] = tuple(copy.copy(info) for info in self.args_recv_info[0])

        def _create_grad_recv_info(self, act_send_info):
            infos = super()._create_grad_recv_info(act_send_info)
            for info in infos:  # made one micro-batch at a time: never more than one at once
                info.buffer = None
            return infos

        @staticmethod
        def _drop(recv_info) -> None:
            for infos in recv_info.values():
                for info in infos:
                    if not info.is_root_arg:
                        info.buffer = None

        @staticmethod
        def _allocate(infos, device) -> None:
            for info in infos:
                if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                    info.buffer = _make_tensor_from_meta(info.tensor_meta, device)

        def get_fwd_recv_ops(self, fwd_chunk_id: int):
            self._allocate(self.args_recv_info[fwd_chunk_id], self.device)
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int):
            if self.has_backward and not self.is_last:
                self._allocate(self.grad_recv_info[bwd_chunk_id], self.device)
            return super().get_bwd_recv_ops(bwd_chunk_id)

        # the send release (_send_release): a send's ops labelled with what they send, and each
        # compute action (its receive done) a point where sends proven received are let go
        def get_fwd_send_ops(self, fwd_chunk_id: int):
            return self._labelled(super().get_fwd_send_ops(fwd_chunk_id), "SEND_F", fwd_chunk_id)

        def get_bwd_send_ops(self, bwd_chunk_id: int):
            return self._labelled(super().get_bwd_send_ops(bwd_chunk_id), "SEND_B", bwd_chunk_id)

        def _labelled(self, ops, kind: str, chunk: int):
            release = _send_release.active()
            return release.label((self.stage_index, kind, chunk), ops) if release is not None else ops

        def _reached(self, kind: str, chunk: int) -> None:
            release = _send_release.active()
            if release is not None:
                release.reached((self.stage_index, kind, chunk))

        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            self._reached("F", fwd_chunk_id)
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            if not self.is_first:  # the input is now the forward's: held by it until the backward
                self._drop({fwd_chunk_id: self.args_recv_info[fwd_chunk_id]})
            return output

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
            self._reached("B" if full_backward else "I", bwd_chunk_id)
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if not self.is_last:
                self._drop({bwd_chunk_id: self.grad_recv_info[bwd_chunk_id]})
            if loss is not None:
                if full_backward:
                    self._release_graph(loss)
                else:  # the weight pass still runs through it
                    self._pending_losses[bwd_chunk_id] = loss

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            loss = self._pending_losses.pop(bwd_chunk_id, None)
            if loss is not None:
                self._release_graph(loss)

        @property
        def _pending_losses(self) -> dict:
            return self.__dict__.setdefault("_losses_before_weight_pass", {})

        @staticmethod
        def _release_graph(loss: torch.Tensor) -> None:
            # the schedule keeps each micro-batch's loss until the step ends; its graph's
            # accumulation node for the stage input keeps that input (the received activation)
            # alive as long: detached once backward is done, the input goes when its backward does
            if not loss._is_view():
                loss.detach_()

    return LazyReceiveStage


def default_optimizer(params, lr: float = 1e-4) -> torch.optim.Optimizer:
    """The optimizer trials, the training job and the cost model assume: AdamW (two moment
    tensors per parameter, in the parameter's dtype)."""
    return torch.optim.AdamW(params, lr=lr)


def default_loss_fn(model: torch.nn.Module, tp_group=None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own Hugging Face loss (shifted for causal LMs), applied to logits; for a model
    whose LM head keeps its logits sharded over the vocabulary (``loss_parallel``), the same loss
    computed across the tensor-parallel ``tp_group`` (:func:`~slapo_tune.parallel._vocab_loss.vocab_parallel_cross_entropy`)."""
    if loss_parallel(model):
        require_causal_lm_loss(model, "loss_parallel", "the vocabulary-parallel loss replaces")

        def sharded_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits, labels, tp_group, shift=True)

        return sharded_loss
    vocab = model.config.vocab_size
    hf_loss = model.loss_function

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return hf_loss(logits=logits, labels=labels, vocab_size=vocab)

    return loss_fn


class TrainStep:
    """Compute the gradients of one optimizer step on a global batch (see the module docstring).

    The global batch (same on every rank) is split over data-parallel ranks, then into
    ``n_microbatches`` micro-batches. ``precision`` (:mod:`slapo_tune.precision`): ``amp-bf16``
    runs forward and backward under autocast; ``bf16`` computes with the bf16 parameters
    :func:`~slapo_tune.schedule._build.build` made, and the gradients the optimizer needs are the fp32
    master gradients (``model.master``) or FSDP's fp32 shards. Returns the mean loss over the global
    batch on every rank. Call the optimizer after.
    """

    def __init__(self, model: StageModule, *, n_microbatches: int = 1, schedule: str = "1f1b",
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 precision: str = "fp32"):
        if not isinstance(model, StageModule | VirtualStages):
            raise ScheduleError("TrainStep needs a model built with a topology: build(sch, topology=...)")
        if schedule not in PIPELINE_SCHEDULES:
            raise ScheduleError(f"pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
        if n_microbatches < 1:
            raise ScheduleError(f"n_microbatches must be >= 1, got {n_microbatches}")
        topo = model.topology
        if schedule == "1f1b" and topo.pp > 1 and n_microbatches < topo.pp:
            raise ScheduleError(f"1F1B needs at least as many micro-batches as stages ({topo.pp}), got {n_microbatches}")
        if schedule == "zb" and len(model.chunks) == 1:
            raise ScheduleError("the zero-bubble schedule interleaves several stages per rank; cut pp * vpp stages "
                                "with vpp > 1")
        if schedule == "zb" and model.zero == 3:
            # measured: the weight-gradient pass runs after FSDP resharded the block, whose
            # gradients are then lost (verify finds them missing on the last stage)
            raise ScheduleError("the zero-bubble schedule computes weight gradients after ZeRO-3 has resharded the "
                                "parameters; use zero <= 2 or pipeline schedule 1f1b")
        if schedule == "zb" and any(getattr(state_of(m), "checkpoint_policy", "full") == "selective"
                                    for m in model.modules()):
            raise ScheduleError("the zero-bubble schedule runs backward twice over a block (input, then weight "
                                "gradients), which selective recomputation allows once; use ckpt_policy full")
        if len(model.chunks) > 1:
            if schedule == "gpipe":
                raise ScheduleError(f"an interleaved pipeline ({len(model.chunks)} stages per rank) runs interleaved "
                                    "1F1B or zero bubble (1f1b, zb); got pipeline schedule 'gpipe'")
            if not interleaved_microbatches_ok(n_microbatches, topo.pp):
                raise ScheduleError(f"an interleaved schedule over pp={topo.pp} needs at least {topo.pp} micro-batches "
                                    f"in whole rounds (a multiple of max(1, n // pp)), got {n_microbatches}")
        self.model, self.topology = model, topo
        self.n_microbatches, self.schedule_name = n_microbatches, schedule
        self.precision = precision_named(precision)
        if self.precision.master and getattr(model, "master", None) is None and not model.zero:
            raise ScheduleError(f"precision {precision} needs the model built with it: build(..., precision=...)")
        if context_shards(model) != topo.cp:
            raise ScheduleError(f"the model was scheduled for cp={context_shards(model)}, the topology has cp={topo.cp}")
        if loss_fn is None and topo.cp > 1:
            loss_fn = cp_loss_fn(model.model, topo.tp_group, topo.cp_group)
        self.loss_fn = loss_fn or default_loss_fn(model.model, topo.tp_group)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._schedule = None
        self._shape = None
        self.send_release: _send_release.SendRelease | None = None  # the last interleaved step's
        # calls of the stage like its model (call_like_model): the synchronised gradients set aside
        # while .grad holds what backward calls since have added (None: .grad is all synchronised)
        self._aside: list[torch.Tensor | None] | None = None
        self._in_backward = False
        self._deferred = False  # inside no_sync()
        model.__dict__[TRAIN_STEP] = weakref.ref(self)

    def _scaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # divided before backward: the gradients of the step's micro-batches add up to the mean
        return self.loss_fn(logits, labels) / self.n_microbatches

    def _make_schedule(self, shape) -> None:
        PipelineStage = _lazy_receive_stage()

        # Shapes given up front put the stage in static mode: no metadata inference round trips
        # (and none of the data-dependent reads that a shape-only dry run cannot answer).
        config = self.model.model.config
        dtype = self.precision.param_dtype  # what crosses stages (FSDP's shards stay fp32)
        batch, seq = shape
        # under sequence parallelism the blocks' hidden state is this rank's slice of the sequence
        hidden_seq = seq // self.model.chunks[0].sequence_shards
        hidden = torch.empty(batch, hidden_seq, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
        ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
        # under loss_parallel the last stage's logits are its slice of the vocabulary
        vocab = config.vocab_size // (self.topology.tp if loss_parallel(self.model) else 1)
        logits = torch.empty(batch, seq, vocab, dtype=dtype, device="meta", requires_grad=True)
        stages = [PipelineStage(chunk, chunk.info.index, chunk.info.num_stages, self.device,
                                input_args=(ids if chunk.info.is_first else hidden,),
                                output_args=(logits if chunk.info.is_last else hidden,),
                                group=self.topology.pp_group)
                  for chunk in self.model.chunks]
        interleaved = len(stages) > 1
        self._schedule = _schedule_class(self.schedule_name, interleaved)(
            stages if interleaved else stages[0], self.n_microbatches, loss_fn=self._scaled_loss, scale_grads=False)
        self._shape = shape

    def held_buffers(self) -> list[torch.Tensor]:
        """The tensors the step keeps from one step to the next that no module or optimizer owns:
        the pipeline stages' receive buffers still referenced after the step (for every chunk of
        an interleaved rank). Ours (:func:`_lazy_receive_stage`) let each go once consumed, so
        this is empty; torch's own kept one per micro-batch. A device's allocator counts what is
        held in every later step's peak, and a tracker that starts from the modules and the
        optimizer must be given it."""
        if self._schedule is None:
            return []
        stages = getattr(self._schedule, "_stages", None) or [self._schedule._stage]
        held = []
        for stage in stages:
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
                held += [info.buffer for info in infos
                         if not getattr(info, "is_root_arg", False) and isinstance(info.buffer, torch.Tensor)]
        return held

    def _rows(self, samples: int) -> slice:
        """This data-parallel rank's rows of a global batch of ``samples``."""
        topo = self.topology
        if samples % (topo.dp * self.n_microbatches):
            raise ScheduleError(
                f"global batch {samples} is not divisible by dp x micro-batches = "
                f"{topo.dp} x {self.n_microbatches}"
            )
        n = samples // topo.dp
        return slice(topo.dp_rank * n, (topo.dp_rank + 1) * n)

    def local_batch(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's slice of the global batch."""
        ids, labels = batch["input_ids"], batch.get("labels", batch["input_ids"])
        topo = self.topology
        rows = self._rows(ids.shape[0])
        ids, labels = ids[rows], labels[rows]
        if topo.cp > 1:  # this rank's chunk of each sequence; labels shifted over the whole sequence first
            ids, labels = split_sequence(ids, topo.cp_rank, topo.cp), split_sequence(shift_labels(labels), topo.cp_rank, topo.cp)
        return ids.to(self.device), labels.to(self.device)

    def micro_batches(self, batch: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """This rank's part of a global batch (the same on every rank), cut as the step cuts it: its
        data-parallel rows in ``n_microbatches`` micro-batches, each holding every tensor of ``batch``
        (``input_ids``, ``labels``, which default to the ids as in the step, an ``attention_mask``...)
        on the step's device. For a loop of your own that calls the model (:meth:`call_like_model`);
        tensor-parallel ranks get the same rows."""
        self._whole_model_on_this_rank()
        rows = self._rows(batch["input_ids"].shape[0])
        local = {"labels": batch["input_ids"], **batch}
        pieces = {name: tensor[rows].chunk(self.n_microbatches) for name, tensor in local.items()}
        return [{name: chunks[i].to(self.device) for name, chunks in pieces.items()}
                for i in range(self.n_microbatches)]

    def _whole_model_on_this_rank(self) -> None:
        """Refuse (one line, naming the one-call step) a layout where no rank holds the whole model."""
        topo = self.topology
        if topo.pp > 1 or len(self.model.chunks) > 1:
            raise PipelineError(f"the schedule cuts the model into pipeline stages (pp={topo.pp}): a rank holds only "
                                "its stages and cannot be called like the model; run each step with "
                                "session.train_step(batch) (micro-batches, pipeline, gradient sync and the optimizer "
                                "step in one call)")
        if topo.cp > 1:
            raise ScheduleError(f"context parallelism (cp={topo.cp}) gives each rank a slice of every sequence: the "
                                "model cannot be called whole; run each step with session.train_step(batch)")

    def call_like_model(self, *, gather_logits: bool = True, **inputs: Any) -> Any:
        """The stage called as the Hugging Face model it was scheduled from (``stage(input_ids=...,
        labels=..., attention_mask=...)`` runs this), for a loop of your own at ``pp=1``: returns the
        model's own output (a causal LM's ``CausalLMOutputWithPast``, ``.loss`` and ``.logits``),
        computed as the step computes it: under the precision's autocast, with sequence
        parallelism's saved shards, the model's loss (its vocabulary-parallel equivalent under
        ``loss_parallel``). Give each data-parallel rank its own rows (:meth:`micro_batches`).

        Each backward through the output ends with the gradient synchronisation the step does once
        per step (as DDP's backward does): sequence-partial gradients summed over tensor
        parallelism, replicated data parallelism averaged (FSDP reduce-scatters by itself under
        ZeRO), applied to what backward calls added since the last synchronisation only, so an
        optimizer or a gradient clip sees synchronised gradients and several backward calls before
        one optimizer step (gradient accumulation) add up right. Inside :meth:`no_sync` a backward
        leaves its gradients to the next one outside, which synchronises them all at once: the
        step's own order of sums, so the same gradients bit for bit. Under bf16 the gradients are
        the fp32 masters' (``stage.master``): what an optimizer of your own must step, then
        ``stage.master.publish()``.

        Under ``loss_parallel`` the LM head leaves each tensor-parallel rank its slice of the
        vocabulary. ``.loss`` is computed from the slices, without gathering them; ``.logits`` is
        gathered to the whole vocabulary (``[batch, seq, vocab]``, differentiable), because code
        written for the model (an argmax, a metric, a loss of its own) reads them whole and a slice
        would give it wrong answers without an error. ``gather_logits=False`` keeps this rank's slice
        (vocabulary ids ``[r * vocab / tp, (r + 1) * vocab / tp)`` on tensor-parallel rank ``r``) and
        the memory the schedule was tuned with, which holds no whole logits.
        """
        self._whole_model_on_this_rank()
        self._in_backward = False  # no backward runs during a forward of the model (one that raised ended)
        model = self.model.model
        sharded = loss_parallel(model)
        labels = inputs.pop("labels", None) if sharded else None  # else the model computes its own loss
        as_tuple = inputs.pop("return_dict", None) is False
        with self.compute_context():
            output = model(**inputs)
            logits = output.logits
            if sharded:
                fields = dict(output)
                if labels is not None:
                    fields["loss"] = default_loss_fn(model, self.topology.tp_group)(logits, labels.to(logits.device))
                if gather_logits:
                    fields["logits"] = _comm.gather(logits, -1, self.topology.tp_group)
                output = type(output)(**fields)  # in the model's field order (loss first)
        if logits.requires_grad and self._synchronised_by_step():
            logits.register_hook(self._backward_started)
        return output.to_tuple() if as_tuple else output

    @contextlib.contextmanager
    def no_sync(self):
        """Backward calls through :meth:`call_like_model`'s outputs inside leave their gradients
        unsynchronised; the next backward outside synchronises them with its own (DDP's
        ``no_sync``: accumulate over micro-batches, synchronise once, as the step does)."""
        self._whole_model_on_this_rank()
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False

    def _synchronised_by_step(self) -> bool:
        """Whether the step synchronises any gradient itself at pp=1 (FSDP's reductions are FSDP's)."""
        topo = self.topology
        return (topo.dp > 1 and not self.model.zero) or (topo.tp > 1 and bool(sequence_partial_parameters(self.model)))

    def _stepped(self) -> list[torch.Tensor]:
        """What the optimizer steps: the fp32 masters under bf16, else the parameters themselves."""
        return self.masters() if self.model.master is not None else list(self.model.parameters())

    def masters(self) -> list[torch.Tensor]:
        """The fp32 masters the optimizer steps in the parameters' place (bf16 on replicated
        parameters; none otherwise): state beside the stage's own tensors, which memory counts."""
        return list(self.model.master.parameters()) if self.model.master is not None else []

    def stepped_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps for ``param``: its fp32 master where the stage keeps
        masters, else ``param`` itself (the one place that decides it)."""
        master = self.model.master
        return master.master(param) if master is not None else param

    def _backward_started(self, grad: torch.Tensor) -> None:
        # The logits' gradient comes before any parameter's. Synchronised gradients are set aside,
        # so that the reduction at the end sees only what is not synchronised yet (a sum over the
        # tensor-parallel ranks must not count them twice).
        if self._in_backward:  # several outputs in one backward: the first one's hook did it
            return
        self._in_backward = True
        stepped = self._stepped()
        if self._aside is not None and all(t.grad is None for t in stepped):
            self._aside = None  # zeroed since a backward under no_sync(): nothing to add back
        if self._aside is None:
            self._aside = [t.grad for t in stepped]
            for t in stepped:
                t.grad = None
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(self._backward_ended, synchronise=not self._deferred))

    def _backward_ended(self, synchronise: bool) -> None:
        self._in_backward = False
        if not synchronise:
            return
        self._sync_gradients()
        for t, grad in zip(self._stepped(), self._aside, strict=True):
            if grad is not None:
                if t.grad is None:
                    t.grad = grad
                else:
                    t.grad.add_(grad)
        self._aside = None

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> float:
        return self.run(batch).item()

    def run(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """As calling the step, but the loss stays a one-element tensor (no host synchronisation)."""
        ids, labels = self.local_batch(batch)
        topo = self.topology
        self.model.zero_grad(set_to_none=True)
        if self.model.master is not None:
            self.model.master.zero_grad()
        losses: list[torch.Tensor] = []  # each micro-batch's loss over the micro-batch count
        with self.compute_context():
            if topo.pp == 1:
                self._accumulate(ids, labels, losses)
            else:
                self._pipeline(ids, labels, losses)
        self._sync_gradients()
        if losses:
            loss = torch.stack([t.detach().float() for t in losses]).sum()
        else:
            loss = torch.zeros((), device=self.device)
        loss = loss.reshape(1).to(self.device)
        if topo.pp > 1:
            dist.broadcast(loss, src=topo.pp_global_ranks[-1], group=topo.pp_sync_group)
        if topo.cp > 1:  # each cp rank's loss is its tokens' share of the whole sequence's
            dist.all_reduce(loss, group=topo.cp_group)
        if topo.dp > 1:
            dist.all_reduce(loss, group=topo.dp_group)
            loss /= topo.dp
        return loss

    def _accumulate(self, ids: torch.Tensor, labels: torch.Tensor, losses: list[torch.Tensor]) -> None:
        """One stage: forward, loss and backward per micro-batch. ZeRO-1 keeps its units (the
        blocks, the root) gathered and their gradients whole until the last micro-batch, whose
        backward reduce-scatters them block by block (one per unit per step); levels 2 and 3
        reduce-scatter every micro-batch's gradients block by block."""
        n = self.n_microbatches
        for i, (x, y) in enumerate(zip(ids.chunk(n), labels.chunk(n), strict=True)):
            if self.model.zero == 1:
                last = i == n - 1
                self.model.set_requires_gradient_sync(last)
                self.model.set_reshard_after_backward(last)
            loss = self._scaled_loss(self.model(x), y)
            loss.backward()
            losses.append(loss.detach())

    def _pipeline(self, ids: torch.Tensor, labels: torch.Tensor, losses: list[torch.Tensor]) -> None:
        shape = (ids.shape[0] // self.n_microbatches, *ids.shape[1:])
        if shape != self._shape:  # stages record shapes on their first step
            self._make_schedule(shape)
        info = self.model.info
        # interleaved (torch's runtime schedules): sends let go as their receives are proven posted
        releasing = _send_release.releasing_sends(self._schedule) if len(self.model.chunks) > 1 \
            else contextlib.nullcontext()
        with releasing as self.send_release:
            self._step_schedule(ids, labels, losses, info)

    def _step_schedule(self, ids: torch.Tensor, labels: torch.Tensor, losses: list[torch.Tensor], info) -> None:
        # return_outputs=False: merging every micro-batch's logits would keep them all alive
        if info.is_first:
            self._schedule.step(ids, target=labels if info.is_last else None,
                                losses=losses if info.is_last else None, return_outputs=False)
        elif info.is_last:
            self._schedule.step(target=labels, losses=losses, return_outputs=False)
        else:
            self._schedule.step(return_outputs=False)

    def compute_context(self):
        """Autocast to the precision's compute dtype (or not), and under sequence parallelism
        saved activations kept as sequence shards (:func:`~slapo_tune.parallelize.sequence_parallel_activations`).

        Autocast's cache of cast weights is off under sharded data parallelism: FSDP gathers a
        parameter again for each micro-batch, and a cast cached from the first would link later
        micro-batches' gradients to a gathered parameter FSDP has already reduced (measured: a
        q_proj gradient 66 % off at zero=3 with two micro-batches); it would also keep a 16-bit
        copy of every gathered parameter for the whole step."""
        stack = contextlib.ExitStack()
        topo = self.topology
        if topo.cp > 1:
            stack.enter_context(context(topo.cp_group, topo.cp_rank, topo.cp))
        if self.model.chunks[0].sequence_shards > 1:
            stack.enter_context(sequence_parallel_activations())
        if self.precision.autocast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.precision.autocast,
                                               cache_enabled=not self.model.zero))
        return stack

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the optimizer steps ``param`` with (its fp32 master's under bf16)."""
        return self.stepped_tensor(param).grad

    def _sync_gradients(self) -> None:
        topo, info = self.topology, self.model.info
        if topo.pp > 1 and info.tied:
            for param in self.model.tied_parameters():
                grad = self.gradient(param)
                dist.all_reduce(_comm.local_tensor(grad), group=topo.tie_group)
        if topo.tp > 1:  # norms and row-parallel biases under sequence parallelism saw a shard of the tokens
            reduce_sequence_partial_gradients(self.model, self.gradient, topo.tp_group)
        stepped = self._stepped()
        if topo.cp > 1:  # context-parallel ranks saw different tokens of the same sequences: their shares add up
            for param in stepped:
                if param.grad is not None:
                    dist.all_reduce(_comm.local_tensor(param.grad), group=topo.cp_group)
        if topo.dp > 1 and self.model.zero == 0:
            average_gradients(stepped, topo.dp_group)
