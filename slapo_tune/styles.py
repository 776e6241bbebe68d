"""The tensor-parallel styles a template's plan maps module paths to.

Plain data, so that templates (and ``plan``, which reads only their spaces) need no torch;
:mod:`slapo_tune.parallelize` applies them (and re-exports them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Colwise:
    """Shard the output features (weight and bias). The input gradient is partial, so it is
    all-reduced in backward; set ``reduce_input_grad=False`` when a parent reduces it once for
    several projections of the same input (Q, K and V). ``gather_output`` all-gathers the
    partitioned output (an LM head); ``vocab_parallel_loss`` instead keeps an LM head's output
    sharded over the vocabulary, for the vocabulary-parallel cross-entropy
    (:func:`slapo_tune.parallel._vocab_loss.vocab_parallel_cross_entropy`, the ``loss_parallel`` knob)."""

    num_fused: int = 1
    gather_output: bool = False
    reduce_input_grad: bool = True
    vocab_parallel_loss: bool = False


@dataclass(frozen=True)
class ReduceInputGrad:
    """All-reduce the gradient of a module's input once, for all column-parallel layers inside it."""


@dataclass(frozen=True)
class Rowwise:
    """Shard the input features; the partial output is all-reduced, then the bias is added."""


@dataclass(frozen=True)
class VocabParallel:
    """Shard an embedding's vocabulary; the masked partial lookups are all-reduced."""


@dataclass(frozen=True)
class DivideAttr:
    """Divide plain attributes (head counts, split sizes) by the tensor-parallel size."""

    names: tuple[str, ...]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", names)


@dataclass(frozen=True)
class Unshardable:
    """A layer the plan cannot shard, and why: tensor parallelism over it is refused."""

    reason: str


Style = Colwise | Rowwise | VocabParallel | DivideAttr | ReduceInputGrad | Unshardable
