"""Context parallelism (the ``cp`` knob): each of ``cp`` ranks holds two chunks of every sequence
(see "Load balance" below); attention all-gathers keys and values over the cp group, so every
query sees the whole sequence up to its own global position.

* Positions: each rank passes the global ``position_ids`` of its chunks to the model (absolute
  embeddings and rotary tables see the true positions).
* Attention: a Hugging Face attention function (:data:`CP_ATTENTION`, registered with
  ``AttentionInterface``) gathers ``K`` and ``V`` along the sequence (``_comm.gather_reduce``: its
  backward reduce-scatters their gradients) and masks causally by the global positions of this
  rank's queries and of the gathered keys. The model's own mask is not built (its mask function
  returns None): the sequences are unpadded, as every batch the runtime trains on.
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
    from transformers.integrations.sdpa_attention import repeat_kv

    group, rank, size = _current()
    if size > 1:  # [batch, heads, seq, head_dim]: the ranks' chunks along the sequence, in rank order
        key, value = _comm.gather_reduce(key, 2, group), _comm.gather_reduce(value, 2, group)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    q_len = query.shape[2]
    allowed = _causal_mask(q_len, rank, size, query.device)
    dropout = dropout if module.training else 0.0
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
