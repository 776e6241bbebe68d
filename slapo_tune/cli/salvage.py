"""``slapo-tune salvage``: a damaged study journal rewritten with every intact record, the original
kept beside it."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..search._storage import JOURNAL_NAME

HELP = ("repair a damaged study journal (a record cut short or overwritten): keep every intact trial, set the "
        "original aside")
SHOWN = 10  # damaged pieces listed one by one; the rest counted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("journal", help="the study journal (e.g. results/NAME/study.journal), or the results folder "
                                   "holding it")


def run(args: argparse.Namespace) -> int:
    # optuna-free: every --help imports this module; _journal imports optuna
    from ..search._journal import salvage_journal

    path = Path(args.journal)
    if path.is_dir():
        path = path / JOURNAL_NAME
    salvaged = salvage_journal(path)
    studies = ", ".join(f"study '{name}' with {n} trial(s)" for name, n in salvaged.trials.items()) or "no study"
    if salvaged.aside is None:
        print(f"{path} is intact: {salvaged.records} record(s), {studies}; nothing to salvage")
        return 0
    print(f"salvaged {path}: kept {salvaged.records} record(s), {studies}")
    for what in salvaged.dropped[:SHOWN]:
        print(f"  dropped {what}")
    if len(salvaged.dropped) > SHOWN:
        print(f"  dropped {len(salvaged.dropped) - SHOWN} more piece(s)")
    if salvaged.restored:
        print(f"  re-created trial id(s) {', '.join(map(str, salvaged.restored))}: their creation record was lost; "
              "kept so that the trials after them keep their numbers (their start time is approximate)")
    print(f"the original is kept in {salvaged.aside}; re-run the tune command to resume the study")
    return 0
