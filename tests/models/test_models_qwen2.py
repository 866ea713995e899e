"""Qwen2 / Qwen2.5 (megakernel/models/qwen2.py): head_dim written out or not, transformers round
trips, q/k/v biases in what save_pretrained writes, the attention_bias field. The published
configs, parameter counts and refusals (sliding windows, mlp_bias): test_models_families.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megakernel.models import config_from_hf_dict, config_from_hf_dir, preset
from megakernel.models.weights import expected_shapes, load_checkpoint

PUBLISHED = Path(__file__).with_name("published")
QWEN25_05B = json.loads((PUBLISHED / "qwen2.5-0.5b/config.json").read_text())

MakeHF = Callable[..., torch.nn.Module]  # the dense_hf_model fixture


@pytest.mark.parametrize(("name", "head_dim"), [("qwen2.5-0.5b", 64), ("qwen2.5-1.5b", 128)])
def test_head_dim_written_out_changes_nothing(name: str, head_dim: int) -> None:
    """The published configs carry no head_dim (896 / 14 = 64, 1536 / 12 = 128; and a sliding
    window that use_sliding_window=false turns off): the same with head_dim written out, as
    transformers 5 and some exporters do."""
    d = json.loads((PUBLISHED / name / "config.json").read_text())
    assert "head_dim" not in d
    assert config_from_hf_dict({**d, "head_dim": head_dim}, name=name) == preset(name)


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


def test_attention_bias_field_does_not_change_qwen2() -> None:
    """transformers' Qwen2 always has q/k/v biases (it has no attention_bias field): exporters
    that write one, either way, describe the same model."""
    d = QWEN25_05B
    for flag in (True, False):
        cfg = config_from_hf_dict({**d, "attention_bias": flag}, name="qwen2.5-0.5b")
        assert cfg == preset("qwen2.5-0.5b") and cfg.attention.qkv_bias
