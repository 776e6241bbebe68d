"""The named mutations (``tools/mutation.py``) still describe the code: each one's text occurs once
in its file, so ``make mutants`` breaks what it says it breaks, and each names tests that exist."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import mutation  # noqa: E402


def test_every_named_mutation_applies_once_and_names_real_tests():
    stale = [m.name for m in mutation.NAMED if (ROOT / m.path).read_text().count(m.old) != 1]
    assert stale == [], f"mutations whose text is not in their file once: {stale}"
    defined: dict[str, set[str]] = {}
    for m in mutation.NAMED:
        for node_id in m.tests:
            path, _, name = node_id.partition("::")
            if path not in defined:
                tree = ast.parse((ROOT / path).read_text())
                defined[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name.split("[")[0] in defined[path], f"{m.name}: no test {node_id}"
