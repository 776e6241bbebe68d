"""Hugging Face models built from configurations only (nothing is downloaded).

``build_model(name_or_path, device="meta")`` accepts a preset name (tiny presets for tests,
real-size configurations by name) or a local ``config.json`` / model directory. On the meta device
a model costs nothing, so real-size models (``llama-70b``) can be scheduled and costed anywhere;
:func:`slapo_tune.build` gives them real weights later.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._inputs import read_json_file
from .errors import UsageError

if TYPE_CHECKING:  # torch is imported where a model is built: planning needs none
    import torch
    from torch import nn

@dataclass(frozen=True)
class Preset:
    """A named model configuration: the Hugging Face config class, its task class and values."""

    family: str
    config_class: str
    model_class: str
    values: dict[str, Any] = field(default_factory=dict)
    description: str = ""


def _ids(vocab: int) -> dict[str, int]:
    # Token ids inside the vocabulary, so tiny vocabularies do not trigger config warnings.
    return {"bos_token_id": 0, "eos_token_id": 2 if vocab > 2 else 0, "pad_token_id": 1}


_TINY = 512
PRESETS: dict[str, Preset] = {
    # Tiny presets: 4 layers so pipelines of 2 and 4 stages exist; sizes divisible by 4 for tp=4.
    "gpt2-tiny": Preset("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(
        n_layer=4, n_embd=64, n_head=4, n_positions=256, vocab_size=_TINY,
        embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0, eos_token_id=2,
    ), "GPT-2, 4 layers, hidden 64"),
    "llama-tiny": Preset("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=176, vocab_size=_TINY, max_position_embeddings=256, **_ids(_TINY),
    ), "Llama, 4 layers, hidden 64, grouped-query attention (8 heads, 4 KV heads)"),
    "bert-tiny": Preset("bert", "BertConfig", "BertForMaskedLM", dict(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, intermediate_size=256,
        vocab_size=_TINY, max_position_embeddings=256, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1,
    ), "BERT masked LM, 4 layers, hidden 64"),
    "opt-tiny": Preset("opt", "OPTConfig", "OPTForCausalLM", dict(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, ffn_dim=256, vocab_size=_TINY,
        word_embed_proj_dim=64, max_position_embeddings=256, dropout=0.0, attention_dropout=0.0,
        **_ids(_TINY),
    ), "OPT, 4 layers, hidden 64"),
    # Real sizes (their published configurations), for planning and for meta-device scheduling.
    "gpt2": Preset("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(n_layer=12, n_embd=768, n_head=12), "124M"),
    "gpt2-medium": Preset("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(n_layer=24, n_embd=1024, n_head=16), "355M"),
    "gpt2-large": Preset("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(n_layer=36, n_embd=1280, n_head=20), "774M"),
    "gpt2-xl": Preset("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(n_layer=48, n_embd=1600, n_head=25), "1.5B"),
    # GPT-3 175B (Brown et al. 2020) and Megatron-LM's 1T model (Narayanan et al. 2021, Table 1), GPT-2
    # blocks at their sizes; the vocabulary is GPT-2's 50257 padded to 51200 as Megatron pads it (a
    # multiple of 1024 = 128 x tp 8) so that tensor parallelism can split the embedding
    "gpt3-175b": Preset("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(
        n_layer=96, n_embd=12288, n_head=96, n_positions=2048, vocab_size=51200), "GPT-3 175B"),
    "gpt-1t": Preset("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(
        n_layer=128, n_embd=25600, n_head=160, n_positions=2048, vocab_size=51200), "Megatron-LM's 1T GPT"),
    "llama-7b": Preset("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
    ), "Llama-2 7B"),
    "llama-13b": Preset("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=40,
        intermediate_size=13824, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
    ), "Llama-2 13B"),
    "llama-70b": Preset("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
    ), "Llama-2 70B (grouped-query attention)"),
    "llama3-8b": Preset("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ), "Llama-3 8B"),
    "mistral-7b": Preset("llama", "MistralConfig", "MistralForCausalLM", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=32000, max_position_embeddings=8192,
    ), "Mistral 7B"),
    "qwen2-7b": Preset("llama", "Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, max_position_embeddings=32768,
    ), "Qwen2 7B"),
    "bert-base": Preset("bert", "BertConfig", "BertForMaskedLM", dict(
        num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
    ), "110M"),
    "bert-large": Preset("bert", "BertConfig", "BertForMaskedLM", dict(
        num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
    ), "340M"),
    "opt-125m": Preset("opt", "OPTConfig", "OPTForCausalLM", dict(
        num_hidden_layers=12, hidden_size=768, num_attention_heads=12, ffn_dim=3072, word_embed_proj_dim=768,
    ), "125M"),
    "opt-350m": Preset("opt", "OPTConfig", "OPTForCausalLM", dict(
        num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, ffn_dim=4096,
        word_embed_proj_dim=512, do_layer_norm_before=False,
    ), "350M (projected embeddings)"),
    "opt-1.3b": Preset("opt", "OPTConfig", "OPTForCausalLM", dict(
        num_hidden_layers=24, hidden_size=2048, num_attention_heads=32, ffn_dim=8192, word_embed_proj_dim=2048,
    ), "1.3B"),
    "opt-6.7b": Preset("opt", "OPTConfig", "OPTForCausalLM", dict(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, ffn_dim=16384, word_embed_proj_dim=4096,
    ), "6.7B"),
}

# Which task class to build for a config loaded from disk, by model_type.
_TASK_CLASS = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "bert": "BertForMaskedLM",
    "opt": "OPTForCausalLM",
}
_CONFIG_ALIASES = {"attn_implementation": "_attn_implementation"}


def preset_names() -> list[str]:
    """Names accepted by :func:`build_model` besides config paths."""
    return sorted(PRESETS)


def load_config(name_or_path: str | os.PathLike, **overrides: Any):
    """The Hugging Face config for a preset name or a local ``config.json`` (or its directory)."""
    import transformers

    name = str(name_or_path)
    if name in PRESETS:
        preset = PRESETS[name]
        config = getattr(transformers, preset.config_class)(**preset.values)
    else:
        path = Path(name)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():  # (something else than a file there is read_json_file's to refuse)
            raise UsageError(
                f"unknown model '{name}': not a preset ({', '.join(preset_names())}) and no config.json at that path"
            )
        # bounded, a regular file, nested a few levels: what transformers then reads is small and sane
        if not isinstance(read_json_file(path, "model config"), dict):
            raise UsageError(f"model config {path} is not a JSON object")
        try:
            # a local file, never the Hub (a folder named like a Hub model must not reach the network)
            config = transformers.AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path),
                                                             local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers' validators raise many kinds: one line
            raise UsageError(f"cannot read model config {path}: {_first_line(exc)}") from None
    for key, value in overrides.items():
        key = _CONFIG_ALIASES.get(key, key)
        if not hasattr(config, key) and not key.startswith("_"):
            raise UsageError(f"model config {type(config).__name__} has no field '{key}'")
        try:
            setattr(config, key, value)
        except Exception as exc:  # noqa: BLE001 - a config's own validator refusing the value
            raise UsageError(f"model {name}: {key}={value!r} is refused by its config: {_first_line(exc)}") from None
    problem = architecture_problem(config)
    if problem:
        raise UsageError(f"model {name}: {problem}")
    return config


def _first_line(exc: BaseException) -> str:
    """An exception's message, first non-blank line (a validator's cause, where it wraps one)."""
    cause = exc.__cause__ or exc
    text = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


# the sizes every transformer config has (Hugging Face maps each family's own names onto these)
_POSITIVE_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def architecture_problem(config) -> str:
    """Why ``config`` describes no buildable transformer (no layers, a size that is not a positive
    integer, a hidden size the attention heads do not divide), or "" when it does. Checked when a
    config is loaded, so a bad one is one line before a template, the cost model or a rank meets it."""
    for name in _POSITIVE_SIZES:
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be a positive integer, got {value!r}"
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if heads and hidden and getattr(config, "head_dim", None) is None and hidden % heads:
        return f"hidden size {hidden} is not divisible by its {heads} attention heads"
    if heads and isinstance(kv_heads, int) and not isinstance(kv_heads, bool) and (kv_heads < 1 or heads % kv_heads):
        return f"its {heads} attention heads are not divisible by its {kv_heads} key/value heads"
    return ""


def model_family(config) -> str:
    """Family name used to choose a schedule template (``gpt2``, ``llama``, ``bert``, ``opt``, ...)."""
    mt = getattr(config, "model_type", "")
    return {"mistral": "llama", "qwen2": "llama"}.get(mt, mt)


def task_class(config) -> type:
    """The Hugging Face class :func:`model_from_config` builds for ``config`` (``AutoModelForCausalLM``
    where neither the family nor the config's ``architectures`` name one)."""
    import transformers

    cls_name = _TASK_CLASS.get(getattr(config, "model_type", ""))
    if cls_name is not None:
        return getattr(transformers, cls_name)
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    return cls or transformers.AutoModelForCausalLM


def supports_sdpa(config) -> bool:
    """Whether the model's attention can run torch's SDPA (Hugging Face's ``_supports_sdpa``): a
    model without it (MPT) computes its scores itself whatever the implementation asked for."""
    import transformers

    cls = task_class(config)
    if cls is transformers.AutoModelForCausalLM:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except KeyError:
            return True  # unknown here: the runtime finds out
    return bool(getattr(cls, "_supports_sdpa", True))


def model_from_config(config, device: str | torch.device = "meta", dtype: torch.dtype | None = None) -> nn.Module:
    """Instantiate the task model for ``config`` on ``device`` (weights random on a real device)."""
    import torch
    import transformers

    cls = task_class(config)
    with torch.device(device):
        if cls is transformers.AutoModelForCausalLM:
            model = cls.from_config(config)
        else:
            model = cls(config)
    if dtype is not None:
        model = model.to(dtype)
    return model


def build_model(
    name_or_path: str | os.PathLike,
    device: str | torch.device = "meta",
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build a Hugging Face model from a preset name or a local config, without downloading.

    ``overrides`` change config fields (``n_layer=6``, ``attn_implementation="eager"``). On
    ``device="meta"`` no memory is used; pass the model to :func:`slapo_tune.build` for weights.
    """
    config = load_config(name_or_path, **overrides)
    model = model_from_config(config, device=device, dtype=dtype)
    model.config.use_cache = False
    return model


_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "use_cache",
                         "architectures", "torch_dtype", "dtype", "_attn_implementation_autoset"}


def config_fingerprint(config) -> str:
    """A stable hash of the fields that define a model's architecture (for schedule files)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    data = {k: v for k, v in data.items() if k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied ones once), valid on the meta device too."""
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class ModelSpec:
    """A model to build: a preset name or config path, plus config overrides (picklable: it is
    what crosses to ranks and Ray actors instead of a model)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        return build_model(self.name, device=device, **self.overrides)

    def config(self):
        return load_config(self.name, **self.overrides)
