"""GGUF checkpoints: dequantisation of each block type against the `gguf` package's own, the dense
families' GGUF form read back from files written as llama.cpp writes them (and, in the slow lane,
against transformers' GGUF loading), and every bad file as an error naming the problem."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from megakernel.cli import main as cli
from megakernel.models import ConfigError, preset
from megakernel.models.dense import DenseConfig
from megakernel.models.gguf import config_from_gguf, load_gguf
from megakernel.models.gguf_quants import BLOCK_TYPES, dequantize
from megakernel.models.registry import load_all, presets
from megakernel.models.sources import load_model
from megakernel.models.weights import WeightError, random_weights
from tests.models.gguf_writing import dense_meta, dense_tensors, write_dense, write_gguf

# the dense families with a GGUF form, each by its tiny preset
DENSE_GGUF = tuple(n for n, c in presets().items() if n.endswith("-tiny")
                   and isinstance(c, DenseConfig) and c.gguf_arch)


def _random_blocks(type_name: str, n: int, seed: int = 0) -> np.ndarray:
    """n random blocks of a type, their fp16 scale fields set to finite values (random bytes
    elsewhere: every bit of the quants is exercised)."""
    bt = BLOCK_TYPES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, bt.nbytes), dtype=np.uint8)

    def f16(k: int) -> np.ndarray:
        return rng.uniform(-2, 2, size=(n, k)).astype(np.float16).view(np.uint8)

    if type_name == "Q6_K":
        raw[:, 208:210] = f16(1)  # d is the last field
    elif type_name.endswith("_K") or type_name in ("Q4_1", "Q5_1"):
        raw[:, 0:4] = f16(2)  # d and m (dmin)
    else:
        raw[:, 0:2] = f16(1)
    return raw


# ---- dequantisation ------------------------------------------------------------------------------
@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_dequantize_matches_the_gguf_package(type_name: str) -> None:
    """Bit for bit the `gguf` package's (numpy) dequantisation, on random blocks; the block
    geometry is the package's too."""
    qt = gguf.GGMLQuantizationType[type_name]
    assert gguf.GGML_QUANT_SIZES[qt] == (BLOCK_TYPES[type_name].block,
                                         BLOCK_TYPES[type_name].nbytes)
    raw = _random_blocks(type_name, 48)
    want = gguf.quants.dequantize(raw, qt).reshape(-1)
    got = dequantize(torch.from_numpy(raw), type_name, want.size).numpy()
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


def test_dequantize_refuses_a_partial_block() -> None:
    raw = torch.from_numpy(_random_blocks("Q4_K", 2))
    with pytest.raises(ValueError, match="do not hold 500 Q4_K elements"):
        dequantize(raw, "Q4_K", 500)
    with pytest.raises(ValueError, match="do not hold 768"):
        dequantize(raw, "Q4_K", 768)


# ---- the dense families' GGUF form ---------------------------------------------------------------
def _types(cfg) -> dict[str, str]:  # noqa: ANN001
    """A mix of stored types over one model: plain F32/F16/BF16 and the quantized Q8_0/Q4_0."""
    mix = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
    return {n: mix[i % len(mix)] for i, n in enumerate(random_weights(cfg, 0)) if
            n.endswith("proj.weight")}


@pytest.mark.parametrize("name", DENSE_GGUF)
def test_dense_gguf_round_trip(tmp_path: Path, name: str) -> None:
    """A tiny preset written as llama.cpp writes it reads back as the same config and, tensor by
    tensor, the written values: exact for F32/F16/BF16, the `gguf` package's dequantisation of
    the written blocks for quantized types."""
    cfg = preset(name)
    w = random_weights(cfg, 3, dtype=torch.float32)
    types = _types(cfg)
    path = write_dense(tmp_path / f"{name}.gguf", cfg, w, types)
    got_cfg, got = load_gguf(path, dtype=None)
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "intermediate_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(got_cfg, f) == getattr(cfg, f), f
    assert got_cfg.rope.theta == cfg.rope.theta and got_cfg.family == cfg.family
    assert got_cfg.rms_norm_eps == cfg.rms_norm_eps  # stored as float32, read back as written
    assert set(got) == set(w)
    quantized = 0
    for n, t in w.items():
        kind = types.get(n, "F32")
        if kind in BLOCK_TYPES:
            qt = gguf.GGMLQuantizationType[kind]
            want = torch.from_numpy(gguf.quants.dequantize(
                gguf.quants.quantize(t.numpy(), qt), qt).reshape(t.shape))
            assert got[n].dtype == torch.float32
            quantized += 1
        else:
            # the values are bf16's: exact in F32 and BF16, rounded to fp16's grid in F16
            want = t.half().float() if kind == "F16" else t
        assert torch.equal(got[n].float(), want), n
    assert quantized >= 3 * cfg.num_layers  # the mix reached every quantized type


def test_gguf_loads_through_every_entry_point(tmp_path: Path, capsys) -> None:
    """load_model, resolve (config only) and the CLI read a .gguf path like a checkpoint."""
    cfg = preset("llama-tiny")
    w = random_weights(cfg, 5)
    path = write_dense(tmp_path / "tiny.gguf", cfg, w)
    c2, w2 = load_model(str(path))
    assert c2.num_layers == cfg.num_layers and all(torch.equal(w2[n], w[n]) for n in w)
    assert config_from_gguf(path).hidden_size == cfg.hidden_size
    rc = cli.main(["generate", "--model", str(path), "--prompt-ids", "5,17,3", "--steps", "3"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "checkpoint" in out and "new tokens" in out


# ---- bad files -----------------------------------------------------------------------------------
@pytest.fixture
def tiny_parts() -> tuple:
    cfg = preset("llama-tiny")
    return cfg, dense_meta(cfg), dense_tensors(cfg, random_weights(cfg, 1, torch.float32))


def _error(path: Path, capsys) -> str:
    """The CLI's one error line for loading `path` (exit 2)."""
    rc = cli.main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--steps", "1"])
    _, err = capsys.readouterr()
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_truncated_file(tmp_path: Path, tiny_parts, capsys) -> None:
    cfg, meta, tensors = tiny_parts
    path = write_gguf(tmp_path / "t.gguf", "llama", meta, tensors)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(WeightError, match="not a readable GGUF file"):
        load_gguf(path)
    assert "truncated" in _error(path, capsys)


def test_not_a_gguf_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(range(200)))
    assert "not a readable GGUF file" in _error(path, capsys)


def test_unknown_architecture(tmp_path: Path, tiny_parts, capsys) -> None:
    _, meta, tensors = tiny_parts
    path = write_gguf(tmp_path / "a.gguf", "gpt2", meta, tensors)
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'; supported: "
                       ".*llama.*qwen2.*qwen3"):
        load_gguf(path)
    assert "gpt2" in _error(path, capsys)


def test_unsupported_block_type_names_the_tensor(tmp_path: Path, tiny_parts, capsys) -> None:
    cfg, meta, tensors = tiny_parts
    rows, cols = tensors["blk.1.ffn_up.weight"].shape
    q2k = gguf.GGMLQuantizationType.Q2_K
    block, nbytes = gguf.GGML_QUANT_SIZES[q2k]
    raw = np.zeros((rows, cols // block * nbytes), dtype=np.uint8)
    tensors["blk.1.ffn_up.weight"] = (raw, "Q2_K")
    path = write_gguf(tmp_path / "q.gguf", "llama", meta, tensors)
    line = _error(path, capsys)
    assert "'blk.1.ffn_up.weight'" in line and "Q2_K" in line and "Q4_K" in line


def test_shape_mismatch_names_the_tensor(tmp_path: Path, tiny_parts, capsys) -> None:
    cfg, meta, tensors = tiny_parts
    tensors["blk.0.attn_k.weight"] = tensors["blk.0.attn_k.weight"][:-64]
    path = write_gguf(tmp_path / "s.gguf", "llama", meta, tensors)
    line = _error(path, capsys)
    assert "'blk.0.attn_k.weight' has shape [64, 256], expected [128, 256]" in line


def test_missing_and_unexpected_tensors(tmp_path: Path, tiny_parts, capsys) -> None:
    cfg, meta, tensors = tiny_parts
    tensors["blk.0.extra.weight"] = tensors.pop("blk.1.ffn_down.weight")
    path = write_gguf(tmp_path / "m.gguf", "llama", meta, tensors)
    line = _error(path, capsys)
    assert "missing tensor 'blk.1.ffn_down.weight'" in line
    assert "unexpected tensor 'blk.0.extra.weight'" in line


def test_nan_values_name_the_tensor(tmp_path: Path, tiny_parts, capsys) -> None:
    cfg, meta, tensors = tiny_parts
    arr = tensors["blk.0.attn_v.weight"].copy()
    arr[3, 7] = np.nan
    tensors["blk.0.attn_v.weight"] = arr
    path = write_gguf(tmp_path / "n.gguf", "llama", meta, tensors)
    assert "'blk.0.attn_v.weight'" in _error(path, capsys)


def test_missing_metadata_and_rope_factors(tmp_path: Path, tiny_parts, capsys) -> None:
    cfg, meta, tensors = tiny_parts
    short = {k: v for k, v in meta.items() if k != "attention.head_count"}
    path = write_gguf(tmp_path / "k.gguf", "llama", short, tensors)
    assert "llama.attention.head_count" in _error(path, capsys)
    tensors["rope_freqs.weight"] = np.ones(32, np.float32)
    path = write_gguf(tmp_path / "r.gguf", "llama", meta, tensors)
    assert "rope_freqs.weight" in _error(path, capsys)


def test_missing_file(capsys) -> None:
    assert "does not exist" in _error(Path("no/such/model.gguf"), capsys)


def test_every_gguf_family_is_registered_once() -> None:
    archs = [f.cls.gguf_arch for f in load_all().values() if f.cls.gguf_arch]
    assert len(archs) == len(set(archs))
    assert {"llama", "qwen2", "qwen3"} <= set(archs)


# ---- against transformers (slow lane) ------------------------------------------------------------
@pytest.mark.parametrize("name", DENSE_GGUF)
def test_dense_gguf_matches_transformers_loading(tmp_path: Path, name: str) -> None:
    """transformers' GGUF loader (its own name map, dequantisation and q/k un-permutation) reads
    the same tensors from the file as ours."""
    from transformers import AutoModelForCausalLM

    cfg = preset(name)
    w = random_weights(cfg, 7, dtype=torch.float32)
    path = write_dense(tmp_path / f"{name}.gguf", cfg, w, _types(cfg))
    _, ours = load_gguf(path, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              dtype=torch.float32)
    sd = hf.state_dict()
    for n, t in ours.items():
        assert torch.equal(sd[n], t), n
