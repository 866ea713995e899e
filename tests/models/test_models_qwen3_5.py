"""Qwen3.5 (megakernel/models/qwen3_5.py): the published multimodal config.json parses to the
preset, partial RoPE as transformers reads it, refusals, and the published checkpoint layout
(`model.language_model.` prefix, vision tower and MTP head skipped, sharded)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from megakernel.layers.attention import AttentionConfig
from megakernel.models import (
    ConfigError,
    RopeConfig,
    config_from_hf_dict,
    config_from_hf_dir,
    family,
    preset,
    resolve,
)
from megakernel.models.qwen3_5 import Qwen35Config
from megakernel.models.weights import expected_shapes, load_checkpoint, random_weights

# Fields of the published config.json (Qwen/Qwen3.5-0.8B, trimmed to what the models read).
QWEN35_08B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024,
        "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "attention_bias": False,
        "attn_output_gate": True, "rms_norm_eps": 1e-6, "full_attention_interval": 4,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "max_position_embeddings": 262144, "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1, "tie_word_embeddings": True,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
    },
    "vision_config": {"model_type": "qwen3_5_vision", "depth": 12, "hidden_size": 768},
}
TEXT = QWEN35_08B["text_config"]


def test_real_presets() -> None:
    assert family("qwen3_5").real_presets == ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b",
                                              "qwen3.5-9b")


def test_published_config_matches_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN35_08B))
    cfg = config_from_hf_dir(tmp_path)
    assert type(cfg) is Qwen35Config
    assert cfg.replace(name="qwen3.5-0.8b") == preset("qwen3.5-0.8b")
    assert resolve(str(tmp_path)) == cfg
    # the text model alone (qwen3_5_text), as Qwen3_5ForCausalLM checkpoints write it
    text = {**TEXT, "architectures": ["Qwen3_5ForCausalLM"]}
    assert config_from_hf_dict(text, name="qwen3.5-0.8b") == preset("qwen3.5-0.8b")


def test_real_preset_sizes() -> None:
    """Parameter counts from the shapes: catches a wrong field in a preset."""
    def count(name: str) -> float:
        return sum(math.prod(s) for s in expected_shapes(preset(name)).values()) / 1e9

    assert 0.70 < count("qwen3.5-0.8b") < 0.80  # the text decoder (vision tower excluded)
    assert 8.8 < count("qwen3.5-9b") < 9.1


def test_tiny_preset_spelled_out() -> None:
    """The tiny preset's attention has head_dim 64 (a supported one) with 16 rotary dims."""
    c = preset("qwen3.5-tiny")
    assert c.layer_types == ("gdn", "gdn", "attention", "gdn")
    assert c.attention == AttentionConfig(4, 2, 64, 16, RopeConfig(1e6), True, True)
    assert c.norm_kind == "rms_1p" and c.ffn_type(0) == "swiglu"
    assert [b.kind for b in c.blocks] == ["gdn", "swiglu"] * 2 + ["attention", "swiglu",
                                                                  "gdn", "swiglu"]


@pytest.mark.parametrize("name", sorted(family("qwen3_5").presets()))
def test_transformers_reads_partial_rope_alike(name: str, hf_config: Callable[..., Any]) -> None:
    cfg = preset(name)
    hf = hf_config(cfg)
    a = cfg.attention
    assert int(a.head_dim * hf.rope_parameters["partial_rotary_factor"]) == a.rotary_dim
    assert hf.rope_parameters["rope_theta"] == a.rope.theta


@pytest.mark.parametrize(("data", "message"), [
    ({**TEXT, "num_experts": 256}, r"Qwen3.5 MoE text models are not supported"),
    ({**TEXT, "attn_output_gate": False}, r"unsupported attn_output_gate=false"),
    ({**TEXT, "linear_num_value_heads": 24},
     r"linear_num_value_heads \(24\) must be a multiple of linear_num_key_heads \(16\)"),
    ({**TEXT, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     r"unsupported rope type 'yarn' for Qwen3.5"),
    ({k: v for k, v in TEXT.items() if k != "hidden_size"},
     r"config is missing required field 'hidden_size'"),
    ({**QWEN35_08B, "text_config": {**TEXT, "model_type": "qwen3_5_moe_text"}},
     r"unsupported Qwen3.5 text model_type 'qwen3_5_moe_text'"),
    ({**QWEN35_08B, "text_config": None}, r"qwen3_5 config has no text_config"),
    ({**TEXT, "layer_types": ["linear_attention"] * 23 + ["sliding_attention"]},
     r"layer 23: unsupported layer type 'sliding_attention'"),
])
def test_unsupported_configs_are_refused(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_hf_dict(data)


def test_multimodal_checkpoint_layout(tmp_path: Path) -> None:
    """Published Qwen3.5 checkpoints: nested text_config, `model.language_model.` prefix, vision
    tower and MTP head present (skipped), two shards with an index."""
    cfg = preset("qwen3.5-tiny")
    weights = random_weights(cfg, seed=3, dtype=torch.bfloat16)
    renamed = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n:
               t for n, t in weights.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for fname, part in shards.items():
        save_file({n: renamed[n] for n in part}, str(tmp_path / fname))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    text = cfg.to_hf_dict()
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": False, "text_config": {**text, "architectures": None},
           "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(top))
    loaded_cfg, loaded = load_checkpoint(tmp_path)
    assert loaded_cfg.replace(name="qwen3.5-tiny") == cfg
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[n], weights[n]) for n in weights)
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())


def test_canonical_names() -> None:
    c = Qwen35Config.canonical_name
    assert c("model.language_model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight")
    assert c("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert c("lm_head.weight") == "lm_head.weight"
    for skipped in ("model.visual.merger.weight", "mtp.fc.weight", "model.mtp.norm.weight",
                    "model.rotary_emb.inv_freq"):
        assert c(skipped) is None
