"""``slapo-tune demo``: schedule a small model with tensor parallelism on CPU ranks and verify it."""

from __future__ import annotations

import argparse

from ..device import device_setup
from ..launch import launch
from ..models import build_model
from ..problem import ProblemSpec
from . import EXIT_FAILED, EXIT_OK
from ._common import world_size_int

HELP = "schedule a small model with tensor parallelism on CPU ranks and verify it against the unscheduled one"
BATCH, SEQ = 4, 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2-tiny",
                   help="preset or config.json of any template's family, e.g. gpt2-tiny, llama-tiny, bert-tiny, "
                        "opt-tiny (default: %(default)s)")
    p.add_argument("--world-size", type=world_size_int, default=2,
                   help="CPU ranks, the tensor-parallel degree: it must divide the heads, vocabulary and MLP "
                        "width (default: %(default)s)")


def demo_rank(ctx, spec: ProblemSpec) -> str:
    """The 20-line example of docs/schedule-language.md, as one rank runs it, with the plan of the problem's template."""
    import torch

    # torch-free: every --help imports this module; these import torch
    from .._verify import verify
    from ..parallelize import apply_checkpointing, apply_tensor_parallel
    from ..schedule._build import build
    from ..schedule._schedule import create_schedule

    problem = spec.resolve()  # the template the command checked the world size against
    template, batch, seq = problem.template, problem.workload.global_batch, problem.workload.seq_len
    reference = build_model(spec.model)
    sch = create_schedule(build_model(spec.model))
    apply_tensor_parallel(sch, template.tensor_parallel_plan(sch.mod))
    apply_checkpointing(template.block_nodes(sch), 0.5)
    model = build(sch, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, reference.config.vocab_size, (batch, seq), generator=g)
    report = verify(model, reference, {"input_ids": ids, "labels": ids}, raise_on_failure=False)
    return str(report)


def run(args: argparse.Namespace) -> int:
    # the world size is the tensor-parallel degree: one line naming the legal ones where it is not
    problem = ProblemSpec(args.model, args.world_size, global_batch=BATCH, seq_len=SEQ).resolve()
    problem.plan(f"tp={args.world_size}")
    print(f"Scheduling {args.model} ({problem.template.name} template) with tensor parallelism over "
          f"{args.world_size} CPU ranks (vocab-parallel embedding, attention, MLP, LM head) and checkpointing "
          "half of the blocks;")
    print("verifying loss, module outputs and every gradient against the unscheduled model...")
    # CPU ranks even where GPUs are present: the demo's model is built on the CPU
    reports = launch(demo_rank, args.world_size, args=(problem.spec,), timeout=300,
                     backend=device_setup("cpu").backend)
    print(reports[0])
    return EXIT_OK if reports[0].startswith("verify: OK") else EXIT_FAILED
