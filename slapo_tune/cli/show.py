"""``slapo-tune show``: a results folder's trials, one line each within 100 columns, and its best point."""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

from ..errors import UsageError
from ..plan import IDLE_WHERE, SHORT_NAMES
from ..schedule_file import read_schedule
from ..search._outputs import baseline_of, export
from ..search._report import gain_text
from ..search._storage import storage_url
from ..units import format_size
from ._common import WIDTH, add_space_argument, add_storage_arguments, aligned, wrapped

HELP = "print a results folder's (or a stored study's) trials (the knobs that vary, throughput, memory) and best point"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", nargs="?", default=None,
                   help="a study's output folder (tune --out), holding trials.csv; or give the study's storage")
    add_storage_arguments(p, "the folder")
    p.add_argument("--study", default=None, help="the study in --storage (default: its only study)")
    add_space_argument(p)
    view = p.add_mutually_exclusive_group()
    view.add_argument("--all", action="store_true", help="every column of the trials table, as a wide text table")
    view.add_argument("--csv", action="store_true", help="the trials table as CSV, for another tool")


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _same(a: str, b) -> bool:
    value = _number(a)
    return a == str(b) if value is None else value == float(b)


def _size(text: str) -> str:
    value = _number(text)
    return "" if value is None else format_size(value)


def _knob_columns(rows: list[dict], names: list[str]) -> list[str]:
    """The knobs whose value differs between rows, in the table's order."""
    return [k for k in names if len({r[k] for r in rows}) > 1]


def _cells(row: dict, knobs: list[str], best: bool) -> list[str]:
    knob_cells = ["-" if k in IDLE_WHERE and _same(row.get(IDLE_WHERE[k][0], ""), IDLE_WHERE[k][1]) else row[k]
                  for k in knobs]
    rate = _number(row.get("samples_per_s"))
    measured = _size(row.get("peak_memory"))
    # a point that did not run: the peak it was predicted (or pruned) at, marked as a prediction
    predicted = _size(row.get("pruned_peak") or row.get("predicted_peak"))
    memory = measured or (f"~{predicted}" if predicted else "")
    return ["*" if best else "", row["trial"], row["status"], *knob_cells,
            "" if rate is None else f"{rate:.1f}", memory, row.get("reason", "")]


def _table(rows: list[dict], knobs: list[str], best: str | None, budget: str) -> list[str]:
    header = ["", "#", "status", *(SHORT_NAMES.get(k, k) for k in knobs), "samples/s",
              f"peak/{budget}" if budget else "peak", "note"]
    body = [_cells(r, knobs, r["trial"] == best) for r in rows]
    right = {1, len(header) - 3}  # trial numbers and throughput: right-aligned
    texts = aligned([[str(c) for c in line[:-1]] for line in [header, *body]], right)  # the note: cut to fit
    lines = []
    for text, line in zip(texts, [header, *body]):
        room = WIDTH - len(text) - 1
        note = str(line[-1])
        lines.append((text + " " + (note if len(note) <= room else note[:max(0, room - 1)] + "…")).rstrip()
                     if room > 1 else text.rstrip())
    return lines


def run(args: argparse.Namespace) -> int:
    if args.folder is None:  # the study itself, wherever it ran: its tables rebuilt in a scratch folder
        import tempfile

        with tempfile.TemporaryDirectory(prefix="slapo-tune-show-") as scratch:
            export(storage_url(args.storage, args.storage_file), args.study, Path(scratch), report=False,
                   space=args.space)
            return _show(Path(scratch), args)
    if args.storage or args.storage_file or args.study or args.space:
        raise UsageError("give a results folder or --storage/--storage-file (with --study), not both")
    return _show(Path(args.folder), args)


def _show(folder: Path, args: argparse.Namespace) -> int:
    table = folder / "trials.csv"
    if not table.is_file():
        raise UsageError(f"{folder} has no trials.csv (is it a slapo-tune results folder?)")
    if args.csv:
        sys.stdout.write(table.read_text())
        return 0
    if args.all:
        import pandas as pd

        with pd.option_context("display.max_rows", None, "display.width", 250, "display.max_colwidth", 60):
            print(pd.read_csv(table).to_string(index=False, na_rep=""))
        return 0
    with table.open(newline="") as f:
        reader = csv.DictReader(f)
        rows, columns = list(reader), reader.fieldnames or []
    schedule = read_schedule(folder / "best_schedule.json") if (folder / "best_schedule.json").is_file() else None
    measured = (schedule or {}).get("measured", {})
    best = None if measured.get("trial") is None else str(measured["trial"])
    budgets = {r.get("memory_budget") for r in rows} - {"", None}
    budget = format_size(float(budgets.pop())) if len(budgets) == 1 else ""
    knob_names = columns[columns.index("status") + 1:columns.index("samples_per_s")] if "samples_per_s" in columns else []
    if rows:
        for line in _table(rows, _knob_columns(rows, knob_names), best, budget):
            print(line)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"{len(rows)} trial(s): " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + ("; ~ marks a predicted peak" if any(not r.get("peak_memory") for r in rows) else ""))
    if schedule is not None:
        knobs = ", ".join(f"{k}={v}" for k, v in schedule["knobs"].items())
        print("\n".join(wrapped(f"best (*): trial {measured.get('trial')} at {measured.get('samples_per_s') or 0:.2f} "
                                f"samples/s: {knobs}")))
        baseline = baseline_of(measured)
        if baseline is not None:
            print("\n".join(wrapped(f"over out of the box: {gain_text(baseline)}")))
    else:
        print("best: none yet")
    return 0
