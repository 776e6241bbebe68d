"""``slapo-tune train``: train with an exported schedule (local ranks, or one rank under torchrun)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import time

from ..errors import UsageError
from ..launch import RankFailure, launch
from ..precision import runnable
from . import EXIT_OK
from ._common import (
    add_device_argument,
    add_space_argument,
    device_of,
    duration,
    non_negative_int,
    positive_float,
    positive_int,
    seed_int,
    world_size_int,
)

MAX_LEARNING_RATE = 1e3  # far above any rate that trains: a typo (1e30) or inf is refused

HELP = "train with an exported schedule (local ranks, or under torchrun)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", required=True, help="a best_schedule.json from slapo-tune tune")
    p.add_argument("--model", default=None, help="train this model instead of the schedule's (preset or config)")
    add_space_argument(p, "schedule")
    p.add_argument("--allow-model-mismatch", action="store_true",
                   help="use the schedule on a model whose config differs from the one it was tuned for")
    p.add_argument("--world-size", type=world_size_int, default=None,
                   help="expected number of ranks (must equal the schedule's)")
    p.add_argument("--data", default="synthetic", help="synthetic (default), a text file or a .npy of token ids")
    p.add_argument("--steps", type=positive_int, default=30, help="optimizer steps (default: %(default)s)")
    p.add_argument("--lr", type=positive_float(MAX_LEARNING_RATE, "a positive learning rate"), default=1e-3, help="AdamW's learning rate (default: %(default)s)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and the data (default: %(default)s)")
    p.add_argument("--save", default=None, help="checkpoint folder (written at the end and every --save-every)")
    p.add_argument("--save-every", type=non_negative_int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep", type=positive_int, default=2, help="checkpoints kept (default: %(default)s)")
    p.add_argument("--resume", default=None, help="continue from the latest checkpoint in this folder")
    p.add_argument("--init-from", default=None, help="initial weights from a Hugging Face checkpoint folder")
    p.add_argument("--log-every", type=positive_int, default=1, help="steps between log lines (default: %(default)s)")
    p.add_argument("--timeout", type=duration, default=24 * 3600.0,
                   help="seconds (or 30m, 2h) before the ranks are killed (default: %(default)s)")
    add_device_argument(p)


def run(args: argparse.Namespace) -> int:
    # torch-free: every --help imports this module; train imports torch
    from ..train import TrainConfig, run_under_torchrun, under_torchrun

    config = TrainConfig(schedule=args.schedule, model=args.model, space=args.space,
                         allow_model_mismatch=args.allow_model_mismatch,
                         data=args.data, steps=args.steps, lr=args.lr, seed=args.seed, save=args.save,
                         save_every=args.save_every, keep=args.keep, resume=args.resume, init_from=args.init_from,
                         log_every=args.log_every, device=args.device, started_at=time.time())
    if under_torchrun():
        # SIGTERM's default action: torchrun stops its workers with it, and a rank inside a
        # collective (C++, where Python runs no handler) must end at once; it started no process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        run_under_torchrun(config)
        return EXIT_OK
    # torch-free: every --help imports this module; these import torch
    from ..apply import load_schedule
    from ..checkpoint import latest_checkpoint
    from ..data import TrainingData
    from ..train import checkpoint_files, train_rank

    loaded = load_schedule(args.schedule, model=args.model, world_size=args.world_size, space=args.space,
                           allow_model_mismatch=args.allow_model_mismatch)
    if args.space:  # the ranks load the template the user named here: a file by its absolute path
        config = dataclasses.replace(config, space=loaded.problem.spec.template)
    setup = device_of(args.device)
    runnable(loaded.workload.precision, setup)  # fp8: one line, before any rank starts
    setup.check_world(loaded.world_size)  # one GPU per rank on cuda
    TrainingData(args.data, loaded.problem.config.vocab_size, loaded.workload.global_batch,
                 loaded.workload.seq_len)  # a bad data file fails here, before any rank starts
    if args.resume:
        latest_checkpoint(args.resume)
    if args.init_from:
        checkpoint_files(args.init_from)  # before any rank starts
    point = ", ".join(f"{k}={v}" for k, v in loaded.plan.items())
    print(f"training {loaded.model.name} on {loaded.world_size} local {setup.kind} rank(s) with {point}", flush=True)
    try:
        launch(train_rank, loaded.world_size, args=(config,), timeout=args.timeout, backend=setup.backend)
    except RankFailure as exc:
        if exc.exc_type == "UsageError":
            raise UsageError(str(exc).split(": ", 1)[-1]) from None
        raise
    return EXIT_OK  # rank 0 printed the job's summary
