#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): numerics on CUDA, memory-model accuracy against
# torch.cuda.max_memory_allocated in each precision, and `slapo-tune tune --ray-address none` with its
# defaults on a ~350M GPT-2, then `slapo-tune train` on the schedule it exported. Sized for under 8
# minutes on one GPU; needs torch and transformers, and Optuna: when `import optuna` fails it is
# installed from the wheels in .whl/ (put there by `python -m benchmarks.gpu_wheels` on a machine
# with a package index, and carried); nothing is downloaded here, no Ray, no network.
# Usage: bash benchmarks/gpu_check.sh [--tune-trials 4] [--train-steps 5]   (writes ${OUT:-.}/gpu_check.json)
#        bash benchmarks/gpu_check.sh --device cpu --smoke   (the same path on CPU with gpt2-tiny)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
if ! "$PYTHON" -c "import optuna" 2>/dev/null; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_check: optuna is missing and .whl/ holds no wheels: run 'python -m benchmarks.gpu_wheels' where pip works, and carry .whl" >&2
    exit 2
  fi
  site="${TMPDIR:-/tmp}/slapo-gpu-check-site"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"  # only what the image lacks (--no-deps): nothing of it is shadowed
fi
timeout 470 "$PYTHON" -m benchmarks.gpu_check --out "${OUT:-.}/gpu_check.json" "$@"
