"""Per-rank checkpoints of a training session.

Each rank saves the shards it holds (parameters, AdamW state and its random-number state) under
``DIR/step-NNNNNN/rank-R.pt``, loaded back with ``weights_only``; ``DIR/latest`` names the newest
complete checkpoint and is written last, atomically, so a job killed while saving resumes from the
previous one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._atomic import atomic_write_text
from ._inputs import read_json_file
from .errors import UsageError
from .parallel._comm import local_tensor

LATEST = "latest"


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save_checkpoint(root: str | os.PathLike, step: int, params: Mapping[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer, rank: int, meta: dict[str, Any], keep: int = 2) -> Path:
    """Every rank writes its shard of ``params`` (name -> the tensor the optimizer steps: a stage's
    parameter, or its fp32 master copy) and their optimizer state; rank 0 then points ``latest`` at
    the step (all ranks call it)."""
    root = Path(root)
    folder = _step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    names = {p: name for name, p in params.items()}
    state = {
        "step": step,
        "params": {name: local_tensor(p).detach().clone() for p, name in names.items()},
        "optimizer": {names[p]: {k: local_tensor(v).detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in optimizer.state.items()},
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    }
    tmp = folder / f".rank-{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / f"rank-{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        atomic_write_text(folder / "meta.json", json.dumps({**meta, "step": step}, indent=1))
        atomic_write_text(root / LATEST, folder.name + "\n")
        for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return folder


def latest_checkpoint(root: str | os.PathLike) -> Path:
    root = Path(root)
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        raise UsageError(f"--resume {root}: no checkpoint there (no '{LATEST}' file)") from None
    folder = root / name
    if not (folder / "meta.json").is_file():
        raise UsageError(f"--resume {root}: checkpoint {name} is incomplete")
    return folder


def load_checkpoint(folder: Path, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                    rank: int) -> dict[str, Any]:
    """Restore this rank's shard of ``params`` (as saved) in place; returns the checkpoint's metadata."""
    meta = read_json_file(folder / "meta.json", "checkpoint metadata")
    if not isinstance(meta, dict):
        raise UsageError(f"--resume: {folder / 'meta.json'} is not a JSON object")
    try:
        state = torch.load(folder / f"rank-{rank:05d}.pt", map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UsageError(f"--resume: {folder} has no shard for rank {rank}") from None
    params = dict(params)
    if set(state["params"]) != set(params):
        raise UsageError(f"--resume: {folder} holds other parameters than this schedule's stage on rank {rank}")
    with torch.no_grad():
        for name, p in params.items():
            local_tensor(p).copy_(state["params"][name])
        for name, saved in state["optimizer"].items():
            p = params[name]
            restored = {}
            for k, v in saved.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    t = torch.zeros_like(p)
                    local_tensor(t).copy_(v)
                    restored[k] = t
                else:
                    restored[k] = v.clone() if torch.is_tensor(v) else v
            optimizer.state[p] = restored
    torch.set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    return meta
