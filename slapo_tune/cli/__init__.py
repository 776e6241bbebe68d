"""The ``slapo-tune`` command line: one module per command, each with ``HELP``,
``add_arguments(parser)`` and ``run(args) -> exit code``.

Every command turns bad input into one line on stderr and an exit code a scheduler can act on
(the table in docs/cli.md), never a traceback. SIGTERM is taken as Ctrl-C is (see
``._signals``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import SlapoTuneError, Terminated, UsageError
from ._signals import sigterm_as_interrupt

EXIT_OK = 0
EXIT_FAILED = 1  # a check failed (verify), or what trials run on did (a Ray head that did not come up)
EXIT_USAGE = 2  # bad input: arguments, files, settings
EXIT_NO_RESULT = 3  # tune ran but no point ran ok (nothing fits, nothing measured, every trial failed)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, Ctrl-C: as a shell reports a process a signal ended
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, SIGTERM (kill, systemd, Slurm)
COMMANDS = ("demo", "space", "plan", "verify", "train", "tune", "show", "export", "salvage")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + exits 2; keep it to one line
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    import importlib

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


def interrupted_exit_code(exc: KeyboardInterrupt) -> int:
    """EXIT_TERMINATED for SIGTERM (:class:`~slapo_tune.errors.Terminated`), else (Ctrl-C) EXIT_INTERRUPTED."""
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    # the command owns its process (and the ranks it starts inherit this): nothing is downloaded,
    # and transformers' advice on models built from configs is noise here. Importing the library
    # changes no environment.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    with sigterm_as_interrupt():
        return _run(argv)


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        print(f"slapo-tune: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except SlapoTuneError as exc:
        print(f"slapo-tune: {str(exc).splitlines()[0]}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        print("slapo-tune: interrupted", file=sys.stderr)
        return interrupted_exit_code(exc)
    except BrokenPipeError:
        # the reader went away (``slapo-tune plan ... | head``): stop quietly, as a shell tool does;
        # stdout is pointed at /dev/null so the interpreter's final flush cannot fail again
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
