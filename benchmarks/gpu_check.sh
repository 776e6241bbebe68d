#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): numerics on CUDA, memory-model accuracy against
# torch.cuda.max_memory_allocated, and a small tuning run of a ~350M GPT-2 in bf16. Sized for under
# 8 minutes on one GPU; needs torch and transformers only (no Ray, Optuna or network).
# Usage: bash benchmarks/gpu_check.sh [--budget-gib 40] [--tries 6]   (writes ${OUT:-.}/gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
timeout 470 python -m benchmarks.gpu_check --out "${OUT:-.}/gpu_check.json" "$@"
