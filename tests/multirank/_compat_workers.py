"""Rank function of tests/multirank/test_compat_runtime.py: Slapo's sync ops, a vocabulary-sharded embedding
with Slapo's hooks and the rank-filtering logger, on two gloo ranks in one launch. Every expected
value is computed here with plain torch from tensors every rank can make (same seeds), not with
slapo-tune's collectives."""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

import slapo_tune.compat as slapo
from slapo_tune.compat.logger import get_logger
from slapo_tune.compat.model_schedule.gpt2 import gen_embedding_hooks
from slapo_tune.compat.sharding import sync_ops
from slapo_tune.errors import ShardingError


def _same_everywhere(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _grad_of(fn, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` and the gradient of ``sum(fn(x) * weight)`` with respect to ``x``."""
    x = x.clone().requires_grad_()
    out = fn(x)
    (out * weight).sum().backward()
    return out.detach(), x.grad


def _sync_ops(rank: int, world: int) -> dict[str, bool]:
    full = _same_everywhere(4, 6 * world, seed=3)
    weight = _same_everywhere(4, 6 * world, seed=4)
    mine = full.chunk(world, dim=1)[rank]
    # each rank weighs the output differently: the gradient that reaches a rank's input is then
    # a sum over ranks only where the op's backward sums
    factor = [float(r + 1) for r in range(world)]
    rank_weights = [weight * f for f in factor]
    out = {}

    got, grad = _grad_of(lambda x: sync_ops.all_gather_forward_output(x, 1, None, tensor_parallel_output_grad=False),
                         mine, rank_weights[rank])
    out["all_gather"] = torch.equal(got, full) and torch.allclose(grad, rank_weights[rank].chunk(world, 1)[rank])
    got, grad = _grad_of(lambda x: sync_ops.all_gather_forward_output(x, -1, None), mine, rank_weights[rank])
    summed = sum(rank_weights).chunk(world, 1)[rank]
    out["all_gather_reduce_grad"] = torch.equal(got, full) and torch.allclose(grad, summed)

    got, grad = _grad_of(lambda x: sync_ops.reduce_scatter_forward_output(x, 1, None), full * factor[rank],
                         weight.chunk(world, 1)[rank])
    out["reduce_scatter"] = (torch.allclose(got, sum(factor) * mine) and torch.allclose(grad, weight))

    got, grad = _grad_of(lambda x: sync_ops.scatter_forward_output(x, 1, None), full,
                         rank_weights[rank].chunk(world, 1)[rank])
    gathered = torch.cat([rank_weights[r].chunk(world, 1)[r] for r in range(world)], dim=1)
    out["scatter"] = torch.equal(got, mine) and torch.allclose(grad, gathered)

    got, grad = _grad_of(lambda x: sync_ops.reduce_forward_output(x, None), full * factor[rank], weight)
    out["reduce_forward"] = torch.allclose(got, sum(factor) * full) and torch.equal(grad, weight)

    got, grad = _grad_of(lambda x: sync_ops.reduce_backward_grad(x, None), full, rank_weights[rank])
    out["reduce_backward"] = torch.equal(got, full) and torch.allclose(grad, sum(rank_weights))
    return out


class _Embedder(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, 6)

    def forward(self, ids):
        return self.embedding(ids)


def _vocab_sharded_embedding(rank: int, world: int) -> dict:
    vocab = 8 * world
    torch.manual_seed(11)
    model = _Embedder(vocab)
    reference = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch["embedding"].shard("weight", axis=0)
    pre, post = gen_embedding_hooks(sch, vocab)
    sch["embedding"].sync(mode="fwd_pre", sync_op_or_fn=pre)
    sch["embedding"].sync(mode="fwd_post", sync_op_or_fn=post)
    ids = torch.tensor([[0, 1, vocab // 2 - 1, vocab // 2, vocab - 1, 3]])  # both ranks' rows, edges included
    weight = _same_everywhere(1, 6, 6, seed=12)
    (model(ids) * weight).sum().backward()
    (reference(ids) * weight).sum().backward()
    rows = [torch.empty_like(model.embedding.weight.grad) for _ in range(world)]
    torch.distributed.all_gather(rows, model.embedding.weight.grad)
    wrong = _Embedder(vocab)
    wrong_sch = slapo.create_schedule(wrong)
    wrong_sch["embedding"].shard("weight", axis=0)
    wrong_sch["embedding"].sync(mode="fwd_pre", sync_op_or_fn=gen_embedding_hooks(wrong_sch, vocab + 2)[0])
    try:
        wrong(ids)
        refused = ""
    except ShardingError as err:
        refused = str(err)
    return {"output": torch.allclose(model(ids), reference(ids)),
            "grad": torch.allclose(torch.cat(rows), reference.embedding.weight.grad), "refused": refused}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _rank_logger() -> list[str]:
    logger = get_logger("compat-test")
    records = _Records()
    logger.logger.addHandler(records)
    logger.info("only on rank %d", 0, ranks=0)
    logger.warning("everywhere")
    logger.info("on ranks %s", [1], ranks=[1])
    return records.messages


def run_compat_runtime(ctx) -> dict:
    r, w = ctx.rank, ctx.world_size
    return {"sync_ops": _sync_ops(r, w), "embedding": _vocab_sharded_embedding(r, w), "log": _rank_logger()}
