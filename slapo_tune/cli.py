"""The ``slapo-tune`` command line.

Every command turns bad input into one line on stderr and exit code 2 (usage) or 1 (a failed
check), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import SlapoTuneError, UsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + exits 2; keep it to one line
        raise UsageError(message)


def _demo_rank(ctx, preset: str, family: str, batch: int, seq: int) -> str:
    import importlib

    import torch

    import slapo_tune as st
    from slapo_tune.parallelize import apply_checkpointing, apply_tensor_parallel

    template = importlib.import_module(f"search_spaces.{family}")
    reference = st.build_model(preset)
    sch = st.create_schedule(st.build_model(preset))
    apply_tensor_parallel(sch, template.TP_PLAN)
    blocks = sch[template.BLOCKS]
    apply_checkpointing([blocks[name] for name in blocks.child], 0.5)
    model = st.build(sch, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, reference.config.vocab_size, (batch, seq), generator=g)
    report = st.verify(model, reference, {"input_ids": ids, "labels": ids}, raise_on_failure=False)
    return str(report)


def cmd_demo(args: argparse.Namespace) -> int:
    from .launch import launch

    print(f"Scheduling {args.model} with tensor parallelism over {args.world_size} CPU ranks "
          "(vocab-parallel embedding, attention, MLP, LM head) and checkpointing half of the blocks;")
    print("verifying loss, module outputs and every gradient against the unscheduled model...")
    reports = launch(_demo_rank, args.world_size, args=(args.model, "gpt2", 4, 64), timeout=300)
    print(reports[0])
    return EXIT_OK if reports[0].startswith("verify: OK") else EXIT_FAILED


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser, global_batch: int | None) -> None:
    p.add_argument("--model", required=True, help="preset name or path to a config.json / model directory")
    p.add_argument("--world-size", type=_positive, required=True, help="number of ranks")
    p.add_argument("--space", default=None,
                   help="template: gpt2, llama, bert, opt, generic, module:attr or a .py file (default: from the config)")
    p.add_argument("--global-batch", type=_positive, default=global_batch,
                   help="global batch, held fixed (default: %(default)s)" if global_batch else
                   "global batch, held fixed (default: 8 x world size)")
    p.add_argument("--seq-len", type=_positive, default=None, help="sequence length")


def resolve_space(args: argparse.Namespace, config=None):
    """(config, template, model info, workload, space) for the model/world/space arguments."""
    from search_spaces import load_template, template_for

    from .models import load_config
    from .template import ModelInfo, Workload

    config = config or load_config(args.model)
    template = load_template(args.space) if args.space else template_for(config)
    info = ModelInfo.from_config(config)
    global_batch = args.global_batch or 8 * args.world_size
    seq_len = args.seq_len or min(128, getattr(config, "max_position_embeddings", 128) or 128)
    workload = Workload(args.world_size, global_batch, seq_len)
    space = template.space(info, workload)
    if next(space.enumerate(), None) is None:
        raise UsageError(
            f"no legal schedule for {args.model} on {args.world_size} ranks with global batch {global_batch}: "
            f"tp must divide {info.heads} heads, {info.kv_heads} KV heads, vocab {info.vocab} and MLP width "
            f"{info.intermediate}; pp must divide {info.layers} layers; the global batch must divide by dp"
        )
    return config, template, info, workload, space


def cmd_space(args: argparse.Namespace) -> int:
    import json
    import time

    from .space import product_size

    _, template, info, workload, _ = resolve_space(args)
    t0 = time.perf_counter()  # the space itself (imports and config loading are not the space's cost)
    space = template.space(info, workload)
    domains = space.domains() if args.domains else None
    count = space.count()
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"model": args.model, "template": template.describe(), "world_size": workload.world_size,
                          "global_batch": workload.global_batch, "legal_points": count,
                          "domains": domains, "seconds": round(elapsed, 4)}))
        return EXIT_OK
    print(f"{args.model}: template {template.describe()}, world {workload.world_size}, "
          f"global batch {workload.global_batch} ({info.layers} layers, {info.heads} heads, hidden {info.hidden})")
    for knob in space.knobs:
        values = domains[knob.name] if domains else None
        shown = ", ".join(map(str, values)) if values is not None else "(--domains to list)"
        print(f"  {knob.name:<18} {shown:<40} {knob.doc}")
    extra = f" of {product_size(domains)} unconstrained combinations" if domains else ""
    print(f"legal points: {count}{extra}  (computed in {elapsed * 1e3:.0f} ms)")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .checks import verify_point
    from .launch import launch
    from .realize import ModelSpec
    from .space import coerce, format_point, parse_knobs

    _, template, _, workload, space = resolve_space(args)
    point = space.complete(coerce(space, parse_knobs(args.knobs or "")))
    print(f"verifying {args.model} with template {template.describe()} on {args.world_size} rank(s): {format_point(point)}")
    results = launch(verify_point, args.world_size,
                     args=(ModelSpec(args.model), args.space or template.name, point, workload, args.seed),
                     timeout=args.timeout)
    ok = all(r["ok"] for r in results)
    for r in results:
        if r["ok"]:
            print(f"  rank {r['rank']} (stage {r['stage']}): loss {r['loss']:.6f} vs {r['reference_loss']:.6f} "
                  f"(relative error {r['loss_error']:.2e}); {r['params']} gradients, max relative error "
                  f"{r['max_grad_error']:.2e}")
        else:
            print(f"  rank {r['rank']} (stage {r['stage']}):\n" + "\n".join("    " + line for line in r["report"].splitlines()))
    print("verify: OK" if ok else "verify: FAILED")
    return EXIT_OK if ok else EXIT_FAILED


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """``80GiB``, ``400MiB``, ``16GB``, ``1.5TiB`` or bytes -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(f"unparsable size '{text}' (use e.g. 80GiB, 400MiB, 16GB)")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UsageError(f"size must be positive, got '{text}'")
    return int(value)


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def cmd_plan(args: argparse.Namespace) -> int:
    import json
    import time

    from .cost_model import CostModel, hardware
    from .cost_model.cards import preset_card
    from .realize import ModelSpec
    from .space import coerce, format_point, parse_knobs

    t0 = time.perf_counter()
    budget = parse_size(args.memory_budget)
    device = hardware(args.device)
    dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    # a preset's shipped card spares loading transformers and building the model to measure it
    card = None if args.space else preset_card(args.model)
    config, layout = card or (None, None)
    _, template, info, workload, space = resolve_space(args, config)
    workload = type(workload)(workload.world_size, workload.global_batch, workload.seq_len, dtype)
    model = CostModel(ModelSpec(args.model), template, workload, device, layout=layout)
    if args.knobs:
        points = [space.complete(coerce(space, parse_knobs(args.knobs)))]
    else:
        points = list(space.enumerate())
    rows, pruned = [], []
    for point in points:
        mem = model.memory(point)
        verdict = model.verdict(point, budget, prediction=mem)
        timing = model.time(point) if verdict.fits else None
        row = {"point": point, "peak": mem.peak, "upper": mem.upper, "stage": mem.worst_stage,
               "breakdown": mem.breakdown, "step_s": timing.step if timing else None,
               "throughput": timing.throughput(workload) if timing else None, "fits": verdict.fits,
               "reason": verdict.reason}
        (rows if verdict.fits else pruned).append(row)
    elapsed = time.perf_counter() - t0
    # a point predicted above the budget is kept (it may fit, within the prediction's uncertainty)
    # but ranked after every point predicted to fit: a plan recommends what should fit first
    rows.sort(key=lambda r: (r["peak"] > budget, -r["throughput"]))
    if not rows:
        smallest = min(pruned, key=lambda r: r["peak"])
        raise UsageError(
            f"no point fits {_mib(budget)}: smallest predicted peak is {_mib(smallest['peak'])} at "
            f"{format_point(smallest['point'])}"
        )
    if args.json:
        print(json.dumps({"model": args.model, "device": device.name, "budget": budget, "dtype": dtype,
                          "points": len(points), "feasible": len(rows), "pruned": len(pruned),
                          "top": rows[: args.top], "pruned_examples": pruned[: args.top],
                          "seconds": round(elapsed, 3)}, default=str))
        return EXIT_OK
    print(f"{args.model} on {workload.world_size} x {device.name} ({_mib(budget)} each), {dtype}, global batch "
          f"{workload.global_batch}, seq {workload.seq_len}: {len(points)} point(s), {len(rows)} fit, "
          f"{len(pruned)} pruned ({elapsed:.2f} s, template {template.describe()})")
    for i, r in enumerate(rows[: args.top], 1):
        parts = ", ".join(f"{k} {_mib(v)}" for k, v in r["breakdown"].items() if v >= 2**20)
        print(f"{i:>3}. {format_point(r['point'])}")
        maybe = "; above the budget, may fit: check it" if r["peak"] > budget else ""
        print(f"     peak {_mib(r['peak'])} (stage {r['stage']}; up to {_mib(r['upper'])}{maybe}) = {parts}")
        print(f"     step {r['step_s']:.3f} s, {r['throughput']:.1f} samples/s")
    if pruned:
        print(f"pruned {len(pruned)} point(s), for example:")
        for r in sorted(pruned, key=lambda r: r["peak"])[: min(3, args.top)]:
            print(f"  {format_point(r['point'])}: {r['reason']}")
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    from .train import TrainConfig, run_under_torchrun, under_torchrun

    config = TrainConfig(schedule=args.schedule, model=args.model, allow_model_mismatch=args.allow_model_mismatch,
                         data=args.data, steps=args.steps, lr=args.lr, seed=args.seed, save=args.save,
                         save_every=args.save_every, keep=args.keep, resume=args.resume, init_from=args.init_from,
                         log_every=args.log_every)
    if under_torchrun():
        run_under_torchrun(config)
        return EXIT_OK
    from .apply import load_schedule
    from .data import TrainingData
    from .launch import RankFailure, launch
    from .train import checkpoint_files, latest_checkpoint, train_rank

    loaded = load_schedule(args.schedule, model=args.model, world_size=args.world_size,
                           allow_model_mismatch=args.allow_model_mismatch)
    TrainingData(args.data, loaded.model.config().vocab_size, loaded.workload.global_batch,
                 loaded.workload.seq_len)  # a bad data file fails here, before any rank starts
    if args.resume:
        latest_checkpoint(args.resume)
    if args.init_from:
        checkpoint_files(args.init_from)  # before any rank starts
    point = ", ".join(f"{k}={v}" for k, v in loaded.point.items())
    print(f"training {loaded.model.name} on {loaded.world_size} local rank(s) with {point}", flush=True)
    try:
        losses = launch(train_rank, loaded.world_size, args=(config,), timeout=args.timeout)[0]
    except RankFailure as exc:
        if exc.exc_type == "UsageError":
            raise UsageError(str(exc).split(": ", 1)[-1]) from None
        raise
    if losses:
        print(f"done: {len(losses)} step(s), final loss {losses[-1]:.6f}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="slapo-tune", description="Autotune large-model training schedules.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="schedule a small GPT-2 with tensor parallelism on CPU ranks and verify it")
    demo.add_argument("--model", default="gpt2-tiny")
    demo.add_argument("--world-size", type=int, default=2)
    demo.set_defaults(func=cmd_demo)

    space = sub.add_parser("space", help="list the knobs of a model's search space and count its legal points")
    _add_model_args(space, None)
    space.add_argument("--domains", action="store_true", help="list every knob's legal values (enumerates the space)")
    space.add_argument("--json", action="store_true")
    space.set_defaults(func=cmd_space)

    plan = sub.add_parser("plan", help="rank a cluster's schedule points with the cost model alone (nothing runs)")
    _add_model_args(plan, None)
    plan.add_argument("--memory-budget", required=True, help="per-device memory, e.g. 80GiB")
    plan.add_argument("--device", default="a100-80gb",
                      help="hardware preset: cpu, a100-80gb, a100-40gb, h100-80gb, h200, v100-32gb (default: %(default)s)")
    plan.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                      help="compute dtype (default: bf16 on GPUs, fp32 on cpu)")
    plan.add_argument("--knobs", default="", help="evaluate one point (others: first legal value)")
    plan.add_argument("--top", type=_positive, default=5)
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=cmd_plan)

    verify = sub.add_parser("verify", help="check one schedule point against the unscheduled model on local ranks")
    _add_model_args(verify, 8)
    verify.add_argument("--knobs", default="", help="e.g. tp=2,pp=2,ckpt_ratio=0.5 (others: first legal value)")
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    verify.set_defaults(func=cmd_verify)
    train = sub.add_parser("train", help="train with an exported schedule (local ranks, or under torchrun)")
    train.add_argument("--schedule", required=True, help="a best_schedule.json from slapo-tune tune")
    train.add_argument("--model", default=None, help="train this model instead of the schedule's (preset or config)")
    train.add_argument("--allow-model-mismatch", action="store_true",
                       help="use the schedule on a model whose config differs from the one it was tuned for")
    train.add_argument("--world-size", type=_positive, default=None,
                       help="expected number of ranks (must equal the schedule's)")
    train.add_argument("--data", default="synthetic", help="synthetic (default), a text file or a .npy of token ids")
    train.add_argument("--steps", type=_positive, default=30)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--save", default=None, help="checkpoint folder (written at the end and every --save-every)")
    train.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    train.add_argument("--keep", type=int, default=2, help="checkpoints kept (default: %(default)s)")
    train.add_argument("--resume", default=None, help="continue from the latest checkpoint in this folder")
    train.add_argument("--init-from", default=None, help="initial weights from a Hugging Face checkpoint folder")
    train.add_argument("--log-every", type=_positive, default=1)
    train.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds before the ranks are killed")
    train.set_defaults(func=cmd_train)
    from .search._command import add_arguments, cmd_show, cmd_tune

    tune = sub.add_parser("tune", help="search for the fastest schedule that fits, running real trials")
    add_arguments(tune)
    tune.set_defaults(func=cmd_tune)
    show = sub.add_parser("show", help="print a results folder's trials table and best point")
    show.add_argument("folder")
    show.set_defaults(func=cmd_show)
    return parser


def _one_line(text: str) -> str:
    """A message as one printable line: names and values quoted from a user's file or arguments
    may hold line breaks or other control characters, which are shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        print(f"slapo-tune: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except SlapoTuneError as exc:
        print(f"slapo-tune: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("slapo-tune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
