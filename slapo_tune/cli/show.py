"""``slapo-tune show``: a results folder's trials table and best point."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "print a results folder's trials table and best point"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", help="a study's output folder (tune --out), holding trials.csv")


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from ..errors import UsageError
    from ..schedule_file import read_schedule

    folder = Path(args.folder)
    table = folder / "trials.csv"
    if not table.is_file():
        raise UsageError(f"{folder} has no trials.csv (is it a slapo-tune results folder?)")
    frame = pd.read_csv(table)
    columns = [c for c in frame.columns if c not in ("warnings", "retry_of", "peak_rss", "overhead_s", "wall_s")
               and not (c == "peak_reserved" and frame[c].isna().all())]  # CPU trials: no allocator cache
    with pd.option_context("display.max_rows", 500, "display.width", 200, "display.max_colwidth", 40):
        print(frame[columns].to_string(index=False))
    best = folder / "best_schedule.json"
    if best.is_file():
        schedule = read_schedule(best)
        knobs = ",".join(f"{k}={v}" for k, v in schedule["knobs"].items())
        measured = schedule.get("measured", {})
        print(f"best: {knobs} at {measured.get('samples_per_s') or 0:.2f} samples/s (trial {measured.get('trial')})")
    else:
        print("best: none yet")
    return 0
