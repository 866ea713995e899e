"""Qwen2 / Qwen2.5 (megakernel/models/qwen2.py): the presets against the published config.json
files and parameter counts, transformers round trips, q/k/v biases in what save_pretrained
writes, sliding windows refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megakernel.models import (
    ConfigError,
    RopeConfig,
    config_from_hf_dict,
    config_from_hf_dir,
    family,
    preset,
    presets,
)
from megakernel.models.qwen2 import Qwen2Config
from megakernel.models.weights import expected_shapes, load_checkpoint

# Fields of the published config.json files (Hugging Face hub, Qwen/Qwen2.5-0.5B and
# Qwen/Qwen2.5-1.5B), written out by hand. They carry no head_dim (896 / 14 = 64, 1536 / 12 = 128)
# and a sliding window that use_sliding_window=false turns off.
PUBLISHED: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "intermediate_size": 4864, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": 24, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "initializer_range": 0.02, "torch_dtype": "bfloat16",
        "use_cache": True, "use_mrope": False,
    },
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "intermediate_size": 8960, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "use_sliding_window": False, "sliding_window": 131072,
        "max_window_layers": 28, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "initializer_range": 0.02, "torch_dtype": "bfloat16",
        "use_cache": True, "use_mrope": False,
    },
}

# Published parameter counts (model cards: 0.49B and 1.54B; tied embeddings counted once).
PUBLISHED_PARAMS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
}

MakeHF = Callable[..., torch.nn.Module]  # the dense_hf_model fixture


def test_every_real_preset_is_checked() -> None:
    assert set(family("qwen2").real_presets) == set(PUBLISHED) == set(PUBLISHED_PARAMS)
    assert set(PUBLISHED) <= set(presets())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_config(name: str) -> None:
    cfg = config_from_hf_dict(PUBLISHED[name], name=name)
    assert type(cfg) is Qwen2Config
    assert cfg == preset(name)
    # the same with head_dim written out (as transformers 5 and some exporters do)
    head_dim = {"qwen2.5-0.5b": 64, "qwen2.5-1.5b": 128}[name]
    assert config_from_hf_dict({**PUBLISHED[name], "head_dim": head_dim}, name=name) == cfg


def test_qwen2_5_spelled_out() -> None:
    c = preset("qwen2.5-0.5b")
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        "qwen2", 896, 24, 14, 2)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (
        64, 4864, 151936, True)
    assert c.rope == RopeConfig(1e6) and c.rms_norm_eps == 1e-6
    assert c.max_position_embeddings == 32768
    assert (c.group_size, c.q_size, c.kv_size) == (7, 896, 128)
    assert (c.qkv_bias, c.qk_norm) == (True, False)
    c = preset("qwen2.5-1.5b")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        1536, 28, 12, 2, 128)
    assert (c.intermediate_size, c.tie_word_embeddings, c.max_position_embeddings) == (
        8960, True, 131072)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_published(name: str) -> None:
    assert preset(name).num_parameters() == PUBLISHED_PARAMS[name]


def test_layout_has_qkv_biases() -> None:
    shapes = expected_shapes(preset("qwen2.5-0.5b"))
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (896,)
    assert shapes["model.layers.23.self_attn.k_proj.bias"] == (128,)
    assert shapes["model.layers.23.self_attn.v_proj.bias"] == (128,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes
    assert not any("norm" in n and "self_attn" in n for n in shapes)  # no q/k norm
    assert "lm_head.weight" not in shapes  # tied
    assert sum(n.endswith(".bias") for n in shapes) == 3 * 24


@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_round_trip_through_transformers_config(name: str, tmp_path: Path,
                                                hf_config: Callable[..., Any]) -> None:
    """to_hf_dict -> transformers' Qwen2Config -> config.json -> config_from_hf_dir gives the
    same config, and transformers reads it as we do (no sliding window, head_dim, tied)."""
    cfg = preset(name)
    hf = hf_config(cfg)
    assert type(hf).__name__ == "Qwen2Config"
    assert hf.sliding_window is None and hf.use_sliding_window is False
    assert set(hf.layer_types) == {"full_attention"} and len(hf.layer_types) == cfg.num_layers
    assert (hf.head_dim, hf.num_key_value_heads, hf.tie_word_embeddings) == (
        cfg.head_dim, cfg.num_kv_heads, cfg.tie_word_embeddings)
    hf.save_pretrained(tmp_path / name)
    assert config_from_hf_dir(tmp_path / name) == cfg.replace(name=name)


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_checkpoint_loads(tied: bool, tmp_path: Path,
                                       dense_hf_model: MakeHF) -> None:
    """A transformers Qwen2ForCausalLM saved with save_pretrained loads through load_checkpoint:
    every name, the q/k/v biases, the (tied) LM head."""
    cfg = preset("qwen2-tiny").replace(tie_word_embeddings=tied)
    model = dense_hf_model(cfg, seed=2)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    model.save_pretrained(tmp_path)
    loaded_cfg, w = load_checkpoint(tmp_path)
    assert loaded_cfg == cfg.replace(name=tmp_path.name)
    assert list(w) == list(expected_shapes(cfg))
    sd = model.state_dict()
    for name, t in w.items():
        assert torch.equal(t, sd[name]), name
    bias = w["model.layers.1.self_attn.k_proj.bias"]
    assert bias.shape == (cfg.kv_size,) and bias.abs().max() > 0  # perturbed, so really read
    assert ("lm_head.weight" in w) is not tied
    if tied:
        assert torch.equal(sd["lm_head.weight"], w["model.embed_tokens.weight"])


def test_sliding_window_and_mlp_bias_are_refused() -> None:
    d = PUBLISHED["qwen2.5-0.5b"]
    with pytest.raises(ConfigError, match="unsupported use_sliding_window=true"):
        config_from_hf_dict({**d, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="unsupported config field mlp_bias=True"):
        config_from_hf_dict({**d, "mlp_bias": True})
    with pytest.raises(ConfigError, match="'use_sliding_window' must be true or false"):
        config_from_hf_dict({**d, "use_sliding_window": "false"})


def test_attention_bias_field_does_not_change_qwen2() -> None:
    """transformers' Qwen2 always has q/k/v biases (it has no attention_bias field): exporters
    that write one, either way, describe the same model."""
    d = PUBLISHED["qwen2.5-0.5b"]
    for flag in (True, False):
        cfg = config_from_hf_dict({**d, "attention_bias": flag}, name="qwen2.5-0.5b")
        assert cfg == preset("qwen2.5-0.5b") and cfg.attention.qkv_bias
