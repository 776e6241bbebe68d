"""Wheels the GPU check carries to a machine without Optuna: ``python -m benchmarks.gpu_wheels``.

The GPU machine has torch and transformers but not Optuna, and downloads nothing, while ``slapo-tune
tune`` (even with ``--ray-address none``) imports Optuna. So this puts, on this machine, the wheels
of what the tuning run imports and that machine lacks into ``.whl/`` (ignored by git, sent with the
device tool's ``carry=[".whl"]``), at the versions installed here, which the tests ran with;
``benchmarks/gpu_check.sh`` installs them there when ``import optuna`` fails.

Optuna and colorlog, and torchao for the FP8 part (pinned: :data:`PINNED`). With the journal
storage the tuner uses, Optuna never imports SQLAlchemy or Alembic (the RDB storages'
dependencies), and its other needs (numpy, packaging, tqdm, PyYAML) are in the GPU machine's image.
Optuna and colorlog are pure-Python wheels (``py3-none-any``); torchao's is built for CPython 3.10
and up (``abi3``). A wheel already in pip's cache is copied; any other is fetched with ``pip
download`` for the GPU machine's Python 3.12.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

CARRIED = ("optuna", "colorlog")
# carried at a pinned version though not installed here (CPU runs need none): torchao's float8
# training for the GPU check's FP8 part, the release built for the GPU machine's torch 2.11
# (torchao 0.17.0: ABI-stable against torch 2.11, pytorch/ao issue 2919); 3 MiB
PINNED = {"torchao": "0.17.0"}
DEVICE_PYTHON = "3.12"  # the GPU machine's interpreter (pure-Python wheels: any py3 works)
ROOT = Path(__file__).resolve().parents[1]


def _cached(name: str, version: str) -> Path | None:
    """A wheel of ``name==version`` in pip's cache (downloaded wheels and wheels it built)."""
    try:
        cache = Path(subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True,
                                    check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return None
    stem = f"{name.replace('-', '_')}-{version}-"
    return next((p for p in cache.rglob("*.whl") if p.name.lower().startswith(stem.lower())), None)


def collect(dest: Path = ROOT / ".whl") -> list[Path]:
    """Put the carried wheels, at this machine's versions, into ``dest`` (one version of each)."""
    dest.mkdir(exist_ok=True)
    out = []
    for name in (*CARRIED, *PINNED):
        version = PINNED.get(name) or importlib.metadata.version(name)
        for old in dest.glob(f"{name}-*.whl"):  # two versions of one package stop the whole install
            if not old.name.startswith(f"{name}-{version}-"):
                old.unlink()
        have = next(dest.glob(f"{name}-{version}-*.whl"), None)
        if have is None and (cached := _cached(name, version)) is not None:
            have = Path(shutil.copy(cached, dest))
        if have is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                            "--python-version", DEVICE_PYTHON, "--implementation", "cp", "-d", str(dest),
                            f"{name}=={version}"], check=True)
            have = next(dest.glob(f"{name}-{version}-*.whl"))
        out.append(have)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=str(ROOT / ".whl"))
    args = parser.parse_args(argv)
    wheels = collect(Path(args.dest))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheel(s) in {args.dest} ({size / 2**20:.1f} MiB): {', '.join(w.name for w in wheels)}")
    print("carry them with the check: run(carry=['.whl'], command='bash benchmarks/gpu_check.sh')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
