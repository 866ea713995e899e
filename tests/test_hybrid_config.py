"""Hybrid configs: published config.json files parse to the presets, transformers reads our
`to_hf_dict` the same way we do, and unsupported layer types / fields are refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megakernel.config import ConfigError
from megakernel.hybrid.config import (
    PRESETS,
    REAL_PRESETS,
    KimiLinearConfig,
    NemotronHConfig,
    Qwen35Config,
    config_from_hf_dict,
    config_from_hf_dir,
    preset,
    resolve_hybrid,
)
from megakernel.hybrid.weights import expected_shapes

TINY = ["qwen3.5-tiny", "kimi-linear-tiny", "nemotron-h-tiny"]

# Fields of the published config.json files (trimmed to what the models read).
QWEN35_08B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024,
        "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "attention_bias": False,
        "attn_output_gate": True, "rms_norm_eps": 1e-6, "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # x 6, filled below
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
QWEN35_08B["text_config"]["layer_types"] = QWEN35_08B["text_config"]["layer_types"] * 6

KIMI_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 163840, "hidden_size": 2304, "head_dim": 72, "intermediate_size": 9216,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "model_max_length": 1048576,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "mla_use_nope": True,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32, "short_conv_kernel_size": 4},
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "moe_intermediate_size": 1024, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "routed_scaling_factor": 2.446, "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
}

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


def named(cfg, name: str):
    return cfg.replace(name=name)


@pytest.mark.parametrize(("data", "name"), [(QWEN35_08B, "qwen3.5-0.8b"),
                                            (KIMI_48B, "kimi-linear-48b-a3b"),
                                            (NEMOTRON_H_8B, "nemotron-h-8b")])
def test_published_configs_match_presets(data, name: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(data))
    cfg = config_from_hf_dir(tmp_path)
    assert named(cfg, name) == preset(name)
    assert resolve_hybrid(str(tmp_path)) == cfg


def test_real_preset_sizes() -> None:
    """Parameter counts from the shapes: catches a wrong field in a preset."""
    def count(name: str, experts_only: bool = False) -> float:
        return sum(math.prod(s) for n, s in expected_shapes(preset(name)).items()
                   if not experts_only or ".experts." in n) / 1e9

    assert 0.70 < count("qwen3.5-0.8b") < 0.80  # the text decoder (vision tower excluded)
    assert 8.8 < count("qwen3.5-9b") < 9.1
    assert 48.5 < count("kimi-linear-48b-a3b") < 49.5
    total, experts = count("kimi-linear-48b-a3b"), count("kimi-linear-48b-a3b", True)
    assert 3.0 < total - experts + experts * 8 / 256 < 4.0  # "A3B": about 3B active
    assert 8.0 < count("nemotron-h-8b") < 8.2
    for name in REAL_PRESETS:
        assert preset(name).name == name


@pytest.mark.parametrize("name", TINY + list(REAL_PRESETS))
def test_transformers_reads_our_config_alike(name: str) -> None:
    """to_hf_dict -> transformers config -> its to_dict -> our parser gives the same config, and
    transformers' own reading (layer types, MoE routing fields) agrees with ours."""
    import transformers

    cfg = preset(name)
    cls = {Qwen35Config: transformers.Qwen3_5TextConfig,
           KimiLinearConfig: transformers.KimiLinearConfig,
           NemotronHConfig: transformers.NemotronHConfig}[type(cfg)]
    hf = cls(**cfg.to_hf_dict())
    assert named(config_from_hf_dict(hf.to_dict()), name) == cfg
    hf_types = list(getattr(hf, "layers_block_type", None) or hf.layer_types)
    ours = {"gdn": "linear_attention", "kda": "linear_attention", "mamba2": "linear_attention",
            "attention": "full_attention", "mla": "full_attention", "mlp": "mlp"}
    assert hf_types == [ours[t] for t in cfg.layer_types]
    if isinstance(cfg, KimiLinearConfig):
        assert hf.mlp_layer_types == ["dense" if cfg.ffn_type(i) == "mlp" else "sparse"
                                      for i in range(cfg.num_layers)]
        e = cfg.moe
        assert (hf.num_local_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group) == (
            e.num_experts, e.top_k, e.n_group, e.topk_group)
        assert hf.moe_intermediate_size == e.intermediate_size
        assert hf.routed_scaling_factor == e.routed_scaling_factor
    if isinstance(cfg, Qwen35Config):
        a = cfg.attention
        assert int(a.head_dim * hf.rope_parameters["partial_rotary_factor"]) == a.rotary_dim


def test_presets_are_consistent() -> None:
    for name, cfg in PRESETS.items():
        assert cfg.name == name
        assert expected_shapes(cfg)
    with pytest.raises(ConfigError, match=r"unknown hybrid preset 'qwen3.5-1t'"):
        preset("qwen3.5-1t")
    with pytest.raises(ConfigError, match=r"neither a hybrid preset"):
        resolve_hybrid("no-such-model")


# ---- refusals ------------------------------------------------------------------------------------
def _kimi(**changes):
    return {**KIMI_48B, **changes}


@pytest.mark.parametrize(("data", "message"), [
    ({**NEMOTRON_H_8B, "hybrid_override_pattern": "MEM*E"},
     r"layer 1: unsupported layer type 'moe' \(Nemotron-H MoE blocks are not implemented\)"),
    ({**NEMOTRON_H_8B, "hybrid_override_pattern": "M-X*"},
     r"unknown hybrid_override_pattern symbols \['X'\]"),
    ({**NEMOTRON_H_8B, "mlp_hidden_act": "silu"}, r"unsupported mlp_hidden_act 'silu'"),
    ({**NEMOTRON_H_8B, "mlp_bias": True}, r"unsupported config field mlp_bias=True"),
    ({**NEMOTRON_H_8B, "tie_word_embeddings": True}, r"tie_word_embeddings=true"),
    (_kimi(mla_use_nope=False), r"unsupported mla_use_nope=false"),
    (_kimi(moe_router_activation_func="softmax"),
     r"unsupported moe_router_activation_func 'softmax'"),
    (_kimi(hidden_act="gelu"), r"unsupported config field hidden_act='gelu'"),
    (_kimi(num_key_value_heads=8), r"MLA needs num_key_value_heads == num_attention_heads"),
    (_kimi(linear_attn_config={**KIMI_48B["linear_attn_config"], "gate_lower_bound": -5.0}),
     r"unsupported linear_attn_config fields: gate_lower_bound"),
    (_kimi(linear_attn_config={**KIMI_48B["linear_attn_config"], "full_attn_layers": [4, 28]}),
     r"full_attn_layers entry 28 is not a layer in 1..27"),
    (_kimi(num_expert_group=3), r"num_experts \(256\) must be a multiple of n_group \(3\)"),
    (_kimi(layer_types=["sliding_attention"] * 27),
     r"layer 0: unsupported layer type 'sliding_attention'; supported: linear_attention, "
     r"full_attention"),
    ({"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe"},
     r"unsupported architecture 'Qwen3_5MoeForCausalLM'"),
    ({"model_type": "mamba2"}, r"unsupported model_type 'mamba2'"),
    ({**QWEN35_08B["text_config"], "num_experts": 256},
     r"Qwen3.5 MoE text models are not supported"),
    ({**QWEN35_08B["text_config"], "attn_output_gate": False},
     r"unsupported attn_output_gate=false"),
    ({**QWEN35_08B["text_config"], "linear_num_value_heads": 24},
     r"linear_num_value_heads \(24\) must be a multiple of linear_num_key_heads \(16\)"),
    ({**QWEN35_08B["text_config"], "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     r"unsupported rope type 'yarn' for Qwen3.5"),
    ({k: v for k, v in QWEN35_08B["text_config"].items() if k != "hidden_size"},
     r"config is missing required field 'hidden_size'"),
])
def test_unsupported_configs_are_refused(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_hf_dict(data)


def test_layer_type_outside_family_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"layer 1: unsupported layer type 'mamba2' for qwen3_5"):
        preset("qwen3.5-tiny").replace(layer_types=("gdn", "mamba2", "attention", "gdn"))
