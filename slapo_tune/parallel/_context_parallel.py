"""Context parallelism (the ``cp`` knob): each of ``cp`` ranks holds two chunks of every sequence
(see "Load balance" below); attention all-gathers keys and values over the cp group, so every
query sees the whole sequence up to its own global position.

* Positions: each rank passes the global ``position_ids`` of its chunks to the model (absolute
  embeddings and rotary tables see the true positions).
* Attention: a Hugging Face attention function (:data:`CP_ATTENTION`, registered with
  ``AttentionInterface``) all-gathers ``K`` and ``V`` along the sequence, at the key/value heads'
  width, and attends causally by global position. The model's own mask is not built (its mask
  function returns None): the sequences are unpadded, as every batch the runtime trains on.

  ``sdpa`` without attention dropout runs as Megatron-LM's all-gather context parallelism does
  (Transformer Engine's ``AttnFuncWithCPAndKVAllGather``; :class:`_ChunkedCausalAttention`): each
  of the rank's two query chunks attends to the keys before it, in two fused flash-attention calls
  (the keys of earlier chunks, all kept; its own chunk's, causal), merged by their log-sum-exps, so
  no mask is built and no masked block is computed. Its backward keeps only this rank's ``K`` and
  ``V`` (not the gathered ones), gathers them again, runs the kernels' own backward with the merged
  output and log-sum-exp, and reduce-scatters the keys' and values' gradients.

  ``eager``, and ``sdpa`` under attention dropout (the fused kernels' dropout cannot be replayed
  across two calls here, and torch's CPU flash kernel has none), gather ``K`` and ``V``
  (``_comm.gather_reduce``: its backward reduce-scatters their gradients), repeat them to the query
  heads and mask causally by the global positions of this rank's queries and of the gathered keys;
  autograd keeps the gathered keys and values for the backward.
* Loss: labels are shifted over the whole sequence before it is split (a chunk's last token
  predicts the next chunk's first), each rank sums its tokens' cross-entropy and divides by the
  token count of the whole micro-batch; the ranks' losses and gradients are then summed over the cp
  group (:class:`~slapo_tune.runtime.TrainStep`).

Load balance: under a causal mask a token's attention work grows with its position, so contiguous
chunks would leave the last rank with most of it. As Megatron-LM and torchtitan do, the sequence is
cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (one early, one
late): every rank attends over the same number of (query, key) pairs. The cost is nothing: the same
gathers, the mask built from the gathered keys' global positions (:func:`chunk_positions`).
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

from ..errors import ScheduleError
from . import _comm
from ._vocab_loss import IGNORE_INDEX, loss_parallel, require_causal_lm_loss, vocab_parallel_cross_entropy

# attention implementations under context parallelism, by the kernel they stand for
CP_ATTENTION = {"sdpa": "slapo_cp_sdpa", "eager": "slapo_cp_eager"}
# on the scheduled model's root: the cp degree the template applied (the cp group comes with the build)
CONTEXT_SHARDS = "_slapo_context_shards"

_state = threading.local()  # the running step's (group, rank, size) while a cp forward runs


class context:
    """``with context(group, rank, size):`` the cp attention functions gather over ``group``."""

    def __init__(self, group, rank: int, size: int):
        self.value = (group, rank, size)

    def __enter__(self):
        self.previous = getattr(_state, "value", None)
        _state.value = self.value
        return self

    def __exit__(self, *exc):
        _state.value = self.previous


def _current():
    # outside a context-parallel step (a template's shape-only forward, a plain call of the model)
    # the sequence is whole: plain causal attention
    value = getattr(_state, "value", None)
    return (None, 0, 1) if value is None else value


def chunk_positions(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """The global positions rank ``rank`` of ``size`` holds of a ``seq_len``-token sequence: chunks
    ``rank`` and ``2 * size - 1 - rank`` of ``2 * size`` (see the module's docstring), in that order."""
    if size == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * size):
        raise ScheduleError(f"cp={size}: the sequence length {seq_len} is not divisible by 2 x cp = {2 * size} "
                            "(each rank holds two chunks, for the causal load balance)")
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def _causal_mask(q_len: int, rank: int, size: int, device) -> torch.Tensor:
    """True where this rank's query ``i`` may attend to gathered key ``j`` (keys in rank order, each
    rank's chunks as :func:`chunk_positions` gives them)."""
    seq = q_len * size
    q = chunk_positions(seq, rank, size, device).unsqueeze(-1)
    k = torch.cat([chunk_positions(seq, r, size, device) for r in range(size)]).unsqueeze(0)
    return k <= q


def _attention(module, query, key, value, attention_mask, *, kernel: str, scaling=None, dropout: float = 0.0,
               **kwargs):
    group, rank, size = _current()
    dropout = dropout if module.training else 0.0
    groups = getattr(module, "num_key_value_groups", 1)
    kernels = _flash_kernels(query) if size > 1 and kernel == "sdpa" and dropout == 0.0 else None
    if kernels is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = _ChunkedCausalAttention.apply(query, key, value, kernels, group, rank, size, scale, groups)
        return out.transpose(1, 2).contiguous(), None
    return _gathered_attention(module, query, key, value, kernel, scaling, dropout, group, rank, size, groups)


def _gathered_attention(module, query, key, value, kernel, scaling, dropout, group, rank, size, groups):
    """Attention over the gathered keys and values, masked by global position (see the module's
    docstring: eager, and SDPA under dropout)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    if size > 1:  # [batch, heads, seq, head_dim]: the ranks' chunks along the sequence, in rank order
        key, value = _comm.gather_reduce(key, 2, group), _comm.gather_reduce(value, 2, group)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    q_len = query.shape[2]
    allowed = _causal_mask(q_len, rank, size, query.device)
    if kernel == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                                               dropout_p=dropout, scale=scaling)
        weights = None
    else:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query, key.transpose(2, 3)) * scale
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32)).to(query.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
        out = torch.matmul(weights, value)
    return out.transpose(1, 2).contiguous(), weights


class _FlashKernels:
    """One device's fused flash-attention forward (output and log-sum-exp) and backward, called on
    ``[batch, heads, seq, head_dim]`` tensors without dropout."""

    def forward(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError

    def backward(self, grad_out, q, k, v, out, lse, state, causal: bool, scale: float):
        raise NotImplementedError


class _CpuFlash(_FlashKernels):
    def forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()

    def backward(self, grad_out, q, k, v, out, lse, state, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)


class _CudaFlash(_FlashKernels):
    # FlashAttention-2 as torch wraps it: (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
    # rng_state, unused, debug_attn_mask); its backward takes the middle six back
    def forward(self, q, k, v, causal, scale):
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return result[0], result[1], tuple(result[2:8])

    def backward(self, grad_out, q, k, v, out, lse, state, causal, scale):
        cum_q, cum_k, max_q, max_k, rng_state, unused = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale)[:3]


def _flash_kernels(query: torch.Tensor) -> _FlashKernels | None:
    """The fused kernels for ``query``'s device and dtype; None where there are none (a CUDA
    tensor in fp32, or a head dimension FlashAttention-2 does not take): the gathered path then."""
    if query.device.type == "cpu":
        return _CpuFlash()
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16) \
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256:
        return _CudaFlash()
    return None


def _global_order(size: int) -> list[int]:
    """For each global chunk ``g`` of ``2 * size``, its slot in the all-gathered sequence (ranks in
    order, each rank's two chunks as :func:`chunk_positions` gives them)."""
    slots = []
    for g in range(2 * size):
        owner = g if g < size else 2 * size - 1 - g
        slots.append(2 * owner + (0 if g < size else 1))
    return slots


def _reorder_chunks(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Chunk ``i`` of the result is chunk ``order[i]`` of ``x`` along the sequence (dim 2)."""
    chunks = x.chunk(len(order), dim=2)
    return torch.cat([chunks[i] for i in order], dim=2)


def _merge(parts):
    """One softmax over the union of key sets from per-part (output, log-sum-exp) pairs."""
    acc = _accumulation_dtype(parts[0][0])
    lse = functools.reduce(torch.logaddexp, [part_lse.to(acc) for _, part_lse in parts])
    out = sum(o.to(acc) * torch.exp(part_lse.to(acc) - lse).unsqueeze(-1) for o, part_lse in parts)
    return out.to(parts[0][0].dtype), lse


def _accumulation_dtype(t: torch.Tensor) -> torch.dtype:
    # sums of partial outputs and gradients: fp32 at least (bf16 parts), fp64 kept (the tests' ground truth)
    return torch.promote_types(t.dtype, torch.float32)


class _ChunkedCausalAttention(torch.autograd.Function):
    """Causal attention of this rank's two query chunks over the all-gathered keys (see the module's
    docstring). Inputs are ``[batch, heads, 2 * chunk, head_dim]`` (``K``/``V`` with the key/value
    heads); the output is the query's shape."""

    @staticmethod
    def forward(ctx, query, key, value, kernels, group, rank, size, scale, groups):
        keys, values = (_in_global_order(t, group, size, groups) for t in (key, value))
        chunk = query.shape[2] // 2
        outs, lses, states = [], [], []
        for local, g in enumerate((rank, 2 * size - 1 - rank)):
            q = query[:, :, local * chunk:(local + 1) * chunk]
            parts, state = [], []
            for start, stop, causal in _key_spans(g, chunk):
                o, lse, st = kernels.forward(q, keys[:, :, start:stop], values[:, :, start:stop], causal, scale)
                parts.append((o, lse))
                state.append(st)
            out, lse = _merge(parts)
            outs.append(out)
            lses.append(lse)
            states.append(state)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.meta = (kernels, group, rank, size, scale, groups, states)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        kernels, group, rank, size, scale, groups, states = ctx.meta
        keys, values = (_in_global_order(t, group, size, groups) for t in (key, value))
        chunk = query.shape[2] // 2
        grad_q = torch.empty_like(query)
        acc = _accumulation_dtype(query)
        grad_k, grad_v = torch.zeros_like(keys, dtype=acc), torch.zeros_like(values, dtype=acc)
        grad_out = grad_out.contiguous()
        for local, g in enumerate((rank, 2 * size - 1 - rank)):
            rows = slice(local * chunk, (local + 1) * chunk)
            q, o, do, lse_rows = query[:, :, rows], out[:, :, rows], grad_out[:, :, rows], lse[:, :, rows].contiguous()
            dq = None
            for (start, stop, causal), st in zip(_key_spans(g, chunk), states[local], strict=True):
                # with the merged output and log-sum-exp, each part's backward gives its share of the
                # whole softmax's gradients (as ring attention's backward does)
                dq_part, dk, dv = kernels.backward(do, q, keys[:, :, start:stop], values[:, :, start:stop],
                                                   o, lse_rows, st, causal, scale)
                dq = dq_part.to(acc) if dq is None else dq + dq_part.to(acc)
                grad_k[:, :, start:stop] += dk.to(acc)
                grad_v[:, :, start:stop] += dv.to(acc)
            grad_q[:, :, rows] = dq.to(query.dtype)
        grad_key, grad_value = (_own_gradient(t.to(key.dtype), group, size, groups) for t in (grad_k, grad_v))
        return grad_q, grad_key, grad_value, None, None, None, None, None, None


def _key_spans(g: int, chunk: int) -> list[tuple[int, int, bool]]:
    """The key ranges global chunk ``g``'s queries attend to, as (start, stop, causal): its own chunk
    under the causal mask, and the chunks before it whole."""
    spans = [(g * chunk, (g + 1) * chunk, True)]
    if g > 0:
        spans.append((0, g * chunk, False))
    return spans


def _in_global_order(local: torch.Tensor, group, size: int, groups: int) -> torch.Tensor:
    """The whole sequence's keys (or values) in position order, repeated to the query heads."""
    from transformers.integrations.sdpa_attention import repeat_kv

    whole = _reorder_chunks(_comm._all_gather(local, 2, group), _global_order(size))
    return repeat_kv(whole, groups) if groups > 1 else whole


def _own_gradient(grad: torch.Tensor, group, size: int, groups: int) -> torch.Tensor:
    """This rank's chunks of the keys' (or values') gradient, summed over the query-head groups and
    the cp ranks: the conjugate of :func:`_in_global_order`."""
    if groups > 1:
        b, h, s, d = grad.shape
        grad = grad.view(b, h // groups, groups, s, d).sum(2)
    order = _global_order(size)
    rank_order = [order.index(slot) for slot in range(2 * size)]
    return _comm._reduce_scatter(_reorder_chunks(grad, rank_order), 2, group)


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    return _attention(module, query, key, value, attention_mask, kernel="sdpa", **kwargs)


def _eager(module, query, key, value, attention_mask, **kwargs):
    return _attention(module, query, key, value, attention_mask, kernel="eager", **kwargs)


def _no_mask(*args, **kwargs):
    return None  # the attention function masks by global position itself


def register() -> None:
    """Register the cp attention functions (and their mask functions) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for kernel, fn in (("sdpa", _sdpa), ("eager", _eager)):
        AttentionInterface.register(CP_ATTENTION[kernel], fn)
        AttentionMaskInterface.register(CP_ATTENTION[kernel], _no_mask)


def context_shards(model: torch.nn.Module) -> int:
    """The cp degree ``model`` (or a module holding it) was scheduled for (1: none)."""
    return next((m.__dict__[CONTEXT_SHARDS] for m in model.modules() if CONTEXT_SHARDS in m.__dict__), 1)


def apply_context_parallel(model: torch.nn.Module, cp: int, attn: str) -> str:
    """Schedule ``model`` for ``cp`` context-parallel ranks; returns the attention implementation to
    set on it (the cp variant of ``attn``, registered with transformers)."""
    if attn not in CP_ATTENTION:
        raise ScheduleError(f"cp={cp}: context parallelism runs attn=sdpa or eager, got {attn!r}")
    register()
    model.__dict__[CONTEXT_SHARDS] = cp
    return CP_ATTENTION[attn]


def split_sequence(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's two chunks of dim 1 (:func:`chunk_positions`)."""
    return x[:, chunk_positions(x.shape[1], rank, size, x.device)]


def cp_loss_fn(model: torch.nn.Module, tp_group, cp_group):
    """The causal-LM cross-entropy of this rank's chunk against already shifted labels, over the
    token count of the whole micro-batch (summed over ``cp_group``): the cp ranks' losses add up to
    Hugging Face's loss of the whole sequence."""
    require_causal_lm_loss(model, "cp", "context parallelism splits")
    sharded = loss_parallel(model)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = labels.to(logits.device)
        count = (labels != IGNORE_INDEX).sum().float()
        with torch.no_grad():
            dist.all_reduce(count, group=cp_group)
        if sharded:  # the mean over this rank's tokens, times their count: the sum
            local = (labels != IGNORE_INDEX).sum()
            mean = vocab_parallel_cross_entropy(logits, labels, tp_group, shift=False)
            total = mean * local
        else:
            total = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                      labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                                      reduction="sum")
        return total / count

    return loss_fn
