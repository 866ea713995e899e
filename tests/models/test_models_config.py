"""What every family shares (megakernel/models/config.py and `validate`): RoPE, the parsing of
config.json fields (types checked, the field named), residual blocks, and the one check of what
megakernel supports."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from megakernel.models import (
    ConfigError,
    ModelConfig,
    RopeConfig,
    config_from_hf_dict,
    preset,
    presets,
    validate,
)
from megakernel.models.weights import expected_shapes
from tests.registries import ALL_TINY


# ---- RoPE ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b", "llama-tiny", "qwen3-0.6b",
                                  "qwen2.5-0.5b"])
def test_inv_freq_matches_transformers(name: str, hf_config: Callable[..., Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = preset(name)
    hf = hf_config(cfg)
    ours = torch.tensor(cfg.rope.inv_freq(cfg.head_dim), dtype=torch.float64)
    if cfg.rope.rope_type == "default":
        want = 1.0 / cfg.rope.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)
                                        / cfg.head_dim)
    else:
        want, _ = ROPE_INIT_FUNCTIONS[cfg.rope.rope_type](hf, "cpu")
    torch.testing.assert_close(ours, want.to(torch.float64), rtol=1e-6, atol=0)
    assert cfg.attention.inv_freq() == cfg.rope.inv_freq(cfg.head_dim)  # what the layers use
    if cfg.rope.rope_type == "llama3":  # scaling really changed something
        plain = [1.0 / cfg.rope.theta ** (2 * i / cfg.head_dim) for i in range(cfg.head_dim // 2)]
        assert not all(math.isclose(a, b) for a, b in zip(ours.tolist(), plain, strict=True))


def _rope_dict(**rope_scaling: Any) -> dict:
    """llama-3.2-1b's config.json with `rope_scaling` as given (no rope_parameters)."""
    d = {k: v for k, v in preset("llama-3.2-1b").to_hf_dict().items() if k != "rope_parameters"}
    return {**d, "rope_scaling": rope_scaling}


def test_unknown_rope_type_is_named() -> None:
    with pytest.raises(ConfigError, match="unsupported rope type 'yarn'"):
        config_from_hf_dict(_rope_dict(rope_type="yarn", factor=4.0))
    d = {**preset("qwen3-tiny").to_hf_dict(), "rope_parameters": {"rope_type": "dynamic"}}
    with pytest.raises(ConfigError, match="unsupported rope type 'dynamic'"):
        config_from_hf_dict(d)
    with pytest.raises(ConfigError, match="unsupported rope type 'linear'"):
        RopeConfig(rope_type="linear")


def test_incomplete_llama3_rope_is_named() -> None:
    d = _rope_dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        config_from_hf_dict(d)
    with pytest.raises(ConfigError, match="high_freq_factor > low_freq_factor"):
        RopeConfig(5e5, "llama3", 8.0, 4.0, 4.0, 8192)
    with pytest.raises(ConfigError, match="rope theta must be positive"):
        RopeConfig(0.0)


def test_rope_scaling_and_rope_parameters_agree() -> None:
    """Old-style rope_scaling + rope_theta and transformers-5 rope_parameters give one config."""
    cfg = preset("llama-3.2-1b")
    r = cfg.rope
    old = _rope_dict(rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
                     high_freq_factor=r.high_freq_factor,
                     original_max_position_embeddings=r.original_max_position_embeddings)
    assert config_from_hf_dict(old, name=cfg.name) == cfg


# ---- config.json fields of the wrong type -------------------------------------------------------
def _leaves(d: dict, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, value) of every number, bool and number-list entry of a config dict."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*path, k))
        elif isinstance(v, bool | int | float):
            yield (*path, k), v
        elif isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            yield (*path, k, 0), v[0]


def _with(d: dict, path: tuple, value: Any) -> dict:
    """A deep copy of `d` with the entry at `path` set to `value`."""
    out = copy.deepcopy(d)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize("name", sorted(presets()))
def test_wrong_type_fields_are_named(name: str) -> None:
    """Every number or flag that `to_hf_dict` writes, replaced by a string, is refused with a
    ConfigError naming the field (not a ValueError from int(), not a string read as true)."""
    d = preset(name).to_hf_dict()
    silent, leaves = [], list(_leaves(d))
    assert len(leaves) >= 10
    for path, value in leaves:
        key = next(p for p in reversed(path) if isinstance(p, str))
        bad = "yes" if isinstance(value, bool) else "two"
        try:
            config_from_hf_dict(_with(d, path, bad))
        except ConfigError as e:
            if not re.search(rf"(?<![a-z_]){re.escape(key)}(?![a-z_])", str(e)):
                silent.append(f"{path}: {e}")
        else:
            silent.append(f"{path}: accepted {bad!r}")
    assert not silent, silent


def test_wrong_type_example() -> None:
    d = {**preset("llama-3.2-1b").to_hf_dict(), "num_hidden_layers": "two"}
    with pytest.raises(ConfigError, match="config field 'num_hidden_layers' must be an integer, "
                                          "got 'two'"):
        config_from_hf_dict(d)
    d = {**preset("qwen3-tiny").to_hf_dict(), "tie_word_embeddings": "false"}
    with pytest.raises(ConfigError, match="'tie_word_embeddings' must be true or false"):
        config_from_hf_dict(d)
    d = {**preset("llama-tiny").to_hf_dict(), "rms_norm_eps": float("nan")}
    with pytest.raises(ConfigError, match="'rms_norm_eps' must be a finite number"):
        config_from_hf_dict(d)
    assert config_from_hf_dict({**preset("llama-tiny").to_hf_dict(),
                                "num_hidden_layers": 2.0}).num_layers == 2  # 2.0 is 2


def test_model_config_fields_are_checked() -> None:
    cfg = preset("llama-tiny")
    for changes, needle in [({"vocab_size": 0}, "vocab_size must be a positive integer"),
                            ({"hidden_size": True}, "hidden_size must be a positive integer"),
                            ({"rms_norm_eps": 0.0}, "rms_norm_eps must be positive"),
                            ({"tie_word_embeddings": 1}, "tie_word_embeddings must be a bool"),
                            ({"num_layers": 0}, "num_layers must be a positive integer")]:
        with pytest.raises(ConfigError, match=needle):
            cfg.replace(**changes)


# ---- blocks -------------------------------------------------------------------------------------
def test_blocks_of_a_dense_and_a_hybrid_model() -> None:
    cfg = preset("llama-tiny")
    assert [(b.key, b.kind) for b in cfg.blocks] == [
        ("L0.attn", "attention"), ("L0.mlp", "swiglu"), ("L1.attn", "attention"),
        ("L1.mlp", "swiglu")]
    b = cfg.blocks[1]
    assert (b.prefix, b.norm) == ("model.layers.0.mlp.",
                                  "model.layers.0.post_attention_layernorm.weight")
    assert cfg.kind_config("attention") == cfg.attention and not cfg.recurrent_layers()
    assert cfg.has_kind("swiglu") and not cfg.has_kind("moe")
    with pytest.raises(ConfigError, match="0 distinct 'gdn' layer configs"):
        cfg.kind_config("gdn")
    kimi = preset("kimi-linear-tiny")
    assert [b.kind for b in kimi.blocks] == ["kda", "swiglu", "mla", "moe", "kda", "moe"]
    assert kimi.recurrent_layers() == [0, 2]
    assert kimi.kind_config("moe") is kimi.moe
    nemo = preset("nemotron-h-tiny")
    assert [b.key for b in nemo.blocks] == [f"L{i}.mixer" for i in range(5)]
    assert nemo.recurrent_layers() == [0, 3]


@pytest.mark.parametrize("name", sorted(presets()))
def test_num_parameters_is_the_sum_of_the_shapes(name: str) -> None:
    cfg = preset(name)
    assert cfg.num_parameters() == sum(math.prod(s) for s in expected_shapes(cfg).values())
    assert (cfg.lm_head_name in expected_shapes(cfg)) is not cfg.tie_word_embeddings


# ---- validate: what megakernel supports ---------------------------------------------------------
@pytest.mark.parametrize("name", sorted(presets()))
def test_every_preset_is_supported(name: str) -> None:
    assert validate(preset(name)) is preset(name)


def _attn(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    return cfg.replace(attention=dataclasses.replace(cfg.attention, **changes))


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: preset("llama-tiny").replace(head_dim=96),
     "unsupported head_dim 96; megakernel supports 64, 128, 256"),
    (lambda: preset("qwen2-tiny").replace(head_dim=32), "unsupported head_dim 32"),
    (lambda: _attn(preset("qwen3.5-tiny"), head_dim=96), "unsupported head_dim 96"),
    (lambda: _attn(preset("nemotron-h-tiny"), head_dim=96), "unsupported head_dim 96"),
    (lambda: preset("llama-tiny").replace(hidden_size=200),
     "hidden_size = 200 must be a multiple of 64"),
    (lambda: preset("kimi-linear-tiny").replace(hidden_size=96),
     "hidden_size = 96 must be a multiple of 64"),
    (lambda: preset("qwen3-tiny").replace(intermediate_size=520),
     "intermediate_size = 520 must be a multiple of 16"),
    (lambda: preset("nemotron-h-tiny").replace(intermediate_size=120),
     "intermediate_size = 120 must be a multiple of 16"),
    (lambda: preset("kimi-linear-tiny").replace(
        moe=dataclasses.replace(preset("kimi-linear-tiny").moe, num_shared_experts=2)),
     "2 shared experts"),
    (lambda: preset("kimi-linear-tiny").replace(
        moe=dataclasses.replace(preset("kimi-linear-tiny").moe, intermediate_size=40)),
     "moe_intermediate_size = 40 must be a multiple of 16"),
    (lambda: preset("kimi-linear-tiny").replace(
        mla=dataclasses.replace(preset("kimi-linear-tiny").mla, q_lora_rank=16)),
     r"low-rank query projection \(q_lora_rank\)"),
])
def test_validate_refuses_unsupported_shapes_by_name(make: Callable[[], ModelConfig],
                                                     needle: str) -> None:
    cfg = make()
    expected_shapes(cfg)  # a legal model: only megakernel cannot run it
    with pytest.raises(ConfigError, match=needle):
        validate(cfg)


@pytest.mark.parametrize("name", ALL_TINY)
def test_validate_accepts_any_vocab_size(name: str) -> None:
    cfg = preset(name).replace(vocab_size=1001)
    assert validate(cfg) is cfg
