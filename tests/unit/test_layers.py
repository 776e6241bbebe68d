"""The import graph of the library: layers import downward only, and no import circle exists.

The graph is read from the source (every ``import`` statement, also those inside functions, which
still tie a module to what it imports), not from what happens to be loaded at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("slapo_tune", "search_spaces", "runners")

# Bottom to top, as docs/development.md's layout section states them. A module belongs to the first layer
# with an entry equal to its name or a package above it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("schedule language and runtime", (
        "slapo_tune._atomic", "slapo_tune._inputs", "slapo_tune._owned", "slapo_tune.errors",
        "slapo_tune.parallel", "slapo_tune.schedule",
        "slapo_tune._verify", "slapo_tune.parallelize", "slapo_tune.topology",
        "slapo_tune.runtime", "slapo_tune.models", "slapo_tune.launch", "slapo_tune.data", "slapo_tune.space",
        "slapo_tune.memory", "slapo_tune.checkpoint", "slapo_tune.units",
        "slapo_tune.precision", "slapo_tune._master_weights", "slapo_tune.device", "slapo_tune.styles",
        "slapo_tune._partition", "slapo_tune.op", "slapo_tune.compat")),
    ("templates", ("slapo_tune.template", "slapo_tune.plan", "slapo_tune.problem", "slapo_tune.schedule_file",
                   "search_spaces")),
    ("session and training job", ("slapo_tune.session", "slapo_tune.apply", "slapo_tune.checks", "slapo_tune.train")),
    ("cost model and runners", ("slapo_tune.cost_model", "runners")),
    ("tuner and CLI", ("slapo_tune.search", "slapo_tune.cli", "slapo_tune.__main__", "slapo_tune")),
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the library modules it imports."""
    mods = modules(root)

    def known(name: str) -> str | None:
        return name if name in mods else None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in mods:  # import a.b.c where c is not a module
                        target = target.rpartition(".")[0]
                    targets.add(target)
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                for alias in node.names:  # `from p import m` imports the module p.m when there is one
                    targets.add(known(f"{source}.{alias.name}") or known(source) or "")
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members if m != "slapo_tune"):
            return index
    if module == "slapo_tune":  # the package root re-exports the public API: it sits on top
        return len(LAYERS) - 1
    raise AssertionError(f"{module} is in no layer: add it to LAYERS (and docs/development.md's layout section)")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                  for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_module_has_a_layer_and_imports_only_downward(graph):
    assert len(graph) > 40 and graph["slapo_tune.session"] >= {"slapo_tune.problem", "slapo_tune.runtime"}
    assert upward_imports(graph) == []


def test_no_circle(graph):
    """Not even inside the schedule language: module state (``_state``) at its bottom, then tracing
    and graph rewrites, the tree (``_schedule``), pipelines, and materialisation (``_build``)."""
    assert circles(graph) == []


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """The same checks on a copy of the library with one import added where it must not be: the
    template module importing the tuner (upward, and a circle through the tuner's imports)."""
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package)
    template = tmp_path / "slapo_tune" / "template.py"
    template.write_text(template.read_text() + "\n\ndef _tuner():\n    from .search import Tuner\n    return Tuner\n")
    broken = import_graph(tmp_path)
    assert "slapo_tune.template (templates) imports slapo_tune.search (tuner and CLI)" in upward_imports(broken)
    assert any("slapo_tune.template" in c and "slapo_tune.search._driver" in c for c in circles(broken))


REASONS = ("torch-free", "optuna-free", "rich-free")


def test_an_import_inside_a_function_says_why():
    """An import of the library's own modules belongs at the top of its module (no circle needs one
    deferred: see test_no_circle); one inside a function keeps a heavy package out of a path that
    must not load it (``plan``, ``space``, every ``--help``, ``import slapo_tune``), and says which,
    on its line or in the comment above its group of imports."""
    unexplained = []
    for module, path in modules().items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or not _is_project_import(node, module):
                    continue
                above = node.lineno - 2
                while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
                    above -= 1
                said = lines[node.lineno - 1] + (lines[above] if above >= 0 else "")
                if not any(reason in said for reason in REASONS):
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert unexplained == []


def _is_project_import(node: ast.Import | ast.ImportFrom, module: str) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
    return any(alias.name.split(".")[0] in PACKAGES for alias in node.names)
