"""The model layout: the parameter and activation sizes of one model, found once from its
meta-device build and the activation probe (:mod:`._probe`), cached per config and template; and
whether an attention kernel writes its scores (:func:`scores_materialised`: one rule for the memory
and the time model, read of what the probe found)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .._atomic import atomic_write_text
from ..models import config_fingerprint, model_from_config
from ..precision import Precision
from ..template import Template
from ._probe import activation_probe
from .hardware import _cache_dir


@dataclass(frozen=True)
class ModelLayout:
    """The parameter and activation sizes of one model, found once from its meta-device build."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    block_sharded: int  # per block: parameters tensor parallelism splits
    block_replicated: int  # per block: parameters every tp rank keeps
    pre_sharded: int  # before the blocks (token embedding)
    pre_replicated: int  # before the blocks (positions, embedding norms)
    post_sharded: int  # after the blocks (LM head) if not tied to the embedding
    post_replicated: int  # after the blocks (final norm, head transform)
    tied_head: bool
    # the MLP's activation function as the config names it (``hidden_act`` / ``activation_function``):
    # how many element-wise passes it makes (:data:`~._time.ACTIVATION_OP_PASSES`); "" in layouts from before it
    activation: str = ""
    # the attention is causal (a decoder: the template's loss is a causal LM's, whose labels are the
    # next tokens, so no query may see its own label): a causal SDPA kernel skips the masked blocks
    # (:func:`~._time.attention_pairs`). False in layouts from before it, and in BERT's
    causal: bool = False
    # the attention's dropout probability in training (the config's): context parallelism's fused
    # chunked kernels run only without it (:mod:`slapo_tune.parallel._context_parallel`)
    attention_dropout: float = 0.0
    # measured by :func:`activation_probe`, per precision (``{"amp-bf16": {"sdpa/off/rep": ...}}``),
    # as the training step runs it: bytes one block saves for its backward per token, and per
    # attention-score element (per head, per query and key), per attention kernel
    token_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    score_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    # one line per measurement the probe could not make, and what stands in for it (textbook
    # counts, a tensor-parallel split not measured): empty when everything was measured
    probe_fallbacks: list[str] = field(default_factory=list)

    @property
    def parameters(self) -> int:
        return (self.layers * (self.block_sharded + self.block_replicated) + self.pre_sharded
                + self.pre_replicated + self.post_sharded + self.post_replicated)


_LAYOUTS: dict[tuple[str, str, str], ModelLayout] = {}
LAYOUT_VERSION = 10  # bump when what a layout measures changes: cached layouts are then remeasured


def layout_key(config: Any, template: Template) -> tuple[str, str, str]:
    """What a model's layout is known by: its config's fingerprint, its template's name and version."""
    # a template from a user's file is known by its content too: its name and version need not change with it
    version = str(template.version) + (f"+{template.source.sha256[:12]}" if template.source else "")
    return config_fingerprint(config), template.name, version


def layout_of(config: Any, template: Template) -> ModelLayout:
    """Measure a model from its config: which parameters sit in a block, before and after the
    blocks, and what a block keeps for its backward (:func:`activation_probe`). Only one- and
    two-block copies are built (meta device, fake tensors); blocks are alike. Cached per config."""
    import torch

    key = layout_key(config, template)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    cache = _cache_dir() / (f"layout-v{LAYOUT_VERSION}-{key[0].removeprefix('sha256:')}-{key[1]}-{key[2]}"
                            f"-torch{torch.__version__}.json")
    try:
        layout = ModelLayout(**json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError):
        layout = _measure_layout(config, template)
        atomic_write_text(cache, json.dumps(asdict(layout)))
    _LAYOUTS[key] = layout
    return layout


def _measure_layout(config: Any, template: Template) -> ModelLayout:
    import copy

    # torch-free: plan and every --help import this module; _pipeline imports torch
    from ..schedule._pipeline import _dry_run, _topmost

    layers = config.num_hidden_layers
    small_config = copy.deepcopy(config)
    small_config.num_hidden_layers = min(2, layers)
    model = model_from_config(small_config, "meta")
    blocks_path = template.blocks_path(model)
    block0 = model.get_submodule(blocks_path)[0]

    def split(params) -> tuple[int, int]:
        params = list(params)
        sharded = sum(p.numel() for p in params if p.dim() >= 2)
        return sharded, sum(p.numel() for p in params if p.dim() < 2)

    block_sharded, block_rep = split(block0.parameters())
    calls = _dry_run(model)
    start = calls[f"{blocks_path}.0"].order
    pre, post = [], []
    for path, m in model.named_modules():
        if (not path or path not in calls or path == blocks_path or path.startswith(blocks_path + ".")
                or blocks_path.startswith(path + ".") or not any(True for _ in m.parameters())):
            continue
        (pre if calls[path].order < start else post).append(path)
    pre_params = {id(p): p for path in _topmost(pre) for p in model.get_submodule(path).parameters()}
    post_params = {id(p): p for path in _topmost(post) for p in model.get_submodule(path).parameters()}
    tied = bool(set(pre_params) & set(post_params))
    post_only = [p for k, p in post_params.items() if k not in pre_params]
    pre_sharded, pre_rep = split(pre_params.values())
    post_sharded, post_rep = split(post_only)
    heads = config.num_attention_heads
    hidden = config.hidden_size
    token_bytes, score_bytes, fallbacks = activation_probe(config, template, fusion=bool(template.has_fusion))
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = (getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
             or getattr(config, "n_inner", None) or 4 * hidden)
    gated = any(hasattr(m, "gate_proj") for _, m in block0.named_modules())
    activation = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or ""
    return ModelLayout(
        family=getattr(config, "model_type", "model"), layers=layers, hidden=hidden, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate=inter, vocab=config.vocab_size, gated_mlp=gated,
        block_sharded=block_sharded, block_replicated=block_rep, pre_sharded=pre_sharded,
        pre_replicated=pre_rep, post_sharded=post_sharded, post_replicated=post_rep, tied_head=tied,
        activation=activation if isinstance(activation, str) else "", causal=bool(template.causal_lm),
        attention_dropout=attention_dropout_of(config), token_bytes=token_bytes, score_bytes=score_bytes, probe_fallbacks=fallbacks,
    )


def attention_dropout_of(config: Any) -> float:
    """The attention dropout probability ``config`` trains with, under the names Hugging Face's
    families give it (Llama-style ``attention_dropout``, GPT-2's ``attn_pdrop``, BERT's, MPT's
    ``attn_config``); 0 where it names none."""
    for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    nested = getattr(config, "attn_config", None)
    value = nested.get("attn_pdrop") if isinstance(nested, dict) else getattr(nested, "attn_pdrop", None)
    return float(value) if isinstance(value, (int, float)) else 0.0


def cp_gathers_keys(layout: ModelLayout, attn: str, mode: Precision, gpu: bool) -> bool:
    """Does context parallelism keep the gathered keys and values (repeated to the query heads) for
    its backward? Eager attention does, and SDPA under attention dropout, or on a GPU in fp32 (no
    FlashAttention-2); otherwise the chunked flash kernels keep only the rank's own
    (:mod:`slapo_tune.parallel._context_parallel`)."""
    # elementwise over arrays of ``attn`` (the time model's columns) as over one point's
    return (attn == "eager") | (layout.attention_dropout > 0) | (gpu & (mode.activation_bytes >= 4))


def scores_materialised(layout: ModelLayout, attn: str, mode: Precision, gpu: bool = False) -> bool:
    """Does the attention kernel write the score matrix? Eager does; SDPA never on a GPU (a fused
    kernel: FlashAttention-2 or the memory-efficient one, attention dropout included), on a CPU
    where the activation probe found it keeping scores in ``precision`` (torch's math fallback:
    attention dropout)."""
    if attn == "eager":
        return True
    return not gpu and layout.score_bytes.get(mode.measured_as, {}).get(attn, 0.0) > 0
