"""GGUF form of the hybrid families (Qwen3.5 `qwen35`, Nemotron-H `nemotron_h`; Kimi Linear's
`kimi-linear` refused): random weights converted as llama.cpp's convert_hf_to_gguf.py converts a
checkpoint (tests/models/gguf_writing.py, the oracle: transformers reads none of these GGUF
architectures), written, and loaded back by models/gguf.py: the same config, and the same tensors
bit for bit but where llama.cpp's transform is not exactly invertible in fp32 (`assert_same`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from megakernel.layers.gdn import GDNConfig
from megakernel.models.config import ConfigError, ModelConfig, expected_shapes
from megakernel.models.gguf import config_from_gguf, load_gguf
from megakernel.models.registry import presets
from megakernel.models.weights import random_weights
from tests.models.gguf_writing import (
    name_table,
    nemotron_h_gguf,
    qwen35_gguf,
    reorder_v_heads,
    write_gguf,
)

CONVERTERS = {"qwen35": qwen35_gguf, "nemotron_h": nemotron_h_gguf}


def roundtrip(tmp_path: Path, cfg: ModelConfig, seed: int = 0
              ) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, torch.Tensor]]:
    """(our weights, config and weights loaded from their llama.cpp GGUF form)."""
    weights = random_weights(cfg, seed, torch.float32)
    meta, tensors = CONVERTERS[cfg.gguf_arch](cfg, weights)
    path = write_gguf(tmp_path / f"{cfg.name}.gguf", cfg.gguf_arch, meta, tensors)
    loaded_cfg, loaded = load_gguf(path, dtype=torch.float32)
    return weights, loaded_cfg, loaded


def plus_one(cfg: ModelConfig, name: str) -> bool:
    """Tensors llama.cpp stores as 1 + w (Qwen3NextModel.modify_tensors: every norm but the gated
    delta rule's output norm)."""
    return (cfg.gguf_arch == "qwen35" and name.endswith("norm.weight")
            and not name.endswith("linear_attn.norm.weight"))


def assert_same(cfg: ModelConfig, got_cfg: ModelConfig, want: dict[str, torch.Tensor],
                got: dict[str, torch.Tensor]) -> None:
    """The same config and blocks; every tensor bit for bit, but two that llama.cpp stores
    transformed where fp32 cannot undo it exactly, both within 2^-24: a (1 + w) norm comes back
    as (1 + w) - 1 (w itself unless |w| < 2^-16: the file holds 1 + w rounded to fp32), A_log
    as log(-(-exp(A_log))) (and exactly at bf16, the precision of the random weights)."""
    assert got_cfg.replace(name=cfg.name) == cfg
    assert [(b.layer, b.kind, b.cfg, b.prefix, b.norm) for b in got_cfg.blocks] == \
        [(b.layer, b.kind, b.cfg, b.prefix, b.norm) for b in cfg.blocks]
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        if name.endswith(".A_log"):
            assert torch.equal(got[name].bfloat16(), t.bfloat16()), name
            assert float((got[name] - t).abs().max()) <= 2 ** -24, name
        elif plus_one(cfg, name):
            assert torch.equal(got[name], (t + 1) - 1), name
            assert float((got[name] - t).abs().max()) <= 2 ** -24, name
        else:
            assert torch.equal(got[name], t), name


@pytest.mark.parametrize("preset", ["qwen3.5-tiny", "nemotron-h-tiny", "nemotron-h-attn-tiny"])
def test_every_name_maps(preset: str) -> None:
    """Every Hugging Face name the config expects has a name in llama.cpp's table, as the
    converter looks it up (after its renames: `gguf_source_name`), and the names are distinct."""
    cfg = presets()[preset]
    table = name_table(cfg.gguf_arch, cfg.num_layers)
    names = {n: table.get_name(cfg.gguf_source_name(n), try_suffixes=(".weight", ".bias"))
             for n in expected_shapes(cfg)}
    assert [n for n, g in names.items() if g is None] == []
    assert len(set(names.values())) == len(names)


def _qwen35(num_k_heads: int, num_v_heads: int) -> ModelConfig:
    return presets()["qwen3.5-tiny"].replace(gdn=GDNConfig(num_k_heads, num_v_heads, 16, 8, 4))


# the preset (2 key heads, 4 value heads), equal heads (no reorder), three value heads a key
# head; seed 10 draws a norm weight below 2^-16 (1 + w loses bits of it)
@pytest.mark.parametrize("heads, seed", [((2, 4), 0), ((2, 4), 10), ((2, 2), 0), ((2, 6), 0)])
def test_qwen35_roundtrip(tmp_path: Path, heads: tuple[int, int], seed: int) -> None:
    cfg = _qwen35(*heads)
    want, got_cfg, got = roundtrip(tmp_path, cfg, seed)
    assert_same(cfg, got_cfg, want, got)


def test_qwen35_attention_only_and_tied(tmp_path: Path) -> None:
    """Every layer attention (full_attention_interval 1), a tied LM head (no output.weight)."""
    cfg = presets()["qwen3.5-attn-tiny"].replace(tie_word_embeddings=True)
    want, got_cfg, got = roundtrip(tmp_path, cfg, seed=3)
    assert_same(cfg, got_cfg, want, got)


def test_qwen35_conversion_moves_what_it_should() -> None:
    """The oracle is not vacuous: with fewer key than value heads the v rows of in_proj_qkv are
    reordered (and not with equal heads); norms gain +1, A_log becomes -exp(A_log)."""
    for heads, moved in (((2, 4), True), ((2, 2), False)):
        cfg = _qwen35(*heads)
        w = random_weights(cfg, 1, torch.float32)
        _, t = qwen35_gguf(cfg, w)
        hf = w["model.layers.0.linear_attn.in_proj_qkv.weight"]
        qk = 2 * cfg.gdn.key_dim
        assert torch.equal(torch.from_numpy(t["blk.0.attn_qkv.weight"][:qk]), hf[:qk])
        assert torch.equal(torch.from_numpy(t["blk.0.attn_qkv.weight"]), hf) is not moved
    assert torch.equal(torch.from_numpy(t["output_norm.weight"]), w["model.norm.weight"] + 1)
    assert torch.equal(torch.from_numpy(t["blk.0.ssm_a"]),
                       -torch.exp(w["model.layers.0.linear_attn.A_log"]))
    # tiled order: value head j of every key head, then j + 1
    assert reorder_v_heads(torch.arange(4), 0, 2, 2, 1).tolist() == [0, 2, 1, 3]


@pytest.mark.parametrize("preset", ["nemotron-h-tiny", "nemotron-h-attn-tiny"])
def test_nemotron_h_roundtrip(tmp_path: Path, preset: str) -> None:
    """The config comes back but for max_position_embeddings: llama.cpp writes 2**20."""
    cfg = presets()[preset]
    want, got_cfg, got = roundtrip(tmp_path, cfg)
    assert got_cfg.max_position_embeddings == 2 ** 20
    assert_same(cfg.replace(max_position_embeddings=2 ** 20), got_cfg, want, got)


def test_nemotron_h_no_conv_bias(tmp_path: Path) -> None:
    base = presets()["nemotron-h-tiny"]
    cfg = base.replace(mamba2=dataclasses.replace(base.mamba2, use_conv_bias=False),
                       max_position_embeddings=2 ** 20)
    want, got_cfg, got = roundtrip(tmp_path, cfg, seed=2)
    assert_same(cfg, got_cfg, want, got)


def _nemotron_file(tmp_path: Path, **meta_changes: Any) -> Path:
    cfg = presets()["nemotron-h-tiny"]
    meta, tensors = nemotron_h_gguf(cfg, random_weights(cfg, 0, torch.float32))
    return write_gguf(tmp_path / "m.gguf", "nemotron_h", {**meta, **meta_changes}, tensors)


@pytest.mark.parametrize("change, match", [
    ({"attention.head_count_kv": 2}, "per-layer arrays"),
    ({"attention.head_count_kv": [0, 2, 2, 0, 0]}, "both kv heads"),
    ({"feed_forward_length": [0, 128, 0, 0, 64]}, "varies by layer"),
])
def test_nemotron_h_bad_layer_arrays(tmp_path: Path, change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_gguf(_nemotron_file(tmp_path, **change))


def test_kimi_linear_refused(tmp_path: Path) -> None:
    """Recognised, and refused naming what the loader cannot map (stacked experts, split kv_b)."""
    import numpy as np

    path = write_gguf(tmp_path / "k.gguf", "kimi-linear", {"block_count": 3},
                      {"token_embd.weight": np.zeros((256, 64), np.float32)})
    with pytest.raises(ConfigError, match=r"kimi-linear.*ffn_gate_exps.*attn_k_b"):
        config_from_gguf(path)
