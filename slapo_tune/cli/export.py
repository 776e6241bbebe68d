"""``slapo-tune export``: a stored study's outputs rebuilt from the study alone, anywhere."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._common import add_space_argument, add_storage_arguments

HELP = "write a stored study's trials.csv, best_schedule.json and report (a study run elsewhere, e.g. as a Ray Job)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_storage_arguments(p, "none: required")
    p.add_argument("--study", default=None, help="the study in the storage (default: its only study)")
    p.add_argument("--out", required=True, help="folder to write the outputs into")
    add_space_argument(p)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..search._outputs import export
    from ..search._storage import storage_url

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output folder {out} is a file; choose another --out")
    name = export(storage_url(args.storage, args.storage_file), args.study, out, space=args.space)
    written = [str(out / f) for f in ("trials.csv", "best_schedule.json", "report.html") if (out / f).is_file()]
    print(f"study '{name}': {', '.join(written)}", file=sys.stderr)
    print(f"see: slapo-tune show {out}")
    return 0
