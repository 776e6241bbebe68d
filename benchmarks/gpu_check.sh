#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): numerics on CUDA, memory-model accuracy against
# torch.cuda.max_memory_allocated in each precision, and `slapo-tune tune --ray-address none` with its
# defaults on a ~350M GPT-2, then `slapo-tune train` on the schedule it exported, then FP8 (torchao's
# float8 training) beside bf16 on a Llama-3-8B block's linear layers. Sized for under 8 minutes on
# one GPU; needs torch and transformers, and Optuna (and on a GPU torchao): what fails to import is
# installed from the wheels in .whl/ (put there by `python -m benchmarks.gpu_wheels` on a machine
# with a package index, and carried); nothing is downloaded here, no Ray, no network.
# Usage: bash benchmarks/gpu_check.sh [--tune-trials 4] [--train-steps 5]   (writes ${OUT:-.}/gpu_check.json)
#        bash benchmarks/gpu_check.sh --device cpu --smoke   (the same path on CPU with gpt2-tiny)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# what the image lacks, from the carried wheels: Optuna (the tuning run), and on a GPU torchao (the FP8 part)
needs='import optuna'
if "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  needs='import optuna, torchao'
fi
if ! "$PYTHON" -c "$needs" 2>/dev/null; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    if ! "$PYTHON" -c "import optuna" 2>/dev/null; then
      echo "gpu_check: optuna is missing and .whl/ holds no wheels: run 'python -m benchmarks.gpu_wheels' where pip works, and carry .whl" >&2
      exit 2
    fi  # torchao alone is missing: the FP8 part says it skipped, and why
  else
    site="${TMPDIR:-/tmp}/slapo-gpu-check-site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:$site"  # only what the image lacks (--no-deps): nothing of it is shadowed
  fi
fi
timeout 470 "$PYTHON" -m benchmarks.gpu_check --out "${OUT:-.}/gpu_check.json" "$@"
