"""What several commands share: the model/world/space arguments and the problem they describe."""

from __future__ import annotations

import argparse

from ..problem import ProblemSpec


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_problem_arguments(p: argparse.ArgumentParser, *, model: str | None = None, world_size: int | None = None,
                          global_batch: int | None = None) -> None:
    """``--model``, ``--world-size``, ``--space``, ``--global-batch``, ``--seq-len`` (required
    unless a default is given)."""
    p.add_argument("--model", required=model is None, default=model,
                   help="preset name or path to a config.json / model directory"
                   + (" (default: %(default)s)" if model else ""))
    p.add_argument("--world-size", type=positive_int, required=world_size is None, default=world_size,
                   help="number of ranks" + (" (default: %(default)s)" if world_size else ""))
    p.add_argument("--space", default=None,
                   help="template: gpt2, llama, bert, opt, generic, module:attr or a .py file (default: from the config)")
    p.add_argument("--global-batch", type=positive_int, default=global_batch,
                   help="global batch, held fixed (default: %(default)s)" if global_batch else
                   "global batch, held fixed (default: 8 x world size)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="sequence length (default: 128, or the model's positions if fewer)")


def add_precision_argument(p: argparse.ArgumentParser, default_help: str) -> None:
    """``--precision`` (see :mod:`slapo_tune.precision`)."""
    from ..precision import PRECISIONS

    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="; ".join(f"{name}: {prec.doc}" for name, prec in PRECISIONS.items()) + f" (default: {default_help})")


def problem_spec(args: argparse.Namespace, **fields) -> ProblemSpec:
    """The :class:`ProblemSpec` of the parsed problem arguments (plus ``fields``)."""
    return ProblemSpec(args.model, args.world_size, template=args.space, global_batch=args.global_batch,
                       seq_len=args.seq_len, **fields)

