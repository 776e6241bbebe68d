"""The GPU check's own path, on CPU: ``bash benchmarks/gpu_check.sh --device cpu --smoke`` runs the
numerics, the memory comparison in every precision, ``slapo-tune tune`` and ``slapo-tune train`` on
the schedule it exported, and writes one JSON summary."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_tunes_exports_and_trains_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(summary) >= {"device", "kind", "hardware", "torch", "smoke", "numerics", "memory", "cli", "seconds",
                            "numerics_seconds", "memory_seconds", "cli_seconds"}
    assert (summary["kind"], summary["hardware"], summary["smoke"]) == ("cpu", "cpu", True)
    assert [n["ok"] for n in summary["numerics"]] == [True]
    memory = summary["memory"]
    assert [row["precision"] for row in memory] == ["fp32", "amp-bf16", "bf16"]
    for row in memory:
        assert row["measured"] > 0 and row["exact"] > 0 and row["analytic"] > 0
        assert abs(row["exact_error"]) < 0.2, row  # exact mode within the pruning margin of the real step
    cli = summary["cli"]
    tune, schedule, train = cli["tune"], cli["schedule"], cli["train"]
    assert tune["returncode"] == 0 and "1 cpu rank(s), fp32" in tune["banner"], tune
    assert schedule and schedule["device"] == "cpu" and schedule["knobs"]["tp"] == 1  # tune exported it
    assert schedule["measured"]["samples_per_s"] > 0 and 0 < schedule["mfu"] < 1
    assert train["returncode"] == 0 and train["steps"] == 2, train  # train ran the exported schedule
    assert all(math.isfinite(x) for x in train["losses"])
    assert "--schedule" in train["argv"] and train["argv"][train["argv"].index("--schedule") + 1] == schedule["path"]
