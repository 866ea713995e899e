"""Llama (megakernel/models/llama.py): the presets against the published config.json files and
parameter counts, llama3 RoPE scaling as transformers 5 writes it."""

from __future__ import annotations

from typing import Any

import pytest

from megakernel.models import RopeConfig, config_from_hf_dict, family, preset, presets
from megakernel.models.llama import LlamaConfig

# Fields of the published config.json files (Hugging Face hub, meta-llama/*), written out by hand
# so that a typo in a preset shows up as a mismatch here.
PUBLISHED: dict[str, dict] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "pretraining_tp": 1,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 131072, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "pretraining_tp": 1,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
}

# Published parameter counts (model cards / safetensors metadata; tied embeddings counted once).
PUBLISHED_PARAMS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
}


def test_every_real_preset_is_checked() -> None:
    assert set(family("llama").real_presets) == set(PUBLISHED) == set(PUBLISHED_PARAMS)
    assert set(PUBLISHED) <= set(presets())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_config(name: str) -> None:
    cfg = config_from_hf_dict(PUBLISHED[name], name=name)
    assert type(cfg) is LlamaConfig
    assert cfg == preset(name)


def test_llama_3_2_1b_spelled_out() -> None:
    c = preset("llama-3.2-1b")
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        "llama", 2048, 16, 32, 8)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (
        64, 8192, 128256, True)
    assert c.rope == RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192)
    assert (c.group_size, c.q_size, c.kv_size, c.qk_norm) == (4, 2048, 512, False)
    assert not c.qkv_bias and c.attention.rotary_dim == c.head_dim


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_published(name: str) -> None:
    assert preset(name).num_parameters() == PUBLISHED_PARAMS[name]


def _llama_dict(**changes: Any) -> dict:
    d = dict(PUBLISHED["llama-3.2-1b"])
    d.update(changes)
    return {k: v for k, v in d.items() if v is not ...}


def test_transformers_5_rope_parameters_are_read() -> None:
    d = _llama_dict(rope_scaling=..., rope_theta=...)
    d["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}
    assert config_from_hf_dict(d, name="llama-3.2-1b") == preset("llama-3.2-1b")


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    d = dict(PUBLISHED["llama-3.1-8b"])
    assert "head_dim" not in d
    assert config_from_hf_dict(d).head_dim == 128


def test_llama_refuses_biases_and_sliding_windows() -> None:
    """Llama has no biases: attention_bias / mlp_bias (and a sliding window) are refused."""
    from megakernel.models import ConfigError

    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        with pytest.raises(ConfigError, match=f"unsupported config field {flag}=True"):
            config_from_hf_dict(_llama_dict(**{flag: True}))
    with pytest.raises(ConfigError, match="unsupported pretraining_tp=2"):
        config_from_hf_dict(_llama_dict(pretraining_tp=2))
