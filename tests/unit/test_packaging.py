"""The two README commands exist, CI runs the test command, and only our packages are installed."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_only_the_three_packages_are_installed():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = conf["tool"]["setuptools"]["packages"]["find"]["include"]
    top = {p.split(".")[0] for p in find_packages(where=str(ROOT), include=include)}
    assert top == {"slapo_tune", "search_spaces", "runners"}


def test_readme_commands_are_make_targets_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```(?:sh|bash)?\n(.*?)```", readme, re.S)
    assert block, "README needs a Quickstart code block"
    commands = [c.strip() for c in block.group(1).splitlines() if c.strip() and not c.startswith("#")]
    assert commands == ["make tune", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^tune:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "torch==2.13.0" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_console_script_is_declared():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert conf["project"]["scripts"]["slapo-tune"] == "slapo_tune.cli:main"
    deps = " ".join(conf["project"]["dependencies"])
    for dep in ("torch", "transformers", "optuna", "ray[default]", "pandas"):
        assert dep in deps


def test_importing_the_library_changes_no_environment(tmp_path):
    """A program that imports slapo_tune (and builds a model from a local config) keeps its own
    environment: the Hub and transformers' logging stay as it set them. Only the command line,
    which owns its process, sets them."""
    import json

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_head": 2, "n_layer": 1,
         "n_positions": 16, "vocab_size": 64}))
    code = ("import os, slapo_tune; m = slapo_tune.build_model(os.environ['CFG']); "
            "print(sorted(k for k in ('HF_HUB_OFFLINE', 'TRANSFORMERS_VERBOSITY') if k in os.environ), type(m).__name__)")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY")}
    env["CFG"] = str(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "GPT2LMHeadModel"]
