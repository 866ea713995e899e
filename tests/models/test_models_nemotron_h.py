"""Nemotron-H (megakernel/models/nemotron_h.py): the published config.json parses to the preset,
refusals (MoE blocks, tied embeddings), checkpoints under `backbone.` or transformers' `model.`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megakernel.layers.attention import AttentionConfig
from megakernel.models import (
    ConfigError,
    config_from_hf_dict,
    config_from_hf_dir,
    family,
    preset,
    resolve,
)
from megakernel.models.nemotron_h import NemotronHConfig
from megakernel.models.weights import (
    expected_shapes,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)

# Fields of the published config.json (nvidia/Nemotron-H-8B-Base-8K).
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "hidden_size": 4096, "num_hidden_layers": 52, "num_attention_heads": 32,
    "num_key_value_heads": 8, "attention_head_dim": 128, "intermediate_size": 21504,
    "mlp_hidden_act": "relu2", "mamba_num_heads": 128, "mamba_head_dim": 64,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2, "use_conv_bias": True,
    "mamba_hidden_act": "silu", "time_step_min": 0.001, "time_step_max": 0.1,
    "layer_norm_epsilon": 1e-05, "residual_in_fp32": True, "tie_word_embeddings": False,
    "use_bias": False, "mlp_bias": False, "attention_bias": False, "vocab_size": 131072,
    "max_position_embeddings": 8192,
}


def test_real_presets() -> None:
    assert family("nemotron_h").real_presets == ("nemotron-h-8b",)


def test_published_config_matches_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(NEMOTRON_H_8B))
    cfg = config_from_hf_dir(tmp_path)
    assert type(cfg) is NemotronHConfig
    assert cfg.replace(name="nemotron-h-8b") == preset("nemotron-h-8b")
    assert resolve(str(tmp_path)) == cfg


def test_real_preset_size() -> None:
    count = sum(math.prod(s) for s in expected_shapes(preset("nemotron-h-8b")).values()) / 1e9
    assert 8.0 < count < 8.2


def test_tiny_preset_spelled_out() -> None:
    """The tiny preset: one block per layer, attention without RoPE at head_dim 64."""
    c = preset("nemotron-h-tiny")
    assert c.layer_types == ("mamba2", "mlp", "attention", "mamba2", "mlp")
    assert [b.kind for b in c.blocks] == ["mamba2", "relu2", "attention", "mamba2", "relu2"]
    assert c.attention == AttentionConfig(4, 2, 64)
    assert c.embed_name == "backbone.embeddings.weight"
    assert c.final_norm_name == "backbone.norm_f.weight"


@pytest.mark.parametrize(("data", "message"), [
    ({**NEMOTRON_H_8B, "hybrid_override_pattern": "MEM*E"},
     r"layer 1: unsupported layer type 'moe' \(Nemotron-H MoE blocks are not implemented\)"),
    ({**NEMOTRON_H_8B, "hybrid_override_pattern": "M-X*"},
     r"unknown hybrid_override_pattern symbols \['X'\]"),
    ({**NEMOTRON_H_8B, "mlp_hidden_act": "silu"}, r"unsupported mlp_hidden_act 'silu'"),
    ({**NEMOTRON_H_8B, "mlp_bias": True}, r"unsupported config field mlp_bias=True"),
    ({**NEMOTRON_H_8B, "tie_word_embeddings": True}, r"tie_word_embeddings=true"),
    ({**NEMOTRON_H_8B, "mamba_hidden_act": "gelu"}, r"unsupported mamba_hidden_act 'gelu'"),
    ({**NEMOTRON_H_8B, "sliding_window": 4096}, r"unsupported sliding_window=4096"),
    ({**NEMOTRON_H_8B, "num_hidden_layers": 50},
     r"num_hidden_layers = 50 but the layer pattern has 52 layers"),
    ({k: v for k, v in NEMOTRON_H_8B.items() if k != "hybrid_override_pattern"},
     r"neither layers_block_type nor hybrid_override_pattern"),
])
def test_unsupported_configs_are_refused(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_hf_dict(data)


def test_legacy_layer_type_names() -> None:
    """Older configs spell the layer types "mamba" and "attention"."""
    d = {k: v for k, v in preset("nemotron-h-tiny").to_hf_dict().items()
         if k != "layers_block_type"}
    d["layers_block_type"] = ["mamba", "mlp", "attention", "mamba", "mlp"]
    assert config_from_hf_dict(d, name="nemotron-h-tiny") == preset("nemotron-h-tiny")


def test_transformers_model_prefix(tmp_path: Path) -> None:
    """Nemotron-H under transformers' `model.` names loads as `backbone.`."""
    cfg = preset("nemotron-h-tiny")
    weights = random_weights(cfg, seed=4, dtype=torch.float32)
    path = save_checkpoint(cfg, weights, tmp_path / "nemo")
    save_file({n.replace("backbone.", "model.", 1): t for n, t in weights.items()},
              str(path / "model.safetensors"))
    _, loaded = load_checkpoint(path)
    assert all(torch.equal(loaded[n], weights[n]) for n in weights)
    c = NemotronHConfig.canonical_name
    assert c("model.layers.0.mixer.A_log") == "backbone.layers.0.mixer.A_log"
    assert c("mtp.layers.0.norm.weight") is None
