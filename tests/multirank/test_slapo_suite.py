"""``benchmarks.slapo_suite``: the port edits are device, backend and download edits only, the offline
configs are the published models, and a suite's items are counted and judged over both ranks (a
file that does not import against compat counts its items as failed, a skip stays a skip)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import transformers

from benchmarks.slapo_suite import HF_CONFIGS, main, port_source

# the published parameter counts of the base models (Hugging Face model cards / the papers' tables)
PUBLISHED = {"bert-base-uncased": 109_482_240, "bert-large-uncased": 335_141_888, "gpt2-medium": 354_823_168,
             "EleutherAI/gpt-neo-125M": 125_198_592, "EleutherAI/gpt-neo-1.3B": 1_315_575_808}


def test_the_port_edits_devices_backends_and_downloads_only():
    source = textwrap.dedent('''\
        from mock import MagicMock
        torch.cuda.set_device(local_rank)
        model.cuda(local_rank); data = torch.randn((10, 10), requires_grad=True).cuda(f(x, y))
        dist.init_process_group("nccl")
        inp = torch.randn(4, device=f"cuda:{dist.get_rank()}"); other = x.to("cuda")
        config = AutoConfig.from_pretrained("bert-large-uncased")
        start = torch.cuda.Event(enable_timing=True); n = torch.cuda.device_count()
        assert model(x) == 1  # cuda in a comment stays
        ids = torch.ones(2, 4, dtype=torch.long, device=sch.rank); mlp = mlp.half(); h = torch.randn(3, dtype=torch.float16)
        ''')
    ported = port_source(source)
    assert ".cuda(" not in ported and "nccl" not in ported and '"cuda' not in ported
    assert "from unittest.mock import MagicMock" in ported and 'init_process_group("gloo")' in ported
    assert 'device="cpu"' in ported and 'x.to("cpu")' in ported
    assert 'config_path("bert-large-uncased")' in ported and "CpuEvent(enable_timing=True)" in ported
    assert "assert model(x) == 1  # cuda in a comment stays" in ported
    assert 'dtype=torch.long, device="cpu")' in ported and "mlp.float()" in ported and "dtype=torch.float32" in ported
    compile(ported, "ported", "exec")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_offline_configs_are_the_published_models(name):
    config = transformers.AutoConfig.for_model(**HF_CONFIGS[name])
    model_class = {"bert": transformers.BertModel, "gpt2": transformers.GPT2Model,
                   "gpt_neo": transformers.GPTNeoModel}[config.model_type]
    with torch.device("meta"):
        model = model_class(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


def test_a_suite_is_counted_and_judged_over_both_ranks(tmp_path, capsys, no_leftover_children):
    checkout = tmp_path / "slapo"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "conftest.py").write_text(textwrap.dedent('''\
        import pytest
        import torch.distributed as dist

        @pytest.fixture(scope="session")
        def init_dist():
            dist.init_process_group("nccl")
            yield
            dist.destroy_process_group()
        '''))
    (checkout / "tests" / "test_ok.py").write_text(textwrap.dedent('''\
        import os

        import pytest
        import torch
        import torch.distributed as dist
        import slapo

        def test_schedules(init_dist):
            sch = slapo.create_schedule(torch.nn.Linear(2, 2).cuda())
            assert dist.get_world_size() == 2 and sch is not None

        def test_fails_on_one_rank(init_dist):
            assert dist.get_rank() == 0

        @pytest.mark.skip(reason="flaky")
        def test_skipped():
            pass
        '''))
    (checkout / "tests" / "test_missing.py").write_text("from slapo.nosuch import thing\n\n\n"
                                                         "def test_a():\n    thing()\n\n\n"
                                                         "def test_b():\n    thing()\n")
    summary = main([str(checkout), "--timeout", "300"])
    results = {k.split("::")[1]: v["outcome"] for k, v in summary["results"].items()}
    assert results == {"test_schedules": "passed", "test_fails_on_one_rank": "failed", "test_skipped": "skipped",
                       "test_a": "failed", "test_b": "failed"}
    assert "No module named 'slapo.nosuch'" in summary["results"]["tests/test_missing.py::test_a"]["reason"]
    assert (summary["passed"], summary["portable"], summary["skipped"]) == (1, 4, 1)
    assert "passed 1 of 4 CPU-portable items (1 skipped by Slapo" in capsys.readouterr().out
