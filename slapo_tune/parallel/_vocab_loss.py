"""Vocabulary-parallel cross-entropy (Megatron-LM's loss parallel): the loss of logits that each
tensor-parallel rank holds a contiguous slice of the vocabulary of, without gathering them.

Per token: the maximum logit (all-reduce max), the sum of the exponentials (all-reduce sum) and
the target's logit (picked on the rank owning it, all-reduce sum) give
``log(sum exp(z - max)) - (z_target - max)``, the unsharded cross-entropy. Backward is
``softmax - onehot`` on this rank's slice only: no communication, nothing of the full vocabulary
width is ever held. Causal language models shift the labels as Hugging Face does (token ``t``
predicts label ``t + 1``) and skip ``ignore_index`` (-100); the mean is over the tokens counted,
which every tensor-parallel rank agrees on (the labels are replicated).

On a group of one rank (or with communication disabled: shape-only dry runs) it is the plain
cross-entropy of the local logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ScheduleError
from . import _comm

IGNORE_INDEX = -100
# set on the scheduled model's root module (its __dict__, copied with the model's structure) by
# :func:`mark_loss_parallel`: the number of vocabulary shards the LM head's logits come in
LOSS_PARALLEL = "_slapo_loss_parallel"


def mark_loss_parallel(root: torch.nn.Module, shards: int) -> None:
    """Schedule ``root`` for this loss: its LM head's logits come in ``shards`` vocabulary slices
    (a tensor-parallel plan whose head keeps its output sharded; 1: the whole vocabulary, the loss
    computed in place all the same)."""
    root.__dict__[LOSS_PARALLEL] = shards


def loss_parallel(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or a module holding it: a pipeline stage) was scheduled for this loss
    (:func:`mark_loss_parallel`)."""
    return any(LOSS_PARALLEL in m.__dict__ for m in model.modules())


def require_causal_lm_loss(model: torch.nn.Module, knob: str, does: str) -> None:
    """Refuse (naming ``knob``) a model whose own loss is not Hugging Face's causal-LM cross-entropy,
    which the knob computes its own way (``does``: what it does to that loss)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    if getattr(model.loss_function, "__name__", "") != ForCausalLMLoss.__name__:
        raise ScheduleError(f"{knob}: {type(model).__name__}'s loss is not the causal-LM cross-entropy {does}")


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Causal-LM targets, as Hugging Face shifts them: token ``t`` predicts label ``t + 1`` (the last
    token: ``ignore_index``)."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _reduce(x: torch.Tensor, op, group) -> None:
    if _comm.group_size(group) > 1 and not _comm.is_disabled():
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        # logits [tokens, vocab / tp] (any float dtype), target [tokens] (global vocabulary ids)
        width = logits.shape[-1]
        start = _comm.group_rank(group) * width if not _comm.is_disabled() else 0
        row_max = logits.max(dim=-1).values.float()
        _reduce(row_max, dist.ReduceOp.MAX, group)
        # one fp32 buffer of the slice, worked on in place: shifted, exponentiated, then the softmax
        # (beside the caller's logits: 4 + their bytes per element at most)
        shifted = logits.to(torch.float32, copy=True).sub_(row_max.unsqueeze(-1))
        local = target - start
        owned = (local >= 0) & (local < width) & (target != ignore_index)
        local = torch.where(owned, local, torch.zeros_like(local))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * owned
        _reduce(picked, dist.ReduceOp.SUM, group)
        exp = shifted.exp_()  # in place: the shifted logits are not needed again
        sum_exp = exp.sum(dim=-1)
        _reduce(sum_exp, dist.ReduceOp.SUM, group)
        counted = target != ignore_index
        per_token = (sum_exp.log() - picked) * counted
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # what backward needs, in the same buffer
        ctx.save_for_backward(softmax, local, owned, counted)
        return per_token

    @staticmethod
    def backward(ctx, grad):
        if getattr(ctx, "spent", False):
            raise ScheduleError("vocabulary-parallel loss: its backward reuses the softmax buffer and runs once")
        ctx.spent = True
        softmax, local, owned, counted = ctx.saved_tensors
        grad_logits = softmax  # in place, as Megatron-LM: no second [tokens, vocab / tp] buffer
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -owned.to(grad_logits.dtype).unsqueeze(-1))
        grad_logits.mul_((grad * counted).unsqueeze(-1))
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group, *, shift: bool = True,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` (``[..., vocab / tp]``: this rank's contiguous slice of
    the vocabulary, rank ``r`` holding ids ``[r * vocab / tp, (r + 1) * vocab / tp)``) against
    ``labels`` (``[...]``, global ids), over the tensor-parallel ``group``: equal to Hugging Face's
    causal-LM loss of the gathered logits (``shift``: token ``t`` predicts label ``t + 1``), or to
    plain cross-entropy without ``shift``. Computed in fp32 as Hugging Face does; the gradient comes
    back in the logits' dtype."""
    if logits.shape[:-1] != labels.shape:
        raise ScheduleError(f"vocabulary-parallel loss: logits {tuple(logits.shape)} do not match labels "
                            f"{tuple(labels.shape)}")
    if shift:
        labels = shift_labels(labels, ignore_index)
    logits = logits.reshape(-1, logits.shape[-1])  # upcast inside, in the buffer the loss keeps
    target = labels.reshape(-1).to(logits.device)
    per_token = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)
    return per_token.sum() / (target != ignore_index).sum()
