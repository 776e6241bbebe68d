"""Benchmarks: ratios measured side by side in one run, with medians and spread.

Each benchmark is a program of its own (``python -m benchmarks.<name>``): it downloads nothing and
keeps transformers' advice on models built from configs out of its output, for itself and the
ranks it starts (the library changes no environment on import).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
