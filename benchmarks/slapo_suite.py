"""Slapo's own test suite, run against ``slapo_tune.compat`` on CPU.

``python -m benchmarks.slapo_suite PATH`` takes a Slapo checkout the user fetched (a work tree, or a
git directory: ``git clone https://github.com/awslabs/slapo``), copies its ``tests/`` into a
temporary folder and ports them with device, backend and import edits only:

- ``import slapo`` reaches ``slapo_tune.compat`` (a ``slapo`` package in the temporary folder
  registers ``slapo_tune.compat`` and each of its submodules under Slapo's names);
- ``.cuda(...)`` is dropped, ``torch.cuda.set_device``/``synchronize``/``empty_cache`` do
  nothing, ``"cuda..."`` devices are ``"cpu"``, ``"nccl"`` is ``"gloo"``, CUDA events time with
  the wall clock and ``torch.cuda.device_count()`` is the world size, a rank given as a device
  (``device=sch.rank``, a GPU's index) is ``"cpu"``, fp16 (``.half()``, ``torch.float16``: a
  GPU's arithmetic, emulated on a CPU) is fp32; the ``mock`` package Slapo's tests import is the
  standard library's ``unittest.mock``;
- the Hugging Face configs the tests load by name (``AutoConfig.from_pretrained("bert-base-uncased")``)
  come from local ``config.json`` files written here (nothing is downloaded).

It then runs them as Slapo's CI does (``torchrun --nproc_per_node 2 -m pytest tests``) on gloo,
and prints each test's result (passed only where both ranks passed) and the total over the
CPU-portable items. Left out: the attention kernels that need CUDA (``test_attention`` over
cutlass, cuda and triton) and the CUDA RNG tests (``test_random.py``); Slapo's own skip stays a
skip. Slapo's code is never copied into this repository: the temporary folder goes when it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the items that cannot run without CUDA, by node id prefix: (prefix, why)
CUDA_ONLY = (
    ("tests/test_op.py::test_attention", "a CUDA attention kernel (flash-attn / xFormers / triton)"),
    ("tests/test_random.py", "CUDA's RNG state"),
)

# the Hugging Face configs Slapo's tests load by name, as published on the Hub (config.json, the
# fields the models read; dropout as published)
_BERT = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "attention_probs_dropout_prob": 0.1,
         "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "initializer_range": 0.02, "layer_norm_eps": 1e-12,
         "max_position_embeddings": 512, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 30522}
_NEO = {"architectures": ["GPTNeoForCausalLM"], "model_type": "gpt_neo", "activation_function": "gelu_new",
        "attention_dropout": 0, "embed_dropout": 0, "resid_dropout": 0, "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 2048, "vocab_size": 50257, "window_size": 256, "intermediate_size": None,
        "bos_token_id": 50256, "eos_token_id": 50256, "initializer_range": 0.02}
HF_CONFIGS = {
    "bert-base-uncased": {**_BERT, "hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                          "num_hidden_layers": 12},
    "bert-large-uncased": {**_BERT, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                           "num_hidden_layers": 24},
    "gpt2-medium": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
                    "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
                    "n_ctx": 1024, "n_embd": 1024, "n_head": 16, "n_layer": 24, "n_positions": 1024,
                    "vocab_size": 50257, "bos_token_id": 50256, "eos_token_id": 50256, "initializer_range": 0.02},
    "EleutherAI/gpt-neo-125M": {**_NEO, "hidden_size": 768, "num_heads": 12, "num_layers": 12,
                                "attention_types": [[["global", "local"], 6]]},
    "EleutherAI/gpt-neo-1.3B": {**_NEO, "hidden_size": 2048, "num_heads": 16, "num_layers": 24,
                                "attention_types": [[["global", "local"], 12]]},
}

# the ``slapo`` package of the temporary folder: Slapo's names for slapo_tune.compat
SHIM = '''"""Slapo's module names over slapo_tune.compat (written by benchmarks.slapo_suite)."""
import importlib
import pkgutil
import sys

import slapo_tune.compat as _compat

sys.modules[__name__] = _compat
for _info in pkgutil.walk_packages(getattr(_compat, "__path__", []), "slapo_tune.compat."):
    _module = importlib.import_module(_info.name)
    sys.modules["slapo" + _info.name[len("slapo_tune.compat"):]] = _module
'''

# a ``slapo`` that imports whatever is asked of it, for counting the suite's items: the items of a
# file whose imports fail against compat are still items, failed
STUB = '''"""Any name of Slapo's, as a placeholder (written by benchmarks.slapo_suite to count items)."""
import importlib.abc
import importlib.machinery
import sys
import types


class _Any:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Any()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("slapo."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__path__ = []
__getattr__ = _Module.__getattr__.__get__(sys.modules[__name__])
'''

# what the ported tests call instead of CUDA's (imported as ``slapo_port``)
PORT = '''"""CPU stand-ins for the CUDA calls Slapo's tests make (written by benchmarks.slapo_suite)."""
import os
import time
from pathlib import Path

CONFIGS = Path(__file__).with_name("hf_configs")


class CpuEvent:
    """torch.cuda.Event(enable_timing=True) on the wall clock: elapsed_time in milliseconds."""

    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, *args, **kwargs):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def device_count():
    return int(os.environ.get("WORLD_SIZE", "1"))


def config_path(name):
    return str(CONFIGS / name)


def nothing(*args, **kwargs):
    return None
'''

_CUDA_CALL = re.compile(r"\.cuda\((?:[^()]|\([^()]*\))*\)")
_CUDA_DEVICE = re.compile(r"""f?(["'])cuda(?::[^"']*)?\1""")
_RANK_DEVICE = re.compile(r"device=(?:\w+\.)*\w*rank\w*(?:\(\))?")


def port_source(text: str) -> str:
    """A Slapo test file's text with its device, backend and model-download edits (the module
    docstring's list), nothing else."""
    text = _CUDA_CALL.sub("", text)
    for call in ("set_device", "synchronize", "empty_cache"):
        text = text.replace(f"torch.cuda.{call}(", '__import__("slapo_port").nothing(')
    text = text.replace("torch.cuda.Event(", '__import__("slapo_port").CpuEvent(')
    text = text.replace("torch.cuda.device_count()", '__import__("slapo_port").device_count()')
    text = _CUDA_DEVICE.sub('"cpu"', text)
    text = _RANK_DEVICE.sub('device="cpu"', text)  # a rank as a device is a GPU's index
    # half precision is a GPU's: a CPU has no fp16 arithmetic (emulated, about 0.1 GFLOP/s here,
    # hours for one of Slapo's fp16 MLPs), so fp16 tensors and modules are fp32's on CPU ranks
    text = text.replace(".half()", ".float()").replace("torch.float16", "torch.float32")
    text = re.sub(r"""(["'])nccl\1""", '"gloo"', text)
    text = re.sub(r"^from mock import", "from unittest.mock import", text, flags=re.M)  # Slapo's test dependency
    for name in HF_CONFIGS:
        text = re.sub(rf"""from_pretrained\((["']){re.escape(name)}\1""",
                      f'from_pretrained(__import__("slapo_port").config_path("{name}")', text)
    return text


# collects each item's outcome on this rank (written into the ported tests' folder)
COLLECTOR = '''"""Each test's outcome on this rank (written by benchmarks.slapo_suite)."""
import json
import os

_OUT = os.path.join(os.environ["SLAPO_SUITE_OUT"], f"rank-{os.environ.get('RANK', '0')}.jsonl")


def _reason(report):
    text = str(report.longrepr) if report.longrepr is not None else ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("E ")]
    return (lines[0][2:].strip() if lines else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def _write(record):
    with open(_OUT, "a") as f:
        f.write(json.dumps(record) + "\\n")


def pytest_collectreport(report):
    if report.failed:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "reason": _reason(report)})


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                "reason": _reason(report) if report.outcome != "passed" else ""})
'''


def copy_tests(checkout: Path, dest: Path) -> None:
    """Slapo's ``tests/`` and the root ``conftest.py`` its CI runs them with (fixtures such as
    ``init_dist``, the items' order), from a work tree or from a git directory's HEAD."""
    if (checkout / "tests").is_dir():
        shutil.copytree(checkout / "tests", dest / "tests")
        if (checkout / "conftest.py").is_file():
            shutil.copy(checkout / "conftest.py", dest / "conftest.py")
        return
    archive = subprocess.run(["git", "--git-dir", str(checkout), "archive", "HEAD", "tests", "conftest.py"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"slapo_suite: {checkout} is neither a Slapo work tree (no tests/) nor a git directory")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def prepare(checkout: Path, work: Path) -> None:
    """The ported suite in ``work``: the tests, the ``slapo`` package, the stand-ins, the configs."""
    copy_tests(checkout, work)
    for path in [*(work / "tests").rglob("*.py"), *work.glob("conftest.py")]:
        path.write_text(port_source(path.read_text()))
    (work / "tests" / "conftest.py").write_text(COLLECTOR)
    # each ``slapo`` in a folder of its own: pytest puts the suite's root (its conftest.py) first
    # on sys.path, so neither may live there
    (work / "shim" / "slapo").mkdir(parents=True)
    (work / "shim" / "slapo" / "__init__.py").write_text(SHIM)
    (work / "slapo_port.py").write_text(PORT)
    (work / "stub" / "slapo").mkdir(parents=True)
    (work / "stub" / "slapo" / "__init__.py").write_text(STUB)
    for name, config in HF_CONFIGS.items():
        folder = work / "hf_configs" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))


def _leave_out() -> list[str]:
    """pytest's arguments that leave :data:`CUDA_ONLY` out: a whole file, or a test's every item."""
    args = []
    for prefix, _ in CUDA_ONLY:
        path, _, test = prefix.partition("::")
        args += ["--deselect", prefix] if test else ["--ignore", path]
    return args


def _env(work: Path, first: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(first), str(work), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": path,
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "CUDA_VISIBLE_DEVICES": "", **extra}


def census(work: Path, select: list[str]) -> list[str]:
    """Every item of the suite (but :data:`CUDA_ONLY`), collected against a ``slapo`` that has
    every name: the items of a file whose imports fail against compat."""
    scratch = work / "census"
    scratch.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *(select or ["tests"]), *_leave_out()], cwd=work,
                          env=_env(work, work / "stub", SLAPO_SUITE_OUT=str(scratch)),
                          capture_output=True, text=True, timeout=600)
    return [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def run_suite(work: Path, ranks: int, timeout: float, select: list[str]) -> dict[str, dict]:
    """Run the ported tests on ``ranks`` gloo ranks; each item's verdict over the ranks (an item
    of a file that failed to import: failed, with the import's error)."""
    items = census(work, select)
    out = work / "outcomes"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "--continue-on-collection-errors", *(select or ["tests"]), *_leave_out()]
    env = _env(work, work / "shim", SLAPO_SUITE_OUT=str(out))
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks are in the launcher's session, started here
        log, _ = proc.communicate()
        log += f"\nslapo_suite: stopped after {timeout:.0f} s"
    (work / "pytest.log").write_text(log)
    results: dict[str, dict] = {}
    broken: dict[str, str] = {}  # file -> why it did not import
    for path in sorted(out.glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["when"] == "collect":
                broken[rec["nodeid"]] = rec["reason"]
                continue
            verdict = results.setdefault(rec["nodeid"], {"outcome": "passed", "reason": "", "ranks": 0})
            if rec["when"] == "call" or rec["outcome"] != "passed":
                verdict["ranks"] += rec["when"] == "call" or rec["outcome"] == "skipped"
            order = {"passed": 0, "skipped": 1, "failed": 2}
            if order[rec["outcome"]] > order[verdict["outcome"]]:
                verdict["outcome"], verdict["reason"] = rec["outcome"], rec["reason"]
    for item in items:  # an item that never ran: its file did not import, or the run ended first
        if item not in results:
            why = broken.get(item.split("::")[0], "not run (the suite ended first: see its log)")
            results[item] = {"outcome": "failed", "reason": f"collection: {why}", "ranks": 0}
    for verdict in results.values():  # an item that ran on fewer ranks than started did not pass
        if verdict["outcome"] == "passed" and verdict["ranks"] < ranks:
            verdict["outcome"], verdict["reason"] = "failed", f"reported by {verdict['ranks']} of {ranks} ranks"
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Slapo checkout (work tree or git directory)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the whole suite")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    parser.add_argument("tests", nargs="*", help="node ids to run (default: the whole suite)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="slapo-suite-"))
    t0 = time.perf_counter()
    try:
        prepare(args.checkout.resolve(), work)
        results = run_suite(work, args.ranks, args.timeout, args.tests)
    finally:
        if args.keep:
            print(f"ported suite kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    width = max((len(k) for k in results), default=10)
    for nodeid, v in sorted(results.items()):
        reason = f"  {v['reason'][:100]}" if v["outcome"] != "passed" else ""
        print(f"{nodeid:<{width}}  {v['outcome']}{reason}")
    ran = {k: v for k, v in results.items() if v["outcome"] != "skipped"}
    passed = sum(v["outcome"] == "passed" for v in ran.values())
    skipped = len(results) - len(ran)
    print(f"passed {passed} of {len(ran)} CPU-portable items ({skipped} skipped by Slapo; left out as CUDA-only: "
          + "; ".join(f"{p} ({why})" for p, why in CUDA_ONLY) + f") in {time.perf_counter() - t0:.0f} s")
    summary = {"passed": passed, "portable": len(ran), "skipped": skipped, "results": results}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
