"""What the dense families share (megakernel/models/dense.py): Hugging Face round trips through
transformers, required fields, refusals of values megakernel does not implement."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megakernel.models import ConfigError, config_from_hf_dict, config_from_hf_dir, family, preset
from megakernel.models.dense import DenseConfig
from tests.registries import DENSE_FAMILIES

DENSE = [family(f).real_presets[0] for f in DENSE_FAMILIES]  # one published config per family


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "llama-3.2-1b", "qwen3-8b",
                                  "llama-mid", "qwen3-1.7b"])
def test_round_trip_through_transformers_config(name: str, tmp_path: Path,
                                                hf_config: Callable[..., Any]) -> None:
    """to_hf_dict -> transformers config -> config.json -> config_from_hf_dir gives the same
    config."""
    cfg = preset(name)
    hf_config(cfg).save_pretrained(tmp_path / name)
    assert config_from_hf_dir(tmp_path / name) == cfg.replace(name=name)


def _dict(base: str, **changes: Any) -> dict:
    d = {**preset(base).to_hf_dict(), **changes}
    return {k: v for k, v in d.items() if v is not ...}


@pytest.mark.parametrize("base", DENSE)
@pytest.mark.parametrize(
    "field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
              "vocab_size"]
)
def test_missing_field_is_named(base: str, field: str) -> None:
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        config_from_hf_dict(_dict(base, **{field: ...}))


@pytest.mark.parametrize("base", DENSE)
@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 6}, "multiple of num_kv_heads"),
        ({"head_dim": 63}, "head_dim must be even"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads must be positive"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for"),
    ],
)
def test_unsupported_values_are_named(base: str, changes: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        config_from_hf_dict(_dict(base, **changes))


@pytest.mark.parametrize("base", ["llama-3.2-1b", "qwen3-0.6b"])
@pytest.mark.parametrize("flag", ["attention_bias", "use_sliding_window"])
def test_biases_and_sliding_windows_are_refused(base: str, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        config_from_hf_dict(_dict(base, **{flag: True}))


@pytest.mark.parametrize("base", DENSE)
def test_dense_attention_is_whole_head_rope(base: str) -> None:
    """The dense families rotate every dimension of a head (rotary_dim = head_dim)."""
    cfg = preset(base)
    assert isinstance(cfg, DenseConfig)
    a = cfg.attention
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope) == (
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, cfg.rope)
    assert (a.qk_norm, a.qkv_bias, a.output_gate) == (cfg.qk_norm, cfg.qkv_bias, False)
