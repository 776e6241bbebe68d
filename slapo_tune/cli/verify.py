"""``slapo-tune verify``: one schedule point against the unscheduled model, on local ranks."""

from __future__ import annotations

import argparse

from .._partition import rank_block_counts
from ..launch import launch
from ..plan import knob_value
from ..precision import runnable
from . import EXIT_FAILED, EXIT_OK
from ._common import (
    add_device_argument,
    add_precision_argument,
    add_problem_arguments,
    device_of,
    duration,
    problem_spec,
    seed_int,
)

HELP = "check one schedule point against the unscheduled model on local ranks"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_problem_arguments(p, global_batch=8)
    p.add_argument("--knobs", default="", help="e.g. tp=2,pp=2,ckpt_ratio=0.5 (others: first legal value; default: the first legal point)")
    add_precision_argument(p, "fp32")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and the batch (default: %(default)s)")
    p.add_argument("--timeout", type=duration, default=600.0,
                   help="seconds (or 10m, 1h) before the ranks are killed (default: %(default)s)")
    add_device_argument(p)


def run(args: argparse.Namespace) -> int:
    from ..checks import verify_point  # torch-free: every --help imports this module; checks imports torch

    setup = device_of(args.device)
    setup.check_world(args.world_size)  # one GPU per rank on cuda
    runnable(args.precision or "fp32", setup)  # fp8: one line, before anything is built
    problem = problem_spec(args, precision=args.precision or "fp32", device=setup.kind).resolve()
    plan = problem.plan(args.knobs or "")
    print(f"verifying {args.model} with template {problem.template.describe()} on {args.world_size} {setup.kind} rank(s), "
          f"{problem.workload.precision}: {','.join(f'{k}={v}' for k, v in plan.items())}")
    results = launch(verify_point, args.world_size, args=(problem.spec, plan.knobs(), args.seed),
                     timeout=args.timeout, backend=setup.backend)
    ok = all(r["ok"] for r in results)
    blocks = rank_block_counts(problem.info.layers, plan["pp"], knob_value(plan, "vpp"))

    def where(r) -> str:  # a pipeline's stage and the blocks it holds (the ends the fewer when uneven)
        n = blocks[r["stage"]]
        return f"stage {r['stage']}, {n} block{'s' if n != 1 else ''}" if plan["pp"] > 1 else f"stage {r['stage']}"

    for r in results:
        if r["ok"]:
            print(f"  rank {r['rank']} ({where(r)}): loss {r['loss']:.6f} vs {r['reference_loss']:.6f} "
                  f"(relative error {r['loss_error']:.2e}); {r['params']} gradients, max relative error "
                  f"{r['max_grad_error']:.2e}")
        else:
            print(f"  rank {r['rank']} ({where(r)}):\n" + "\n".join("    " + line for line in r["report"].splitlines()))
    print("verify: OK" if ok else "verify: FAILED")
    return EXIT_OK if ok else EXIT_FAILED
