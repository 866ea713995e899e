"""Qwen3 (megakernel/models/qwen3.py): the presets against the published config.json files and
parameter counts; per-head q/k norms, head_dim independent of hidden / heads."""

from __future__ import annotations

import pytest

from megakernel.models import (
    ConfigError,
    RopeConfig,
    config_from_hf_dict,
    family,
    preset,
    presets,
)
from megakernel.models.qwen3 import Qwen3Config
from megakernel.models.weights import expected_shapes

# Fields of the published config.json files (Hugging Face hub, Qwen/*), written out by hand so
# that a typo in a preset shows up as a mismatch here.
PUBLISHED: dict[str, dict] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "tie_word_embeddings": True, "max_position_embeddings": 40960, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
    },
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "tie_word_embeddings": True, "max_position_embeddings": 40960, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
        "tie_word_embeddings": False, "max_position_embeddings": 40960, "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False,
    },
}

# Published parameter counts (model cards / safetensors metadata; tied embeddings counted once).
PUBLISHED_PARAMS = {
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-8b": 8_190_735_360,
}


def test_every_real_preset_is_checked() -> None:
    assert set(family("qwen3").real_presets) == set(PUBLISHED) == set(PUBLISHED_PARAMS)
    assert set(PUBLISHED) <= set(presets())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_config(name: str) -> None:
    cfg = config_from_hf_dict(PUBLISHED[name], name=name)
    assert type(cfg) is Qwen3Config
    assert cfg == preset(name)


def test_qwen3_0_6b_spelled_out() -> None:
    c = preset("qwen3-0.6b")
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        "qwen3", 1024, 28, 16, 8)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (
        128, 3072, 151936, True)
    assert c.rope == RopeConfig(1e6) and c.rms_norm_eps == 1e-6
    # head_dim * heads != hidden: q_size is 2048 for a 1024-wide model
    assert (c.q_size, c.kv_size, c.qk_norm) == (2048, 1024, True)
    assert not c.qkv_bias


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_published(name: str) -> None:
    assert preset(name).num_parameters() == PUBLISHED_PARAMS[name]


def test_model_type_is_enough_without_architectures() -> None:
    d = dict(PUBLISHED["qwen3-0.6b"])
    del d["architectures"]
    assert config_from_hf_dict(d, name="qwen3-0.6b") == preset("qwen3-0.6b")


def test_qk_norms_are_in_the_layout() -> None:
    shapes = expected_shapes(preset("qwen3-0.6b"))
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.layers.27.self_attn.k_norm.weight"] == (128,)
    assert not any(n.endswith(".bias") for n in shapes)


def test_sliding_window_layers_are_refused() -> None:
    """transformers 5 writes `layer_types`; a sliding-window layer is not implemented."""
    d = {**PUBLISHED["qwen3-0.6b"], "layer_types": ["full_attention"] * 27 + ["sliding_attention"]}
    with pytest.raises(ConfigError, match="layer 27: unsupported layer type 'sliding_attention'"):
        config_from_hf_dict(d)
    d["layer_types"] = ["full_attention"] * 28
    assert config_from_hf_dict(d, name="qwen3-0.6b") == preset("qwen3-0.6b")
    with pytest.raises(ConfigError, match="use_sliding_window"):
        config_from_hf_dict({**PUBLISHED["qwen3-0.6b"], "use_sliding_window": True})
