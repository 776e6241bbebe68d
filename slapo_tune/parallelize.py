"""Apply one parallelization technique at a time, from plans keyed by module path.

Each ``apply_*`` function uses only the public primitives of :class:`~slapo_tune.Schedule`; a
template says *what* (the plan for its model family) and these functions say *how*. The order
matters and is fixed by the caller: tensor parallelism first (it changes parameter shapes), with
sequence parallelism on top of it, then activation checkpointing (it wraps the sharded forward), then pipeline cuts and data parallelism.

Plan keys are paths relative to the node the plan is applied to; ``*`` matches one path component
(``"h.*.attn.c_attn"``).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._partition import (  # noqa: F401  (re-exported)
    CKPT_SPREAD,
    checkpointed_indices,
    interleaved_microbatches_ok,
    stage_block_counts,
    stage_boundaries,
)
from .errors import ScheduleError
from .parallel import _comm
from .parallel._vocab_loss import mark_loss_parallel
from .schedule._pipeline import SEQUENCE_SHARDS, sequence_shards  # noqa: F401  (re-exported)
from .schedule._schedule import Schedule, state_of
from .schedule._sharding import LinearRule, is_conv1d, rule_for
from .schedule._state import _ensure_forward_patched
from .styles import (  # noqa: F401  (re-exported)
    Colwise,
    DivideAttr,
    ReduceInputGrad,
    Rowwise,
    Style,
    Unshardable,
    VocabParallel,
)


def glob_to_regex(pattern: str) -> str:
    """Plan-key glob (``*`` = one path component) as a regular expression."""
    return ".".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))


def select(sch: Schedule, pattern: str) -> list[Schedule]:
    """Nodes under ``sch`` matching a plan key; a key that matches nothing is an error."""
    nodes = sch.find(glob_to_regex(pattern)) if "*" in pattern else [sch[pattern]]
    if not nodes:
        raise ScheduleError(f"plan key '{pattern}' matches no module under '{sch.path or 'the model'}'")
    return nodes


def _output_axis(node: Schedule, param: str) -> int:
    rule = rule_for(node.mod)
    axis = rule.out_axis.get(param)
    if axis is None:
        raise ScheduleError(f"'{node.path}': {type(node.mod).__name__}.{param} has no output-feature axis")
    return axis


def _enter_region(node: Schedule, sequence_parallel: bool) -> None:
    """The entry of a tensor-parallel region: its (replicated) input's gradient is partial, so it
    is all-reduced in backward; under sequence parallelism the input arrives as a sequence shard,
    so it is all-gathered in forward and the gradient reduce-scattered back in backward."""
    if sequence_parallel:
        node.sync("fwd_pre", gather_sequence)
    else:
        node.sync("bwd_post", "all_reduce")


def _apply_style(node: Schedule, style: Style, sequence_parallel: bool = False) -> None:
    if isinstance(style, Colwise):
        # a horizontally fused layer (QKV) is split block by block, whatever its style says
        num_fused = getattr(node.mod, "split_sizes", None) or style.num_fused
        for param in ("weight", "bias"):
            if getattr(node.mod, param, None) is not None and not node.is_sharded(param):
                node.shard(param, _output_axis(node, param), num_fused=num_fused)
        head = style.gather_output or style.vocab_parallel_loss
        if style.reduce_input_grad:
            # the LM head (gather_output) runs after the blocks, on the whole sequence
            _enter_region(node, sequence_parallel and not head)
        if style.gather_output and style.vocab_parallel_loss:
            raise ScheduleError(f"'{node.path}': an LM head either gathers its output or keeps it sharded for the "
                                "vocabulary-parallel loss, not both")
        if style.gather_output:
            node.sync("fwd_post", "all_gather", axis=-1)
        if style.vocab_parallel_loss:  # the training step's loss reads the marker
            mark_loss_parallel(node.root.mod, node.world_size)
    elif isinstance(style, Rowwise):
        node.shard("weight", rule_for(node.mod).in_axis.get("weight", 1))
        if sequence_parallel:  # sum the partial output and keep this rank's tokens; the bias follows
            node.sync("fwd_post", "reduce_scatter", axis=SEQUENCE_AXIS)
        else:
            node.sync("fwd_post", "all_reduce")
    elif isinstance(style, VocabParallel):  # the embedding runs before the blocks: unchanged
        if not node.is_sharded("weight"):
            node.shard("weight", 0)
        node.sync("fwd_post", "all_reduce")
    elif isinstance(style, ReduceInputGrad):
        _enter_region(node, sequence_parallel)
    elif isinstance(style, DivideAttr):
        for name in style.names:
            value = getattr(node.mod, name)
            if value % node.world_size:
                raise ScheduleError(f"'{node.path}'.{name} = {value} is not divisible by tp={node.world_size}")
            node.set_attr(name, value // node.world_size)
    elif isinstance(style, Unshardable):
        raise ScheduleError(f"'{node.path}': {style.reason}")
    else:
        raise ScheduleError(f"unknown tensor-parallel style {style!r}")


def vocab_parallel_head(plan: Mapping[str, Style | Sequence[Style]]) -> dict[str, Style | Sequence[Style]]:
    """``plan`` with its LM head (the ``Colwise`` style that gathers its output) keeping its output
    sharded over the vocabulary instead (``loss_parallel=on``); a plan without one is refused."""
    def head(style):
        if isinstance(style, Colwise) and style.gather_output:
            return replace(style, gather_output=False, vocab_parallel_loss=True)
        return style

    out = {k: [head(s) for s in v] if isinstance(v, Sequence) else head(v) for k, v in plan.items()}
    if out == dict(plan):
        raise ScheduleError("loss_parallel: the tensor-parallel plan has no LM head (Colwise(gather_output=True)) "
                            "whose output could stay sharded over the vocabulary")
    return out


def apply_tensor_parallel(sch: Schedule, plan: Mapping[str, Style | Sequence[Style]], *,
                          sequence_parallel: bool = False) -> None:
    """Megatron-style tensor parallelism over ``sch.group`` from a ``{path: style}`` plan.

    Does nothing when the group has one rank, so the same template serves tp=1 at no cost.
    Parameters tied to one already sharded (GPT-2's LM head and token embedding) are not sharded
    again: the styles only add their communication.

    ``sequence_parallel`` prepares the blocks for :func:`apply_sequence_parallel` (Megatron's
    sequence parallelism): the entry of each region (``ReduceInputGrad``, ``Colwise`` reducing its
    input gradient) all-gathers the sequence-sharded input instead of all-reducing its gradient
    (backward: reduce-scatter), and ``Rowwise`` reduce-scatters its partial output along the
    sequence instead of all-reducing it. The embedding and the LM head (``Colwise`` with
    ``gather_output``) run outside the blocks on the whole sequence and are unchanged.
    """
    if sch.world_size == 1:
        return
    for pattern, styles in plan.items():
        styles = styles if isinstance(styles, Sequence) else (styles,)
        for node in select(sch, pattern):
            for style in styles:
                _apply_style(node, style, sequence_parallel)


# ------------------------------------------------------------------ sequence parallelism
# The token axis: the sequence of [batch, seq, hidden], and the rows of [batch * seq, hidden] that
# some decoder layers flatten to before their MLP (OPT). Gathering and reduce-scattering a flattened
# MLP's rows orders its tokens rank by rank instead of batch by batch; the MLP works token by token
# and each rank gets its own rows back, so the result is the same.
SEQUENCE_AXIS = -2
SEQUENCE_PARTIAL = "sequence_partial"  # annotation: the gradient is partial over the tp group


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """A ``sync`` op: the sequence-sharded input of a tensor-parallel region, whole. Its backward
    is a reduce-scatter, not ``_comm.gather``'s "keep my chunk": what follows the gather is column
    parallel, so each rank's gradient of the gathered tensor is a partial sum over the ranks'
    feature slices (without sequence parallelism: the bwd_post all-reduce). The whole tensor is remembered with its shard, so that under
    :func:`sequence_parallel_activations` what the region's linear layers save of it for backward
    is the shard (see there)."""
    if _comm.group_size(group) == 1:
        return x
    whole = _comm.gather_reduce(x, SEQUENCE_AXIS, group)
    key = id(whole)
    _GATHERED[key] = (weakref.ref(whole, lambda _, key=key: _GATHERED.pop(key, None)), x, group)
    return whole


# id(gathered tensor) -> (weak reference to it, this rank's shard as gathered, with its autograd history,
# group), while it lives
_GATHERED: dict[int, tuple[weakref.ref, torch.Tensor, object]] = {}


def _gathered_from(t: torch.Tensor) -> tuple[torch.Tensor, object] | None:
    """(this rank's shard, group) of ``t`` if ``t`` is the output of :func:`gather_sequence`, alive."""
    entry = _GATHERED.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1], entry[2]


@dataclass(frozen=True)
class _Regather:
    """A saved activation kept as this rank's sequence shard; gathered again when backward reads it."""

    shard: torch.Tensor
    group: object
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _pack_gathered(t: torch.Tensor):
    base = t if t._base is None else t._base  # a linear layer saves a 2-D view of its 3-D input
    entry = _GATHERED.get(id(base))
    if entry is None or entry[0]() is not base:
        return t
    return _Regather(entry[1].detach(), entry[2], t.size(), t.stride(), t.storage_offset())


def _unpack_gathered(packed):
    if not isinstance(packed, _Regather):
        return packed
    whole = _comm._all_gather(packed.shard, SEQUENCE_AXIS % packed.shard.dim(), packed.group)
    return whole.as_strided(packed.size, packed.stride, packed.offset)


def sequence_parallel_activations():
    """Keep shards, not gathered tensors, for backward (Megatron's sequence parallelism does the
    same): the linear layers at the entry of a tensor-parallel region save their input, the whole
    sequence all-gathered, for their weight gradient; saved as this rank's shard and gathered
    again when backward reads it, each costs ``1/tp`` of the memory for one more all-gather in
    backward (per layer reading it: Q, K and V each gather again). A tensor autocast cast is a
    copy, not the gathered tensor, and is kept as it is. The training step runs every forward
    under this context; it does nothing where nothing was gathered."""
    return torch.autograd.graph.saved_tensors_hooks(_pack_gathered, _unpack_gathered)


class _GatheredLinear(torch.autograd.Function):
    """A column-parallel linear layer fed by a sequence gather, with Megatron's overlap of its
    backward communication (``LinearWithGradAccumulationAndAsyncCommunication``, sequence parallel).

    Forward multiplies the gathered input (``whole``, computed by the region's gather and used here
    without its autograd history) and saves only this rank's ``shard``. Backward launches the
    all-gather of the shard asynchronously and computes the input gradient meanwhile, then launches
    the reduce-scatter of the input gradient asynchronously and computes the weight gradient
    meanwhile: two of the region's three backward collectives run beside a product (under NCCL on
    their own stream; gloo runs asynchronous work on its own threads). The gradient goes to the
    shard directly, so the gather's own backward reduce-scatter never runs for this consumer.

    ``transposed``: the weight is stored ``[in, out]`` (Hugging Face's Conv1D). Under autocast the
    products run in its dtype, as ``F.linear`` would, and the saved shard is that dtype's copy.
    """

    @staticmethod
    def forward(ctx, shard, whole, weight, bias, group, transposed):
        # under autocast the product casts its operands (the weight's cast from autocast's cache)
        if not transposed:
            out = F.linear(whole, weight, bias)
        else:  # as Conv1D computes it
            flat = whole.reshape(-1, whole.shape[-1])
            out = (flat.matmul(weight) if bias is None else torch.addmm(bias, flat, weight))
            out = out.view(*whole.shape[:-1], weight.shape[-1])
        # the shard in the product's dtype: what autocast's cast of the gathered input holds, of this
        # rank's tokens; the weight itself (a parameter), cast again in backward: a saved cast
        # would hold a second copy of the weight until backward
        ctx.save_for_backward(shard.detach().to(out.dtype), weight)
        ctx.group, ctx.transposed, ctx.axis = group, transposed, SEQUENCE_AXIS % shard.dim()
        ctx.dtypes = (shard.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        group, axis = ctx.group, ctx.axis
        w = weight.to(shard.dtype)
        grad = grad.to(shard.dtype)
        gathered = _comm.start_all_gather(shard, axis, group)
        grad_input = grad.matmul(w.t() if ctx.transposed else w).to(ctx.dtypes[0])
        total = gathered()
        scattered = _comm.start_reduce_scatter(grad_input, axis, group)
        grad_weight = grad_bias = None
        flat_grad, flat_total = grad.reshape(-1, grad.shape[-1]), total.reshape(-1, total.shape[-1])
        if ctx.needs_input_grad[2]:
            product = flat_total.t().matmul(flat_grad) if ctx.transposed else flat_grad.t().matmul(flat_total)
            grad_weight = product.to(ctx.dtypes[1])
        if ctx.needs_input_grad[3]:
            grad_bias = flat_grad.sum(0).to(ctx.dtypes[2])
        return scattered(), None, grad_weight, grad_bias, None, None


def overlapped_linear_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a region's single column-parallel consumer (see :func:`apply_sequence_parallel`):
    :class:`_GatheredLinear` when ``x`` is the region's gathered input and gradients are on; else
    the layer's own forward (no gather happened: a dry run with communication disabled, inference,
    or another input)."""
    found = _gathered_from(x) if torch.is_grad_enabled() else None
    if found is None:
        return type(module).forward(module, x)
    shard, group = found
    return _GatheredLinear.apply(shard, x.detach(), module.weight, module.bias, group, is_conv1d(module))


def _single_column_parallel_consumer(region: Schedule) -> Schedule | None:
    """The one column-parallel linear layer under a region that gathers the sequence (the region's
    node itself when it is the layer), or None when there are several (separate Q, K and V read the
    gathered input each: they keep sharing one reduce-scatter, the gather's backward) or the layer
    is traced through (a decomposed layer's product is part of its parent's graph, not a call)."""
    found = []
    for _, node in region.named_schedules():
        st = state_of(node.mod)
        rule = rule_for(node.mod)
        spec = st.shards.get("weight") if st is not None else None
        if isinstance(rule, LinearRule) and spec is not None and spec.axis == rule.out_axis["weight"]:
            found.append(node)
    if len(found) != 1:
        return None
    st = state_of(found[0].mod)
    if st.decomposed or st.compute is not None:
        return None
    return found[0]


def _syncs(node: Schedule) -> tuple[list, list]:
    st = state_of(node.mod)
    return (st.pre_syncs, st.post_syncs) if st is not None else ([], [])


def _gathers_sequence(node: Schedule) -> bool:
    return any(s.op is gather_sequence for s in _syncs(node)[0])


def _mark_sequence_partial(node: Schedule, gathered: bool = False) -> None:
    """Annotate the parameters under ``node`` that see only this rank's tokens: everything not
    sharded outside a gathered region (norms), and the biases that row-parallel layers add after
    their reduce-scatter. Parameters inside a gathered region see the whole sequence."""
    gathered = gathered or _gathers_sequence(node)
    st = state_of(node.mod)
    for name, param in node.mod.named_parameters(recurse=False):
        if param is None or node.is_sharded(name):
            continue
        if not gathered or (name == "bias" and st is not None and st.defers_bias):
            node.annotate(name, SEQUENCE_PARTIAL, True)
    for child in node.child.values():
        _mark_sequence_partial(child, gathered)


def apply_sequence_parallel(blocks: Sequence[Schedule]) -> None:
    """Megatron-style sequence parallelism (Korthikanti et al., 2022) over the blocks' tp group,
    after ``apply_tensor_parallel(..., sequence_parallel=True)``.

    Between the tensor-parallel regions the residual stream is cut along the sequence: each rank
    holds ``[batch, seq / tp, hidden]``, so norms, dropout and residual additions run on (and keep
    activations of) a shard. The first block scatters its input (backward: all-gather), the last
    one all-gathers its output (backward: keep this rank's chunk), so everything before and after
    the blocks runs on the whole sequence as before. Parameters the shards meet (norm weights and
    biases, row-parallel biases) get partial gradients: they are annotated
    ``sequence_partial`` and the training step sums them over the group
    (:func:`reduce_sequence_partial_gradients`). A region whose gathered input feeds one
    column-parallel linear layer (a fused QKV or gate/up projection, GPT-2's ``c_attn``) runs it with
    Megatron's overlap of the backward communication with its products
    (:class:`_GatheredLinear`); regions with several keep the gather's own backward. Does nothing on
    one rank.
    """
    if not blocks or blocks[0].world_size == 1:
        return
    if SEQUENCE_SHARDS in blocks[0].root.mod.__dict__:
        raise ScheduleError("sequence parallelism: already applied to this model")
    for block in blocks:
        for _, node in block.named_schedules():
            pre, post = _syncs(node)
            plain = [s for s in pre + post if s.op == "all_reduce"]
            if plain:
                where = "its input gradient" if plain[0].mode == "bwd_post" else "its output"
                raise ScheduleError(
                    f"sequence parallelism: '{node.path}' all-reduces {where}, which inside the blocks must "
                    "stay sequence-sharded; apply tensor parallelism with sequence_parallel=True"
                )
    if not any(_gathers_sequence(node) for block in blocks for _, node in block.named_schedules()):
        raise ScheduleError("sequence parallelism: no tensor-parallel region in the blocks gathers the sequence; "
                            "apply tensor parallelism with sequence_parallel=True first")
    blocks[0].sync("fwd_pre", "scatter", axis=SEQUENCE_AXIS)
    blocks[-1].sync("fwd_post", "all_gather", axis=SEQUENCE_AXIS)
    for block in blocks:
        _mark_sequence_partial(block)
        for _, region in list(block.named_schedules()):
            consumer = _single_column_parallel_consumer(region) if _gathers_sequence(region) else None
            if consumer is not None:
                state_of(consumer.mod).compute = overlapped_linear_forward
                _ensure_forward_patched(consumer.mod)
    blocks[0].root.mod.__dict__[SEQUENCE_SHARDS] = blocks[0].world_size


def sequence_partial_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` annotated ``sequence_partial`` by :func:`apply_sequence_parallel`
    (each once, in module order: the same on every tensor-parallel rank of a stage)."""
    seen, out = set(), []
    for m in model.modules():
        st = state_of(m)
        for name, tags in (st.annotations.items() if st is not None else ()):
            param = m._parameters.get(name)
            if tags.get(SEQUENCE_PARTIAL) and param is not None and id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    return out


@torch.no_grad()
def reduce_sequence_partial_gradients(model: nn.Module, gradient: Callable[[torch.Tensor], torch.Tensor | None],
                                      group) -> None:
    """Sum the gradients of ``model``'s sequence-partial parameters over the tensor-parallel
    ``group`` (one all-reduce per dtype). ``gradient(param)`` is the gradient the optimizer steps
    ``param`` with (an fp32 master's; a DTensor shard under FSDP, reduced locally)."""
    if _comm.group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in sequence_partial_parameters(model):
        grad = gradient(param)
        if grad is not None:
            grad = _comm.local_tensor(grad)
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


def apply_checkpointing(blocks: Sequence[Schedule], ratio: float, spread: str = CKPT_SPREAD, *,
                        policy: str = "full") -> list[int]:
    """Checkpoint a ``ratio`` of the repeated ``blocks`` (chosen by ``spread``, see
    :func:`checkpointed_indices`) with ``policy`` (``"full"``: recompute the whole block;
    ``"selective"``: keep its matmul outputs, recompute the rest; see
    :meth:`Schedule.checkpoint`); returns the indices checkpointed."""
    chosen = checkpointed_indices(len(blocks), ratio, spread)
    for i in chosen:
        blocks[i].checkpoint(policy)
    return chosen


def apply_pipeline_cuts(blocks: Sequence[Schedule], pp: int) -> list[int]:
    """Cut the repeated ``blocks`` into ``pp`` stages of equal size, or differing by one block with
    the first and last stages the smaller (:func:`stage_block_counts`); returns the cut indices."""
    cuts = stage_boundaries(len(blocks), pp)
    for i in cuts:
        blocks[i].cut_pipeline_stage()
    return cuts
