"""The ``slapo-tune`` command line: one module per command, each with ``HELP``,
``add_arguments(parser)`` and ``run(args) -> exit code``.

Every command turns bad input into one line on stderr and exit code 2 (usage) or 1 (a failed
check), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import SlapoTuneError, UsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
COMMANDS = ("demo", "space", "plan", "verify", "train", "tune", "show", "export", "salvage")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + exits 2; keep it to one line
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from .. import __version__

    parser = _Parser(prog="slapo-tune", description="Autotune large-model training schedules.")
    parser.add_argument("--version", action="version", version=f"slapo-tune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        command = importlib.import_module(f"{__name__}.{name}")
        p = sub.add_parser(name, help=command.HELP)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
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
    except BrokenPipeError:
        # the reader went away (``slapo-tune plan ... | head``): stop quietly, as a shell tool does;
        # stdout is pointed at /dev/null so the interpreter's final flush cannot fail again
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
