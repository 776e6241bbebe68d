"""``slapo-tune export``: a stored study's outputs rebuilt from the study alone, anywhere."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UsageError
from ..search._confirm import crowned
from ..search._outputs import export
from ..search._report import no_result_reason
from ..search._storage import storage_url
from . import EXIT_NO_RESULT, EXIT_OK
from ._common import add_space_argument, add_storage_arguments

HELP = "write a stored study's trials.csv, best_schedule.json and report (a study run elsewhere, e.g. as a Ray Job)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_storage_arguments(p, "none: required")
    p.add_argument("--study", default=None, help="the study in the storage (default: its only study)")
    p.add_argument("--out", required=True, help="folder to write the outputs into")
    add_space_argument(p)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output folder {out} is a file; choose another --out")
    study = export(storage_url(args.storage, args.storage_file), args.study, out, space=args.space)
    if crowned(study)[0] is None:  # no schedule to train: the exit code tune gave the study
        print(f"slapo-tune: study '{study.study_name}' has no result, so no best_schedule.json: "
              f"{no_result_reason(study)}; each point's outcome is in {out / 'trials.csv'}", file=sys.stderr)
        return EXIT_NO_RESULT
    written = [str(out / f) for f in ("trials.csv", "best_schedule.json", "report.html") if (out / f).is_file()]
    print(f"study '{study.study_name}': {', '.join(written)}", file=sys.stderr)
    print(f"see: slapo-tune show {out}")
    return EXIT_OK
