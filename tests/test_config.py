"""ModelConfig: presets against the published configs, Hugging Face round trips, refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megakernel.config import (
    PRESETS,
    REAL_PRESETS,
    ConfigError,
    ModelConfig,
    RopeConfig,
    preset,
    resolve_model,
)

# Fields of the published config.json files (Hugging Face hub, meta-llama/* and Qwen/*), written
# out by hand so that a typo in a preset shows up as a mismatch here.
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
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-8b": 8_190_735_360,
}


def test_every_real_preset_is_checked() -> None:
    assert set(REAL_PRESETS) == set(PUBLISHED) == set(PUBLISHED_PARAMS)
    assert set(REAL_PRESETS) <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_config(name: str) -> None:
    assert ModelConfig.from_hf_dict(PUBLISHED[name], name=name) == preset(name)


def test_llama_3_2_1b_spelled_out() -> None:
    c = preset("llama-3.2-1b")
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        "llama", 2048, 16, 32, 8)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (
        64, 8192, 128256, True)
    assert c.rope == RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192)
    assert (c.group_size, c.q_size, c.kv_size, c.qk_norm) == (4, 2048, 512, False)


def test_qwen3_0_6b_spelled_out() -> None:
    c = preset("qwen3-0.6b")
    assert (c.family, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        "qwen3", 1024, 28, 16, 8)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (
        128, 3072, 151936, True)
    assert c.rope == RopeConfig(1e6) and c.rms_norm_eps == 1e-6
    # head_dim * heads != hidden: q_size is 2048 for a 1024-wide model
    assert (c.q_size, c.kv_size, c.qk_norm) == (2048, 1024, True)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_published(name: str) -> None:
    assert preset(name).num_parameters() == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_dict_round_trip(name: str) -> None:
    cfg = preset(name)
    d = json.loads(json.dumps(cfg.to_hf_dict()))  # what a config.json holds
    assert ModelConfig.from_hf_dict(d, name=name) == cfg


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "llama-3.2-1b", "qwen3-8b"])
def test_round_trip_through_transformers_config(name: str, tmp_path) -> None:
    """to_hf_dict -> transformers config -> config.json -> from_hf_dir gives the same config."""
    from transformers import LlamaConfig, Qwen3Config

    cfg = preset(name)
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[cfg.family]
    cls(**cfg.to_hf_dict()).save_pretrained(tmp_path / name)
    assert ModelConfig.from_hf_dir(tmp_path / name) == cfg


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b", "llama-tiny", "qwen3-0.6b"])
def test_inv_freq_matches_transformers(name: str) -> None:
    from transformers import LlamaConfig, Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = preset(name)
    hf = {"llama": LlamaConfig, "qwen3": Qwen3Config}[cfg.family](**cfg.to_hf_dict())
    ours = torch.tensor(cfg.rope.inv_freq(cfg.head_dim), dtype=torch.float64)
    if cfg.rope.rope_type == "default":
        want = 1.0 / cfg.rope.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)
                                        / cfg.head_dim)
    else:
        want, _ = ROPE_INIT_FUNCTIONS[cfg.rope.rope_type](hf, "cpu")
    torch.testing.assert_close(ours, want.to(torch.float64), rtol=1e-6, atol=0)
    if cfg.rope.rope_type == "llama3":  # scaling really changed something
        plain = [1.0 / cfg.rope.theta ** (2 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)]
        assert not all(math.isclose(a, b) for a, b in zip(ours.tolist(), plain, strict=True))


def _llama_dict(**changes) -> dict:
    d = dict(PUBLISHED["llama-3.2-1b"])
    d.update(changes)
    return {k: v for k, v in d.items() if v is not ...}


def test_transformers_5_rope_parameters_are_read() -> None:
    d = _llama_dict(rope_scaling=..., rope_theta=...)
    d["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}
    assert ModelConfig.from_hf_dict(d, name="llama-3.2-1b") == preset("llama-3.2-1b")


def test_model_type_is_enough_without_architectures() -> None:
    d = dict(PUBLISHED["qwen3-0.6b"])
    del d["architectures"]
    assert ModelConfig.from_hf_dict(d, name="qwen3-0.6b") == preset("qwen3-0.6b")


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    d = dict(PUBLISHED["llama-3.1-8b"])
    assert "head_dim" not in d
    assert ModelConfig.from_hf_dict(d).head_dim == 128


# ---- refusals -----------------------------------------------------------------------------------
def test_unknown_architecture_is_named() -> None:
    with pytest.raises(ConfigError, match="unsupported architecture 'MistralForCausalLM'"):
        ModelConfig.from_hf_dict(_llama_dict(architectures=["MistralForCausalLM"]))


def test_unknown_model_type_is_named() -> None:
    d = _llama_dict(architectures=..., model_type="gemma")
    with pytest.raises(ConfigError, match="unsupported model_type 'gemma'"):
        ModelConfig.from_hf_dict(d)


def test_unknown_rope_type_is_named() -> None:
    d = _llama_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf_dict(d)
    with pytest.raises(ConfigError, match="unsupported rope type 'linear'"):
        RopeConfig(rope_type="linear")


def test_incomplete_llama3_rope_is_named() -> None:
    d = _llama_dict(rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0})
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "vocab_size"]
)
def test_missing_field_is_named(field: str) -> None:
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        ModelConfig.from_hf_dict(_llama_dict(**{field: ...}))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 6}, "multiple of num_kv_heads"),
        ({"head_dim": 63}, "head_dim must be even"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ],
)
def test_unsupported_values_are_named(changes: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf_dict(_llama_dict(**changes))


def test_unknown_preset_and_spec(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown preset 'llama-99b'"):
        preset("llama-99b")
    with pytest.raises(ConfigError, match="'nowhere' is neither a preset"):
        resolve_model("nowhere")
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(preset("qwen3-tiny").to_hf_dict()))
    assert resolve_model(str(tmp_path)) == preset("qwen3-tiny").replace(name=tmp_path.name)
    assert resolve_model("llama-tiny") is PRESETS["llama-tiny"]
