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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="slapo-tune", description="Autotune large-model training schedules.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="schedule a small GPT-2 with tensor parallelism on CPU ranks and verify it")
    demo.add_argument("--model", default="gpt2-tiny")
    demo.add_argument("--world-size", type=int, default=2)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        print(f"slapo-tune: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SlapoTuneError as exc:
        print(f"slapo-tune: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("slapo-tune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
