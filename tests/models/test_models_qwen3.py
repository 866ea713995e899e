"""Qwen3 (megakernel/models/qwen3.py): dispatch on model_type alone, per-head q/k norms (head_dim
independent of hidden / heads), all-full-attention layer types. The published configs, parameter
counts and refusals: test_models_families.py."""

from __future__ import annotations

import json
from pathlib import Path

from megakernel.models import config_from_hf_dict, preset
from megakernel.models.weights import expected_shapes

QWEN3_06B = json.loads((Path(__file__).parent / "published/qwen3-0.6b/config.json").read_text())


def test_model_type_is_enough_without_architectures() -> None:
    d = dict(QWEN3_06B)
    del d["architectures"]
    assert config_from_hf_dict(d, name="qwen3-0.6b") == preset("qwen3-0.6b")


def test_qk_norms_are_in_the_layout() -> None:
    shapes = expected_shapes(preset("qwen3-0.6b"))
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert shapes["model.layers.27.self_attn.k_norm.weight"] == (128,)
    assert not any(n.endswith(".bias") for n in shapes)


def test_full_attention_layer_types_are_accepted() -> None:
    """transformers 5 writes `layer_types`: all full attention is the preset (a sliding-window
    layer is refused: test_models_families.py)."""
    d = {**QWEN3_06B, "layer_types": ["full_attention"] * 28}
    assert config_from_hf_dict(d, name="qwen3-0.6b") == preset("qwen3-0.6b")
