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

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_tunes_exports_and_trains_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(summary) >= {"device", "kind", "hardware", "torch", "smoke", "numerics", "memory", "cli", "seconds",
                            "numerics_seconds", "memory_seconds", "cli_seconds", "fp8"}
    assert summary["fp8"] == {"skipped": "needs a CUDA device"}
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


class _Setup:
    def __init__(self, cuda: bool):
        self.cuda = cuda


def test_the_fp8_part_says_why_it_cannot_run(monkeypatch):
    """CUDA's presence mocked: a GPU below compute capability 8.9 has no FP8 tensor cores; one with
    them needs torchao (not installed here: the GPU machine gets it as a carried wheel)."""
    import builtins

    import torch

    from benchmarks.gpu_check import fp8_skip_reason

    assert fp8_skip_reason(_Setup(False)) == "needs a CUDA device"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "8.0 has no FP8 tensor cores" in fp8_skip_reason(_Setup(True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(f"No module named '{name}'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    assert "carry its wheel" in fp8_skip_reason(_Setup(True))


def test_the_carried_wheels_include_torchao_for_the_gpu_machines_torch(tmp_path, monkeypatch):
    """torchao is carried at the release built for the GPU machine's torch (2.11: torchao 0.17.0),
    not at a version installed here (none is); a wheel of another version already there is replaced."""
    from benchmarks import gpu_wheels

    (tmp_path / "torchao-0.16.0-cp39-abi3-manylinux.whl").write_bytes(b"old")
    fetched = []

    def fake_run(cmd, check):
        fetched.append(cmd[-1])
        name, version = cmd[-1].split("==")
        (tmp_path / f"{name}-{version}-py3-none-any.whl").write_bytes(b"wheel")

    monkeypatch.setattr(gpu_wheels, "_cached", lambda name, version: None)
    monkeypatch.setattr(gpu_wheels.subprocess, "run", fake_run)
    wheels = gpu_wheels.collect(tmp_path)
    assert "torchao==0.17.0" in fetched and not (tmp_path / "torchao-0.16.0-cp39-abi3-manylinux.whl").exists()
    assert sorted(w.name.split("-")[0] for w in wheels) == ["colorlog", "optuna", "torchao"]
