"""``slapo-tune demo``: schedule a small GPT-2 with tensor parallelism on CPU ranks and verify it."""

from __future__ import annotations

import argparse

from ._common import positive_int

HELP = "schedule a small GPT-2 with tensor parallelism on CPU ranks and verify it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--world-size", type=positive_int, default=2)


def demo_rank(ctx, preset: str, family: str, batch: int, seq: int) -> str:
    """The README's 20-line example, as one rank runs it."""
    import importlib

    import torch

    from .._build import build
    from .._schedule import create_schedule
    from .._verify import verify
    from ..models import build_model
    from ..parallelize import apply_checkpointing, apply_tensor_parallel

    template = importlib.import_module(f"search_spaces.{family}")
    reference = build_model(preset)
    sch = create_schedule(build_model(preset))
    apply_tensor_parallel(sch, template.TP_PLAN)
    blocks = sch[template.BLOCKS]
    apply_checkpointing([blocks[name] for name in blocks.child], 0.5)
    model = build(sch, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, reference.config.vocab_size, (batch, seq), generator=g)
    report = verify(model, reference, {"input_ids": ids, "labels": ids}, raise_on_failure=False)
    return str(report)


def run(args: argparse.Namespace) -> int:
    from ..device import device_setup
    from ..launch import launch
    from . import EXIT_FAILED, EXIT_OK

    print(f"Scheduling {args.model} with tensor parallelism over {args.world_size} CPU ranks "
          "(vocab-parallel embedding, attention, MLP, LM head) and checkpointing half of the blocks;")
    print("verifying loss, module outputs and every gradient against the unscheduled model...")
    # CPU ranks even where GPUs are present: the demo's model is built on the CPU
    reports = launch(demo_rank, args.world_size, args=(args.model, "gpt2", 4, 64), timeout=300,
                     backend=device_setup("cpu").backend)
    print(reports[0])
    return EXIT_OK if reports[0].startswith("verify: OK") else EXIT_FAILED
