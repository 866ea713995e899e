"""GGUF files for tests, written with the `gguf` package's writer the way llama.cpp's converter
writes a dense model (its metadata keys, its tensor names, Llama's q/k row permutation), so that
the loader is read against an independent forward conversion.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from megakernel.models.config import ModelConfig

F32 = "F32"


def write_gguf(path: Path, arch: str, meta: dict[str, Any],
               tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """Write `tensors` ({gguf name: (fp32 array in torch order, GGUF type name)}) with `meta`
    ({key: int | float | str | bool | list}) as a GGUF file of architecture `arch`. F32, F16 and
    BF16 are stored as they are; block types are quantized by the `gguf` package; a (uint8
    array, type) pair whose array is already bytes is written raw (for types the package cannot
    quantize)."""
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in meta.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    for name, (arr, type_name) in tensors.items():
        qt = gguf.GGMLQuantizationType[type_name]
        if arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=qt)
        elif type_name == F32:
            w.add_tensor(name, arr.astype(np.float32))
        elif type_name == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dense_meta(cfg: ModelConfig) -> dict[str, Any]:
    """llama.cpp's metadata of a dense model (TextModel.set_gguf_parameters' keys)."""
    a = cfg.gguf_arch
    return {
        f"{a}.block_count": cfg.num_layers,
        f"{a}.vocab_size": cfg.vocab_size,
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": cfg.num_heads,
        f"{a}.attention.head_count_kv": cfg.num_kv_heads,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.rope.dimension_count": cfg.head_dim,
        f"{a}.rope.freq_base": float(cfg.rope.theta),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
    }


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from (half, i) order to (i, half)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def dense_tensors(cfg: ModelConfig, weights: dict[str, torch.Tensor],
                  type_of: dict[str, str] | None = None) -> dict[str, tuple[np.ndarray, str]]:
    """The GGUF tensors of a dense model: llama.cpp's names, Llama's q/k permutation, each
    tensor of type `type_of.get(hf name, F32)`."""
    table = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[cfg.gguf_arch], cfg.num_layers)
    out = {}
    for hf, t in weights.items():
        arr = t.float().numpy()
        if cfg.gguf_arch == "llama" and "q_proj." in hf:
            arr = llama_permute(arr, cfg.num_heads)
        elif cfg.gguf_arch == "llama" and "k_proj." in hf:
            arr = llama_permute(arr, cfg.num_kv_heads)
        name = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        out[name] = (arr, (type_of or {}).get(hf, F32))
    return out


def write_dense(path: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                type_of: dict[str, str] | None = None) -> Path:
    return write_gguf(path, cfg.gguf_arch, dense_meta(cfg), dense_tensors(cfg, weights, type_of))
