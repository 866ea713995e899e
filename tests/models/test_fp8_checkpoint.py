"""FP8 checkpoints (megakernel/models/weights.py, docs/FP8.md "Checkpoints"): both Hugging Face
forms round-trip bit-exactly, hand-written files in each real format load (the real scale names,
per-tensor scales, bf16 scales, activation scales skipped, kv_b / LM head dequantized, a bf16
projection quantized), every bad scale or code is a WeightError naming the tensor, e4m3 decoded
by an independent numpy decoder and by transformers' own CPU dequantization, and
`weights="fp8"` (load_model / resolve) on presets, bf16 checkpoints and GGUF files."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megakernel.common.errors import ConfigError, UserError
from megakernel.models import fp8, preset
from megakernel.models.config import ModelConfig, expected_shapes
from megakernel.models.fp8 import E4M3, Fp8Format
from megakernel.models.sources import load_model, resolve
from megakernel.models.weights import (
    WeightError,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)
from tests.models.gguf_writing import write_dense

Weights = dict[str, torch.Tensor]


# ---- helpers -------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor compared bit for bit (e4m3 as its bytes: NaN codes and -0 included)."""
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def assert_same(got: Any, want: Any) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for n in want:
        g, w = got[n], want[n]
        assert g.dtype == w.dtype and g.shape == w.shape, (n, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(bits(g), bits(w)), n


def fp8_model(name: str, granularity: str, seed: int = 0) -> tuple[ModelConfig, Weights]:
    """A preset in the in-memory FP8 form, materialized."""
    cfg, w = load_model(name, seed=seed, weights="fp8", granularity=granularity)
    return cfg, {n: w[n] for n in w}


def e4m3_numpy(codes: np.ndarray) -> np.ndarray:
    """e4m3fn decoded from its bit fields, independently of torch: sign, 4-bit exponent (bias 7),
    3-bit mantissa; exponent 0 is subnormal (m/8 * 2^-6); S.1111.111 is NaN; no infinities."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return np.copysign(np.where((e == 15) & (m == 7), np.nan, mag), sign).astype(np.float32)


def expand_numpy(scale: np.ndarray, shape: tuple[int, int], fmt: Fp8Format) -> np.ndarray:
    r, k = shape
    if fmt.granularity == "channel":
        return np.broadcast_to(scale.reshape(r, 1), (r, k))
    br, bk = fmt.block
    return np.repeat(np.repeat(scale, br, axis=0), bk, axis=1)[:r, :k]


def dequant_numpy(codes: np.ndarray, scale: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    return (e4m3_numpy(codes) * expand_numpy(scale.astype(np.float32), codes.shape, fmt)).astype(
        np.float32)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file written by hand (8-byte header length, JSON header, raw little-endian
    data), so the format the loader reads is the file format, not our writer's."""
    size = {"F8_E4M3": 1, "BF16": 2, "F32": 4, "I32": 4}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off, blobs = 0, []
    for name, (dt, shape, data) in tensors.items():
        assert len(data) == math.prod(shape) * size[dt], name
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """A torch tensor as (safetensors dtype, shape, bytes)."""
    dt = {torch.bfloat16: "BF16", torch.float32: "F32", E4M3: "F8_E4M3"}[t.dtype]
    view = {torch.bfloat16: torch.int16, torch.float32: torch.float32, E4M3: torch.uint8}[t.dtype]
    return dt, tuple(t.shape), t.contiguous().view(view).numpy().tobytes()


def random_codes(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random e4m3 codes, NaN (S.1111.111) excluded."""
    c = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return np.where((c & 0x7F) == 0x7F, np.uint8(0x38), c).astype(np.uint8)


def write_dir(root: Path, hf: dict[str, Any], tensors: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf))
    write_safetensors(root / "model.safetensors", tensors)
    return root


# ---- e4m3 itself -----------------------------------------------------------------------------
def test_numpy_e4m3_decoder_agrees_with_torch_on_all_codes() -> None:
    codes = np.arange(256, dtype=np.uint8)
    ours = e4m3_numpy(codes)
    theirs = torch.from_numpy(codes).view(E4M3).to(torch.float32).numpy()
    np.testing.assert_array_equal(ours, theirs)  # NaN == NaN here
    assert np.array_equal(np.signbit(ours), np.signbit(theirs))  # -0 at 0x80
    assert np.isnan(ours).sum() == 2 and ours[0x7E] == 448.0 and ours[0x01] == 2.0**-9


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_dequantize_equals_numpy(granularity: str) -> None:
    fmt = Fp8Format(granularity)
    rng = np.random.default_rng(1)
    shape = (200, 300)  # ragged blocks in both directions
    codes = random_codes(shape, rng)
    scale = rng.uniform(1e-4, 2.0, size=fmt.scale_shape(shape)).astype(np.float32)
    got = fp8.dequantize(torch.from_numpy(codes).view(E4M3), torch.from_numpy(scale), fmt)
    assert np.array_equal(got.numpy(), dequant_numpy(codes, scale, fmt))


# ---- round trips ----------------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3.5-tiny"])
def test_save_load_round_trip(tmp_path: Path, name: str, granularity: str) -> None:
    cfg, w = fp8_model(name, granularity, seed=3)
    save_checkpoint(cfg, w, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    q = fp8.quantized_names(cfg)
    if granularity == "block":  # transformers' fp8 form
        assert hf["quant_method"] == "fp8" and hf["weight_block_size"] == [128, 128]
        assert all(n + "_scale_inv" in on_disk and n + "_scale" not in on_disk for n in q)
    else:  # compressed-tensors
        assert hf["quant_method"] == "compressed-tensors"
        assert all(on_disk[n + "_scale"].shape == (on_disk[n].shape[0], 1) for n in q)
    assert all(on_disk[n].dtype == E4M3 for n in q)
    cfg2, w2 = load_checkpoint(tmp_path)
    assert cfg2.quant == cfg.quant
    assert_same(w2, w)
    # dtype= converts the other tensors only: codes and scales stay as they are
    _, w3 = load_checkpoint(tmp_path, dtype=torch.float32)
    assert all(w3[n].dtype == E4M3 and torch.equal(w3[n + "_scale"], w[n + "_scale"]) for n in q)
    assert w3[cfg.embed_name].dtype == torch.float32


def test_scale_names_follow_the_family_renames(tmp_path: Path) -> None:
    """Qwen3.5's multimodal checkpoints prefix the text model with `model.language_model.`; its
    scales carry the same prefix and land on our names."""
    cfg, w = fp8_model("qwen3.5-tiny", "block")
    save_checkpoint(cfg, w, tmp_path)
    path = tmp_path / "model.safetensors"
    t = load_file(str(path))
    renamed = {re.sub(r"^model\.", "model.language_model.", n): v for n, v in t.items()}
    assert any(n.startswith("model.language_model.") and n.endswith("_scale_inv")
               for n in renamed)
    save_file(renamed, str(path))
    assert_same(load_checkpoint(tmp_path)[1], w)


# ---- hand-written checkpoints in the real formats ----------------------------------------------
@pytest.mark.parametrize("form", ["block", "per-tensor"])
def test_transformers_fp8_checkpoint_by_hand(tmp_path: Path, form: str) -> None:
    """transformers' "fp8" form (DeepSeek-V3 / Qwen3-FP8): `X.weight_scale_inv` is the
    multiplier; without weight_block_size the scale is per tensor ([]). Kimi-Linear-tiny: MLA's
    kv_b and the LM head stored in e4m3 are dequantized, the dense layer's MLP is named as the
    published checkpoint names it (`block_sparse_moe.`), one projection is left in bf16."""
    base = preset("kimi-linear-tiny")
    qc: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
    if form == "block":
        qc["weight_block_size"] = [128, 128]
    fmt = Fp8Format("block" if form == "block" else "channel")
    cfg = base.replace(quant=fmt)
    q = set(fp8.quantized_names(cfg))
    kv_b = next(n for n in expected_shapes(cfg) if n.endswith("kv_b_proj.weight"))
    bf16_proj = "model.layers.0.self_attn.o_proj.weight"
    dequantized = {kv_b, cfg.lm_head_name}
    rng = np.random.default_rng(5)
    bf16 = random_weights(base, 5)
    tensors: dict[str, Any] = {}
    want: Weights = {}
    for n, shape in expected_shapes(cfg).items():
        disk = n.replace(".mlp.", ".block_sparse_moe.") if n.startswith("model.layers.0.") else n
        if (n in q and n != bf16_proj) or n in dequantized:
            codes = random_codes(shape, rng)
            sshape = fmt.scale_shape(shape) if form == "block" else ()
            scale = rng.uniform(1e-3, 1e-1, size=sshape).astype(np.float32)
            tensors[disk] = ("F8_E4M3", shape, codes.tobytes())
            tensors[disk + "_scale_inv"] = ("F32", sshape, scale.tobytes())
            full = np.broadcast_to(scale.reshape(-1, 1), (shape[0], 1)) if form != "block" \
                else scale
            if n in q:
                want[n] = torch.from_numpy(codes).view(E4M3)
                want[n + "_scale"] = torch.from_numpy(np.ascontiguousarray(full))
            else:
                want[n] = torch.from_numpy(dequant_numpy(codes, np.ascontiguousarray(full), fmt))
        else:
            tensors[disk] = raw(bf16[n])
            want[n] = bf16[n]
            if n == bf16_proj:
                want[n], want[n + "_scale"] = fp8.quantize(bf16[n], fmt)
    write_dir(tmp_path, {**base.to_hf_dict(), "quantization_config": qc}, tensors)
    cfg2, got = load_checkpoint(tmp_path)
    assert cfg2.quant == fmt
    assert_same(got, want)


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_compressed_tensors_checkpoint_by_hand(tmp_path: Path, strategy: str) -> None:
    """compressed-tensors' float-quantized form (RedHatAI / llm-compressor FP8): `X.weight_scale`
    per tensor ([1] / [] / [1, 1], W8A8 static with `X.input_scale`, skipped) or per channel
    ([R, 1] in bf16, as FP8-dynamic checkpoints store it)."""
    base = preset("qwen3-tiny")
    act = ({"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": "tensor",
            "symmetric": True, "type": "float"} if strategy == "tensor"
           else {"dynamic": True, "num_bits": 8, "observer": None, "strategy": "token",
                 "symmetric": True, "type": "float"})
    qc = {"config_groups": {"group_0": {
        "input_activations": act, "output_activations": None, "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": strategy,
                    "symmetric": True, "type": "float"}}},
        "format": "float-quantized", "global_compression_ratio": 1.24, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed"}
    fmt = Fp8Format("channel")
    cfg = base.replace(quant=fmt)
    q = fp8.quantized_names(cfg)
    rng = np.random.default_rng(7)
    bf16 = random_weights(base, 7)
    tensors: dict[str, Any] = {}
    want: Weights = {}
    per_tensor_shapes = [(1,), (), (1, 1)]
    for n, shape in expected_shapes(cfg).items():
        if n not in q:
            tensors[n] = raw(bf16[n])
            want[n] = bf16[n]
            continue
        codes = random_codes(shape, rng)
        tensors[n] = ("F8_E4M3", shape, codes.tobytes())
        if strategy == "tensor":
            sshape = per_tensor_shapes[len(want) % 3]
            s = rng.uniform(1e-3, 1e-1, size=sshape).astype(np.float32)
            tensors[n + "_scale"] = ("F32", sshape, s.tobytes())
            tensors[n.replace(".weight", ".input_scale")] = ("F32", (1,), s.tobytes())
            scale = torch.full((shape[0], 1), float(s.reshape(())))
        else:
            scale = torch.empty(shape[0], 1).uniform_(1e-3, 1e-1).to(torch.bfloat16)
            tensors[n + "_scale"] = raw(scale)
            scale = scale.float()
        want[n], want[n + "_scale"] = torch.from_numpy(codes).view(E4M3), scale
    write_dir(tmp_path, {**base.to_hf_dict(), "quantization_config": qc}, tensors)
    cfg2, got = load_checkpoint(tmp_path)
    assert cfg2.quant == fmt
    assert_same(got, want)


# ---- bad scales and codes ---------------------------------------------------------------------
TARGET = "model.layers.0.mlp.down_proj.weight"


def _scale(granularity: str) -> str:
    return TARGET + ("_scale_inv" if granularity == "block" else "_scale")


def _corrupt(case: str, granularity: str, t: Weights, hf: dict[str, Any]) -> str:
    """Plant `case` in the tensors / config; returns the name the error must carry."""
    s = _scale(granularity)
    if case in ("inf", "nan", "zero", "negative"):
        bad = {"inf": math.inf, "nan": math.nan, "zero": 0.0, "negative": -0.5}[case]
        t[s] = t[s].clone()
        t[s].view(-1)[-1] = bad
        return s
    if case == "wrong shape":
        t[s] = torch.ones(2, 2) if granularity == "block" else t[s].reshape(-1)
        return s
    if case == "scale dtype":  # integers are no scale format (and would load as valid here)
        t[s] = torch.full_like(t[s], 3, dtype=torch.int32)
        return s
    if case == "missing scale":
        del t[s]
        return TARGET
    if case == "scale without weight":
        orphan = s.replace("layers.0", "layers.7")
        t[orphan] = t[s].clone()
        return orphan
    if case == "two scales":
        other = TARGET + ("_scale" if granularity == "block" else "_scale_inv")
        t[other] = t[s].clone()
        return other
    if case in ("nan code 0x7f", "nan code 0xff"):
        u = t[TARGET].view(torch.uint8).clone()
        u.view(-1)[5] = 0x7F if case.endswith("0x7f") else 0xFF
        t[TARGET] = u.view(E4M3)
        return TARGET
    if case == "scale on a bf16 weight":
        t[TARGET] = t[TARGET].to(torch.bfloat16)
        return s
    if case == "no quantization_config":
        del hf["quantization_config"]
        return "has no quantization_config"
    raise AssertionError(case)


BAD = ["inf", "nan", "zero", "negative", "wrong shape", "scale dtype", "missing scale",
       "scale without weight", "two scales", "nan code 0x7f", "nan code 0xff",
       "scale on a bf16 weight", "no quantization_config"]


@pytest.fixture(scope="module")
def saved_fp8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Weights, dict]]:
    """llama-tiny saved in each FP8 form: (its file's tensors, its config.json)."""
    out = {}
    for g in ("channel", "block"):
        root = tmp_path_factory.mktemp(g)
        cfg, w = fp8_model("llama-tiny", g)
        save_checkpoint(cfg, w, root)
        out[g] = (load_file(str(root / "model.safetensors")),
                  json.loads((root / "config.json").read_text()))
    return out


@pytest.mark.parametrize("granularity", ["channel", "block"])
@pytest.mark.parametrize("case", BAD)
def test_bad_fp8_tensors_name_the_tensor(tmp_path: Path, saved_fp8: dict, case: str,
                                         granularity: str) -> None:
    t, hf = saved_fp8[granularity]
    t, hf = dict(t), json.loads(json.dumps(hf))
    name = _corrupt(case, granularity, t, hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match=re.escape(name)) as e:
        load_checkpoint(tmp_path)
    assert isinstance(e.value, UserError)


def test_a_clean_copy_of_the_bad_case_fixture_loads(tmp_path: Path, saved_fp8: dict) -> None:
    """The corruptions above are the only thing wrong with their files."""
    for g, (t, hf) in saved_fp8.items():
        root = tmp_path / g
        root.mkdir()
        (root / "config.json").write_text(json.dumps(hf))
        save_file(dict(t), str(root / "model.safetensors"))
        assert load_checkpoint(root)[0].quant == Fp8Format(g)


# ---- transformers' own FP8 dequantization (CPU) -------------------------------------------------
def test_block_dequantization_equals_transformers(tmp_path: Path) -> None:
    """transformers' finegrained-FP8 dequantization (`_dequantize_fp8_weight`, the backward
    pass's, any shape; `Fp8Dequantize._dequantize_one`, the dequantize-on-load op, whole
    blocks only) on the checkpoint's own `weight` / `weight_scale_inv` equals the FP8 truth of
    the loaded model, and fp8.dequantize on ragged and whole-block matrices."""
    fp8mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    cfg, w = fp8_model("llama-tiny", "block", seed=2)
    save_checkpoint(cfg, w, tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    truth = fp8.dequantized(*load_checkpoint(tmp_path))
    for n in fp8.quantized_names(cfg):
        theirs = fp8mod._dequantize_fp8_weight(disk[n], disk[n + "_scale_inv"], [128, 128],
                                               torch.float32)
        assert torch.equal(theirs, truth[n]), n
    fmt = Fp8Format("block")
    for shape in [(200, 300), (256, 384)]:
        codes, scale = fp8.quantize(torch.randn(shape, generator=torch.Generator().manual_seed(0)),
                                    fmt)
        ours = fp8.dequantize(codes, scale, fmt)
        assert torch.equal(fp8mod._dequantize_fp8_weight(codes, scale, [128, 128],
                                                         torch.float32), ours)
        if shape[0] % 128 == 0 and shape[1] % 128 == 0:  # it derives the block from the grid
            op = fp8mod.Fp8Dequantize(None)
            assert torch.equal(op._dequantize_one(codes, scale, output_dtype=torch.float32), ours)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_channel_dequantization_equals_transformers(strategy: str) -> None:
    """transformers' compressed-tensors FP8 linear (CompressedTensorsFP8Linear, its scale taken
    through ConvertFP8LinearScale as on load) runs on the CPU: applied to the identity, whose rows
    its per-row activation quantization keeps exact, it returns the dequantized weight's
    transpose."""
    ct = pytest.importorskip("transformers.integrations.compressed_tensors")
    fmt = Fp8Format("channel")
    g = torch.Generator().manual_seed(4)
    r, k = 96, 160
    codes, scale = fp8.quantize(torch.randn(r, k, generator=g), fmt)
    disk_scale = scale if strategy == "channel" else scale[:1].reshape(1, 1)
    if strategy == "tensor":
        codes = (codes.float() * (scale / disk_scale)).clamp(-448, 448).to(E4M3)  # one scale
    holder = torch.nn.Module()
    holder.proj = ct.CompressedTensorsFP8Linear(k, r)
    key = "proj.weight_scale"
    converted = ct.ConvertFP8LinearScale().convert({key: disk_scale}, model=holder,
                                                   full_layer_name=key)[key]
    holder.proj.weight.data = codes
    holder.proj.weight_scale.data = converted
    with torch.no_grad():
        theirs = holder.proj(torch.eye(k)).T
    ours_scale = disk_scale if strategy == "channel" else disk_scale.expand(r, 1)
    ours = fp8.dequantize(codes, ours_scale, fmt)
    torch.testing.assert_close(theirs, ours, rtol=2**-22, atol=0)


def test_transformers_fp8_linear_forward_on_cpu() -> None:
    """transformers' FP8Linear (the block form's inference path) computes with the
    finegrained-fp8 kernels; where it runs it must equal the dequantized weight."""
    fp8mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    fmt = Fp8Format("block")
    codes, scale = fp8.quantize(torch.randn(128, 256, generator=torch.Generator().manual_seed(1)),
                                fmt)
    lin = fp8mod.FP8Linear(256, 128, block_size=(128, 128))
    lin.weight.data, lin.weight_scale_inv.data = codes, scale
    try:
        with torch.no_grad():
            y = lin(torch.eye(256))
    except ImportError as e:
        pytest.skip(f"transformers' FP8Linear.forward does not run on this CPU: its "
                    f"finegrained-fp8 kernel is unavailable ({str(e)[:160]}); the dequantization "
                    "itself is compared in test_block_dequantization_equals_transformers")
    torch.testing.assert_close(y.T.float(), fp8.dequantize(codes, scale, fmt), rtol=2**-7,
                               atol=0)


# ---- weights="fp8" ------------------------------------------------------------------------------
def _assert_quantized_from(cfg: ModelConfig, got: Any, bf16: Weights) -> None:
    q = set(fp8.quantized_names(cfg))
    assert q and set(got) == set(bf16) | {n + "_scale" for n in q}
    for n, t in bf16.items():
        if n in q:
            codes, scale = fp8.quantize(t, cfg.quant)
            assert torch.equal(bits(got[n]), bits(codes)), n
            assert torch.equal(got[n + "_scale"], scale), n
        else:
            assert torch.equal(got[n], t), n


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_weights_fp8_on_a_preset(granularity: str) -> None:
    cfg, w = load_model("kimi-linear-tiny", seed=2, weights="fp8", granularity=granularity)
    assert cfg.quant == Fp8Format(granularity)
    assert resolve("kimi-linear-tiny", weights="fp8", granularity=granularity) == cfg
    assert isinstance(w, fp8.QuantizedWeights)  # lazy: nothing drawn twice
    _assert_quantized_from(cfg, w, random_weights(cfg, 2))


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_weights_fp8_on_a_bf16_checkpoint(tmp_path: Path, granularity: str) -> None:
    base = preset("qwen3-tiny")
    bf16 = random_weights(base, 4)
    save_checkpoint(base, bf16, tmp_path)
    cfg, w = load_model(str(tmp_path), weights="fp8", granularity=granularity)
    assert cfg.quant == Fp8Format(granularity)
    assert resolve(str(tmp_path), weights="fp8", granularity=granularity).quant == cfg.quant
    _assert_quantized_from(cfg, w, bf16)
    # fp32 on disk, dtype=bf16: quantized from the bf16 it loads as
    save_checkpoint(base, {n: t.float() for n, t in bf16.items()}, tmp_path / "f32")
    _assert_quantized_from(cfg, load_model(str(tmp_path / "f32"), weights="fp8",
                                           granularity=granularity)[1], bf16)


def test_weights_fp8_on_a_gguf_file(tmp_path: Path) -> None:
    base = preset("llama-tiny")
    bf16 = random_weights(base, 6)
    path = write_dense(tmp_path / "tiny.gguf", base, bf16)
    cfg, w = load_model(str(path), weights="fp8")
    assert cfg.quant == Fp8Format("channel") == resolve(str(path), weights="fp8").quant
    _assert_quantized_from(cfg, w, bf16)


def test_an_fp8_checkpoint_keeps_its_own_format(tmp_path: Path) -> None:
    cfg, w = fp8_model("llama-tiny", "channel", seed=1)
    save_checkpoint(cfg, w, tmp_path)
    for weights, granularity in [("bf16", "channel"), ("fp8", "block"), ("fp8", "channel")]:
        c2, w2 = load_model(str(tmp_path), weights=weights, granularity=granularity)
        assert c2.quant == cfg.quant
        assert resolve(str(tmp_path), weights=weights, granularity=granularity) == c2
        assert_same(w2, w)


def test_weights_and_granularity_are_validated() -> None:
    with pytest.raises(ConfigError, match="unknown weights format 'int4'"):
        load_model("llama-tiny", weights="int4")
    with pytest.raises(ConfigError, match="granularity 'tensor'"):
        resolve("llama-tiny", weights="fp8", granularity="tensor")
    assert resolve("llama-tiny").quant is None
    assert load_model("llama-tiny")[0].quant is None


@pytest.mark.parametrize("qc,head", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, False),  # transformers' default
    ({"quant_method": "fp8", "modules_to_not_convert": ["lm_head"]}, False),
    ({"quant_method": "fp8", "modules_to_not_convert": []}, True),
    ({"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "tensor"}}}}, False),
    ({"quant_method": "compressed-tensors", "ignore": [], "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}, True),
])
def test_lm_head_quantized_as_transformers_decides(qc: dict[str, Any], head: bool) -> None:
    """transformers' fp8 quantizer skips the LM head when `modules_to_not_convert` is absent
    (DeepSeek-V3's config has none and its head is bf16); compressed-tensors quantizes what its
    `ignore` list does not name."""
    fmt = fp8.from_hf(qc)
    assert fmt is not None and fmt.lm_head is head
    assert fp8.from_hf(fmt.to_hf()) == fmt


def test_weights_fp8_with_the_lm_head(tmp_path: Path) -> None:
    """`lm_head=True` quantizes an untied LM head too (its format round-trips through a
    checkpoint); a tied head is the embedding, never quantized."""
    cfg, w = load_model("qwen3-tiny", seed=8, weights="fp8", lm_head=True)
    assert cfg.quant == Fp8Format("channel", lm_head=True) == resolve(
        "qwen3-tiny", weights="fp8", lm_head=True).quant
    assert cfg.lm_head_name in fp8.quantized_names(cfg) and w[cfg.lm_head_name].dtype == E4M3
    _assert_quantized_from(cfg, w, random_weights(cfg, 8))
    save_checkpoint(cfg, w, tmp_path)
    cfg2, w2 = load_checkpoint(tmp_path)
    assert cfg2.quant == cfg.quant
    assert_same(w2, {n: w[n] for n in w})
    tied, wt = load_model("llama-tiny", weights="fp8", lm_head=True)
    assert tied.lm_head_name not in wt and tied.lm_head_name not in fp8.quantized_names(tied)
    with pytest.raises(ConfigError, match="lm_head must be a bool"):
        resolve("llama-tiny", weights="fp8", lm_head="yes")  # type: ignore[arg-type]


def test_sharded_fp8_checkpoint_with_scales_in_another_shard(tmp_path: Path) -> None:
    """A sharded checkpoint may hold a weight and its scale in different files."""
    cfg, w = fp8_model("llama-tiny", "block", seed=9)
    save_checkpoint(cfg, w, tmp_path)
    single = tmp_path / "model.safetensors"
    t = load_file(str(single))
    single.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for n, v in t.items():  # scales in the second shard, everything else in the first
        shards[n.endswith("_scale_inv")][n] = v
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, str(tmp_path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same(load_checkpoint(tmp_path)[1], w)
