"""Record a measured grid: every legal point of a space, trained for real on local ranks.

The small grid (knobs, per-rank peak tensor memory, step times) is the input of the
search-strategy benchmark and of the replay tests, which answer trials from it instead of running
them. The reference grid is the exhaustive search of the headline's GPT-2 workload: every point
that fits its memory budget (exact mode decides) timed for real, so that the headline can say how
far the tuned schedule is from the best one.
Run: ``python -m benchmarks.record_grid [--reference] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GRID = dict(model="gpt2-tiny", world_size=2, global_batch=16, seq_len=64, fixed={"attn": "sdpa"})
DEFAULT_OUT = Path(__file__).with_name("data") / "gpt2_tiny_w2.csv"
REFERENCE_OUT = Path(__file__).with_name("data") / "gpt2_ref_w1.csv"


def grid_points() -> list[dict]:
    from search_spaces import template_for
    from slapo_tune.realize import ModelSpec
    from slapo_tune.template import ModelInfo, Workload

    config = ModelSpec(GRID["model"]).config()
    space = template_for(config).space(ModelInfo.from_config(config),
                                       Workload(GRID["world_size"], GRID["global_batch"], GRID["seq_len"]))
    return [p for p in space.enumerate() if all(p[k] == v for k, v in GRID["fixed"].items())]


def _write(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(out)
    print(f"wrote {out}")


def _measure(spec, template_name: str, points: list[dict], workload, chunk: int,
             peaks: list[int] | None = None) -> list[dict]:
    """Each point trained for real, ``chunk`` points per launch: its step times (the slowest rank
    per step) and its peak tensor memory (the largest rank's), unless ``peaks`` are known."""
    from slapo_tune.cost_model.measure import measure_points_rank
    from slapo_tune.launch import launch

    rows, t0 = [], time.perf_counter()
    for i in range(0, len(points), chunk):
        part = points[i:i + chunk]
        per_rank = launch(measure_points_rank, workload.world_size,
                          args=(spec, template_name, part, workload, 3, 0 if peaks else 2), timeout=3600)
        for j, point in enumerate(part):
            reports = [r[j] for r in per_rank]
            steps = [max(r["step_times"][k] for r in reports) for k in range(len(reports[0]["step_times"]))]
            peak = peaks[i + j] if peaks else max(r["total"] for r in reports)
            rows.append({**point, "peak": peak, "step_s": statistics.median(steps),
                         "step_times": " ".join(f"{s:.5f}" for s in steps)})
        print(f"{len(rows)}/{len(points)} points in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def record_reference(out: Path, chunk: int) -> None:
    """Every point of the headline's GPT-2 workload (world 1) that fits its budget, timed."""
    from benchmarks.headline import BUDGET, GLOBAL_BATCH, GPT2_REF, SEQ
    from search_spaces import template_for
    from slapo_tune.cost_model import CostModel, hardware
    from slapo_tune.realize import ModelSpec
    from slapo_tune.template import ModelInfo, Workload

    spec = ModelSpec(GPT2_REF[0], dict(GPT2_REF[1]))
    config = spec.config()
    template = template_for(config)
    workload = Workload(1, GLOBAL_BATCH, SEQ)
    cost = CostModel(spec, template, workload, hardware("cpu"))
    points, peaks = [], []
    for point in template.space(ModelInfo.from_config(config), workload).enumerate():
        verdict = cost.verdict(point, BUDGET, exact=True)
        if verdict.fits:
            points.append(point)
            peaks.append(verdict.predicted)
    print(f"{len(points)} points fit {BUDGET / 2**20:.0f} MiB", flush=True)
    # memory from exact mode (byte-exact on CPU): the real steps are only timed
    rows = _measure(spec, template.name, points, workload, chunk, peaks)
    _write(rows, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", action="store_true",
                        help="the headline's GPT-2 workload (exhaustive search) instead of the small grid")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--chunk", type=int, default=40, help="points per launch (ranks start once per chunk)")
    args = parser.parse_args(argv)
    if args.reference:
        record_reference(args.out or REFERENCE_OUT, args.chunk)
        return

    from search_spaces import template_for
    from slapo_tune.realize import ModelSpec
    from slapo_tune.template import Workload

    spec = ModelSpec(GRID["model"])
    template = template_for(spec.config())
    workload = Workload(GRID["world_size"], GRID["global_batch"], GRID["seq_len"])
    rows = _measure(spec, template.name, grid_points(), workload, args.chunk)
    _write(rows, args.out or DEFAULT_OUT)


if __name__ == "__main__":
    main()
