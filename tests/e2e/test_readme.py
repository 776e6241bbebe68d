"""The schedule language's 20-line example (docs/schedule-language.md) runs as written, under torchrun on 2
CPU ranks."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_example_verifies_under_torchrun(tmp_path, no_leftover_children):
    text = (ROOT / "docs" / "schedule-language.md").read_text()
    code = re.search(r"## Scheduling a model in 20 lines\n\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 25
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "localhost:0", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.stdout.count("verify: OK") == 2, proc.stderr[-3000:]
    # torch 2.13's teardown can abort a rank at interpreter exit, after its work is done and printed
    # ("terminate called without an active exception", SIGABRT): reproduced without slapo-tune
    # (gloo initialised, a GPT2LMHeadModel built on meta, one all_reduce, the group destroyed: 6 of
    # 8 torchrun runs on a loaded 2-core machine; without the model, 0 of 8). Any other failure fails.
    torch_exit_abort = "terminate called without an active exception" in proc.stderr and "(SIGABRT)" in proc.stderr
    assert proc.returncode == 0 or torch_exit_abort, proc.stderr[-3000:]
