import json

import pytest
import torch

import slapo_tune as st
from slapo_tune.models import PRESETS, config_fingerprint, count_parameters


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny", "opt-tiny"])
def test_tiny_presets_build_on_meta_and_cpu(name):
    meta = st.build_model(name)
    assert all(p.device.type == "meta" for p in meta.parameters())
    real = st.build_model(name, device="cpu")
    assert all(p.device.type == "cpu" for p in real.parameters())
    assert count_parameters(meta) == count_parameters(real) < 1_000_000


@pytest.mark.parametrize("name,billions", [("gpt2", 0.124), ("gpt2-xl", 1.56), ("llama-7b", 6.74),
                                           ("llama-70b", 69.0), ("bert-large", 0.335), ("opt-1.3b", 1.316)])
def test_real_size_presets_have_published_sizes(name, billions):
    n = count_parameters(st.build_model(name, device="meta"))
    assert abs(n / 1e9 - billions) / billions < 0.01


def test_overrides_and_config_paths(tmp_path):
    model = st.build_model("gpt2-tiny", n_layer=6, attn_implementation="eager")
    assert model.config.n_layer == 6 and len(model.transformer.h) == 6
    assert model.config._attn_implementation == "eager"
    model.config.save_pretrained(tmp_path)
    again = st.build_model(tmp_path / "config.json")
    assert type(again) is type(model) and again.config.n_layer == 6
    assert st.build_model(tmp_path).config.n_embd == model.config.n_embd


def test_unknown_model_and_field_are_usage_errors(tmp_path):
    with pytest.raises(st.UsageError, match="unknown model 'gpt5'"):
        st.build_model("gpt5")
    with pytest.raises(st.UsageError, match="no field 'n_layerz'"):
        st.build_model("gpt2-tiny", n_layerz=3)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(st.UsageError, match="model config .*config.json is not valid JSON"):
        st.build_model(bad)


def test_fingerprint_is_stable_and_sensitive():
    a = st.build_model("gpt2-tiny").config
    b = st.build_model("gpt2-tiny").config
    c = st.build_model("gpt2-tiny", n_layer=5).config
    assert config_fingerprint(a) == config_fingerprint(b) != config_fingerprint(c)
    json.dumps(config_fingerprint(a))


def test_every_preset_builds_on_meta_quickly():
    for name in PRESETS:
        model = st.build_model(name)
        assert next(model.parameters()).device == torch.device("meta")
