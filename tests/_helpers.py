"""Helpers shared by tests (importable by spawned ranks)."""

from __future__ import annotations

import importlib
import ipaddress
import os
from pathlib import Path

import torch

import slapo_tune as st
from slapo_tune.parallelize import apply_checkpointing, apply_tensor_parallel

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"gpt2-tiny": "gpt2", "llama-tiny": "llama", "bert-tiny": "bert", "opt-tiny": "opt"}


def is_loopback(address: str) -> bool:
    """Whether a socket address (as psutil gives it) is on the loopback: 127.0.0.0/8, ::1, and
    ::ffff:127.0.0.1 (an IPv4 loopback address on a dual-stack socket)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def token_batch(vocab: int, batch: int = 2, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)  # includes the padding id
    return {"input_ids": ids, "labels": ids.clone()}


def uncompared(reference: torch.nn.Module, compared_per_rank) -> list[str]:
    """The reference's parameters whose gradient no rank compared (a tied tensor counts as compared
    under any of its names), by their first name."""
    names: dict[int, list[str]] = {}
    for name, param in reference.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    covered = set().union(*map(set, compared_per_rank))
    return [aliases[0] for aliases in names.values() if not covered & set(aliases)]


def subprocess_env() -> dict[str, str]:
    """The environment of a command a test runs (the CLI, torchrun): this checkout, one thread a rank."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def schedule_file(path: Path, preset: str = "gpt2-tiny", global_batch: int = 8, seq_len: int = 32,
                  precision: str = "fp32", measured: dict | None = None, **knobs) -> Path:
    """A schedule file of one point of ``preset``'s built-in template (knobs not given: no parallelism
    beyond what is named, micro-batch 2), written to ``path``."""
    from slapo_tune.models import config_fingerprint, load_config
    from slapo_tune.plan import Plan, Workload
    from slapo_tune.schedule_file import make_schedule, write_schedule

    point = {"tp": 1, "pp": 1, "dp": 1, "zero": 0, "micro_batch": 2, "ckpt_ratio": 0.0, "pipeline_schedule": "1f1b",
             "attn": "sdpa", "fuse": "off", **knobs}
    world = point["tp"] * point["pp"] * point["dp"]
    config = load_config(preset)
    schedule = make_schedule(
        template={"name": preset.split("-")[0], "version": "1"},
        plan=Plan.of(point, Workload(world, global_batch, seq_len, precision)), world_size=world,
        global_batch=global_batch, seq_len=seq_len, precision=precision, device="cpu",
        model={"name": preset, "overrides": {}, "fingerprint": config_fingerprint(config)}, measured=measured)
    write_schedule(path, schedule)
    return path


TINY_DECODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=512, max_position_embeddings=128, bos_token_id=0, eos_token_id=2)


def saved_config(directory, config_class: str, **fields) -> str:
    """A ``transformers`` config of ``config_class`` (e.g. ``"Qwen2Config"``) with ``fields``, saved in
    ``directory`` (a model built from a local config, as nothing can be downloaded); its path."""
    import transformers

    getattr(transformers, config_class)(**fields).save_pretrained(directory)
    return str(directory)


def phi3_config(directory) -> str:
    """A Phi-3-style decoder nobody wrote a template for, saved in ``directory``: its qkv_proj has
    (4 + 2 x 2) x 16 = 128 outputs sliced at the config's offsets, its gate_up_proj 2 x 128 cut with chunk."""
    return saved_config(directory, "Phi3Config", intermediate_size=128, pad_token_id=1, resid_pdrop=0.0,
                        embd_pdrop=0.0, attention_dropout=0.0, **TINY_DECODER)


def glm_config(directory) -> str:
    """A GLM decoder (separate Q, K, V; gate_up_proj 2 x 128 cut with chunk), saved in ``directory``."""
    return saved_config(directory, "GlmConfig", intermediate_size=128, pad_token_id=1, attention_dropout=0.0,
                        **TINY_DECODER)


def family_module(preset: str):
    return importlib.import_module(f"search_spaces.{FAMILIES[preset]}")


def blocks(sch: st.Schedule, preset: str) -> list[st.Schedule]:
    node = sch[family_module(preset).BLOCKS]
    return [node[name] for name in node.child]


def tp_schedule(preset: str, ckpt_ratio: float = 0.0, **overrides) -> st.Schedule:
    """A meta-device model scheduled with its family's tensor-parallel plan and checkpointing."""
    sch = st.create_schedule(st.build_model(preset, **overrides))
    apply_tensor_parallel(sch, family_module(preset).TP_PLAN)
    apply_checkpointing(blocks(sch, preset), ckpt_ratio)
    return sch


def parallel_schedule(preset: str, topology, ckpt_ratio: float = 0.0) -> st.Schedule:
    """A meta-device model with tensor parallelism over ``topology.tp_group``, checkpointing and
    ``topology.pp`` evenly sized pipeline stages."""
    from slapo_tune.parallelize import apply_pipeline_cuts

    sch = st.create_schedule(st.build_model(preset), group=topology.tp_group)
    apply_tensor_parallel(sch, family_module(preset).TP_PLAN)
    apply_checkpointing(blocks(sch, preset), ckpt_ratio)
    apply_pipeline_cuts(blocks(sch, preset), topology.pp)
    return sch

from slapo_tune import bias_then  # noqa: E402,F401  (re-exported for the test modules)
