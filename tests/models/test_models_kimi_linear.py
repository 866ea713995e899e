"""Kimi Linear (megakernel/models/kimi_linear.py): the published config.json parses to the
preset, transformers reads the MoE routing as we do, refusals, dense-MLP checkpoint names."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megakernel.models import (
    ConfigError,
    config_from_hf_dict,
    config_from_hf_dir,
    family,
    preset,
    resolve,
)
from megakernel.models.kimi_linear import KimiLinearConfig
from megakernel.models.weights import (
    expected_shapes,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)

# Fields of the published config.json (moonshotai/Kimi-Linear-48B-A3B-Instruct).
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


def test_real_presets() -> None:
    assert family("kimi_linear").real_presets == ("kimi-linear-48b-a3b",)


def test_published_config_matches_preset(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(KIMI_48B))
    cfg = config_from_hf_dir(tmp_path)
    assert type(cfg) is KimiLinearConfig
    assert cfg.replace(name="kimi-linear-48b-a3b") == preset("kimi-linear-48b-a3b")
    assert resolve(str(tmp_path)) == cfg


def test_real_preset_size() -> None:
    """Parameter counts from the shapes: 48B in all, about 3B active ("A3B")."""
    def count(experts_only: bool = False) -> float:
        return sum(math.prod(s) for n, s in expected_shapes(preset("kimi-linear-48b-a3b")).items()
                   if not experts_only or ".experts." in n) / 1e9

    assert 48.5 < count() < 49.5
    total, experts = count(), count(experts_only=True)
    assert 3.0 < total - experts + experts * 8 / 256 < 4.0


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "kimi-linear-48b-a3b"])
def test_transformers_reads_moe_routing_alike(name: str, hf_config: Callable[..., Any]) -> None:
    cfg = preset(name)
    hf = hf_config(cfg)
    ffn = [b.kind for b in cfg.blocks if b.name == "ffn"]
    assert hf.mlp_layer_types == ["dense" if k == "swiglu" else "sparse" for k in ffn]
    assert hf.mlp_layer_types == ["dense" if cfg.ffn_type(i) == "swiglu" else "sparse"
                                  for i in range(cfg.num_layers)]
    e = cfg.moe
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group) == (
        e.num_experts, e.top_k, e.n_group, e.topk_group)
    assert hf.moe_intermediate_size == e.intermediate_size
    assert hf.routed_scaling_factor == e.routed_scaling_factor


def _kimi(**changes: Any) -> dict:
    return {**KIMI_48B, **changes}


@pytest.mark.parametrize(("data", "message"), [
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
    (_kimi(moe_layer_freq=2), r"unsupported moe_layer_freq=2"),
    (_kimi(num_nextn_predict_layers=1), r"num_nextn_predict_layers > 0"),
    (_kimi(first_k_dense_replace=None, mlp_layer_types=["dense", "sparse", "dense"]),
     r"unsupported mlp_layer_types"),
    ({k: v for k, v in KIMI_48B.items() if k != "num_hidden_layers"},
     r"config is missing required field 'num_hidden_layers'"),
])
def test_unsupported_configs_are_refused(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_hf_dict(data)


def test_dense_mlp_under_both_names(tmp_path: Path) -> None:
    """Kimi's dense MLP layers load under `mlp.` (ours) and `block_sparse_moe.` (what
    save_pretrained writes)."""
    kimi = preset("kimi-linear-tiny")
    kw = random_weights(kimi, seed=4, dtype=torch.float32)
    assert "model.layers.0.mlp.gate_proj.weight" in kw
    _, loaded = load_checkpoint(save_checkpoint(kimi, kw, tmp_path / "kimi"))
    assert all(torch.equal(loaded[n], kw[n]) for n in kw)
    moe_named = {n.replace(".0.mlp.", ".0.block_sparse_moe."): t for n, t in kw.items()}
    assert "model.layers.0.block_sparse_moe.up_proj.weight" in moe_named
    _, loaded = load_checkpoint(save_checkpoint(kimi, moe_named, tmp_path / "moe"))
    assert all(torch.equal(loaded[n], kw[n]) for n in kw)
    c = KimiLinearConfig.canonical_name
    assert c("model.layers.1.block_sparse_moe.shared_experts.up_proj.weight") == (
        "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight")
