"""Writing GGUF files in tests: a generic writer (the `gguf` package's GGUFWriter: an architecture,
its metadata, named numpy arrays) and llama.cpp's conversion of our Hugging Face weights for the
families transformers cannot load from GGUF, so that the loader has an oracle.

The conversions follow llama.cpp's convert_hf_to_gguf.py (commit 0024aa74) step by step, written
from the converter and not from the families' inverses (`from_gguf_tensor`): the same hparams,
the same `modify_tensors` transforms in the same order, the same name table (the `gguf` package's
`get_tensor_name_map`, which the converter's `map_tensor_name` uses). Tensors are converted to fp32
first, as the converter does for bf16 checkpoints, and written as F32 (its `--outtype f32`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

Metadata = dict[str, Any]
Tensors = dict[str, np.ndarray | tuple[np.ndarray, str]]


def write_gguf(path: str | Path, arch: str, metadata: Mapping[str, Any],
               tensors: Mapping[str, Any]) -> Path:
    """A GGUF file of architecture `arch`. Metadata keys are the architecture's own
    (`block_count` is written `{arch}.block_count`) unless they start with `general.` or
    `tokenizer.`; values as llama.cpp's writer types them: bool, int (uint32, int32 when
    negative), float (float32), str, list (an array). Tensors in torch order (rows first), their
    numpy dtype giving the GGUF type (float32: F32, float16: F16); an (array, GGUF type name)
    pair is quantized to that type by the `gguf` package (BF16 and the block types it
    implements), or written as it is when the array is already uint8 bytes."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    for key, v in metadata.items():
        key = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            (w.add_uint32 if v >= 0 else w.add_int32)(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, list | tuple):
            w.add_array(key, list(v))
        else:
            raise TypeError(f"metadata {key!r}: unsupported value {v!r}")
    for name, a in tensors.items():
        if isinstance(a, tuple):  # (fp32 array, block type): quantized by the gguf package,
            arr, type_name = a  # or (uint8 bytes, type): written raw
            qt = gguf.GGMLQuantizationType[type_name]
            if arr.dtype != np.uint8:
                arr = gguf.quants.quantize(arr.astype(np.float32), qt)
            w.add_tensor(name, arr, raw_dtype=qt)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def name_table(arch: str, n_blocks: int) -> Any:
    """llama.cpp's tensor name table of `arch` (`gguf.get_tensor_name_map`)."""
    import gguf

    ids = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    return gguf.get_tensor_name_map(ids[arch], n_blocks)


def _map(table: Any, name: str) -> str:
    """The converter's map_tensor_name: the GGUF name of Hugging Face name `name`."""
    out = table.get_name(name, try_suffixes=(".weight", ".bias"))
    if out is None:
        raise ValueError(f"llama.cpp's table has no name for {name!r}")
    return out


def _f32(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """prepare_tensors: every tensor not fp16/fp32 is converted to fp32 before modify_tensors."""
    return {n: t.float() for n, t in weights.items()}


# ---- qwen35 (Qwen3_5TextModel -> _LinearAttentionVReorderBase -> Qwen3NextModel -> Qwen2MoeModel)
def reorder_v_heads(t: torch.Tensor, dim: int, num_k_heads: int, num_v_per_k: int,
                    head_dim: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: axis `dim` as [Hk, r, d] -> [r, Hk, d]."""
    shape = list(t.shape)
    if dim < 0:
        dim += len(shape)
    t = t.reshape(*shape[:dim], num_k_heads, num_v_per_k, head_dim, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def qwen35_gguf(cfg: Any, weights: Mapping[str, torch.Tensor]) -> tuple[Metadata, Tensors]:
    """llama.cpp's qwen35 form of a Qwen3.5 text model: (metadata, tensors)."""
    a, g = cfg.attention, cfg.gdn
    attn = [i for i, t in enumerate(cfg.layer_types) if t == "attention"]
    interval = attn[0] + 1 if attn else cfg.num_layers + 1
    if [i for i in range(cfg.num_layers) if (i + 1) % interval == 0] != attn:
        raise ValueError(f"{cfg.layer_types} is no full_attention_interval pattern: llama.cpp "
                         "cannot write it")
    half = a.rotary_dim // 2  # an MRoPE split as the published configs' [11, 11, 10]
    meta: Metadata = {
        # TextModel.set_gguf_parameters
        "block_count": cfg.num_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": a.num_heads,
        "attention.head_count_kv": a.num_kv_heads,
        "rope.dimension_sections": [half - 2 * (half // 3), half // 3, half // 3, 0],
        "rope.freq_base": float(a.rope.theta),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "attention.key_length": a.head_dim,
        "attention.value_length": a.head_dim,
        # Qwen3NextModel.set_gguf_parameters
        "ssm.conv_kernel": g.conv_kernel,
        "ssm.state_size": g.k_head_dim,
        "ssm.group_count": g.num_k_heads,
        "ssm.time_step_rank": g.num_v_heads,
        "ssm.inner_size": g.v_head_dim * g.num_v_heads,
        "full_attention_interval": interval,
        "rope.dimension_count": a.rotary_dim,  # int(head_dim * partial_rotary_factor)
    }
    table = name_table("qwen35", cfg.num_layers)
    hk, hv, dk, dv = g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim
    out: Tensors = {}
    for name, t in _f32(weights).items():
        # _LinearAttentionVReorderBase.modify_tensors
        if hk != hv and "linear_attn." in name:
            r = hv // hk
            if ".in_proj_qkv." in name:
                q, k, v = t[:dk * hk], t[dk * hk:2 * dk * hk], t[2 * dk * hk:]
                t = torch.cat([q, k, reorder_v_heads(v, 0, hk, r, dv)], dim=0)
            elif ".in_proj_z." in name:
                t = reorder_v_heads(t, 0, hk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                t = reorder_v_heads(t, 0, hk, r, 1)
            elif ".A_log" in name or ".dt_bias" in name or ".dt_proj" in name:
                t = reorder_v_heads(t.unsqueeze(-1), 0, hk, r, 1).squeeze(-1)
            elif ".conv1d" in name:
                t = t.squeeze()
                qk = dk * hk * 2
                t = torch.cat([t[:qk], reorder_v_heads(t[qk:], 0, hk, r, dv)], dim=0)
            elif ".out_proj." in name:
                t = reorder_v_heads(t, 1, hk, r, dv)
        # Qwen3NextModel.modify_tensors
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        out[_map(table, name)] = t.numpy()
    return meta, out


# ---- nemotron_h (NemotronHModel -> GraniteHybridModel(Mamba2Model, GraniteMoeModel -> LlamaModel))
def llama_permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """LlamaModel.permute: each head's rotary halves interleaved."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def nemotron_h_gguf(cfg: Any, weights: Mapping[str, torch.Tensor]) -> tuple[Metadata, Tensors]:
    """llama.cpp's nemotron_h form of a (non-MoE) Nemotron-H model: (metadata, tensors)."""
    a, m = cfg.attention, cfg.mamba2
    n = cfg.num_layers
    ssm = [i for i, t in enumerate(cfg.layer_types) if t == "mamba2"]
    att = [i for i, t in enumerate(cfg.layer_types) if t == "attention"]
    mlp = [i for i, t in enumerate(cfg.layer_types) if t == "mlp"]
    # the converter writes some keys twice (GGUFWriter keeps the last value): the scalar
    # context_length, head_count_kv and feed_forward_length of TextModel are replaced by
    # GraniteHybridModel's 2**20 and per-layer kv heads and NemotronHModel's per-layer ff lengths
    meta: Metadata = {
        # TextModel.set_gguf_parameters (GraniteModel drops head_dim: no key_length here)
        "block_count": n,
        "context_length": 2 ** 20,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": [cfg.intermediate_size if i in mlp else 0 for i in range(n)],
        "attention.head_count": a.num_heads,
        "attention.head_count_kv": [a.num_kv_heads if i in att else 0 for i in range(n)],
        "attention.layer_norm_epsilon": float(cfg.rms_norm_eps),  # config's layer_norm_epsilon
        # LlamaModel.set_gguf_parameters
        "vocab_size": cfg.vocab_size,
        "rope.dimension_count": cfg.hidden_size // a.num_heads,
        # GraniteHybridModel.set_gguf_parameters
        "ssm.conv_kernel": m.conv_kernel,
        "ssm.state_size": m.state_size,
        "ssm.group_count": m.n_groups,
        "ssm.inner_size": m.d_inner,
        "ssm.time_step_rank": m.num_heads,
        "rope.scaling.finetuned": False,
        # NemotronHModel.set_gguf_parameters
        "attention.key_length": a.head_dim,
        "attention.value_length": a.head_dim,
    }
    table = name_table("nemotron_h", n)
    out: Tensors = {}
    for name, t in _f32(weights).items():
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if bid in ssm:  # Mamba2Model.modify_tensors
            if name.endswith(".dt_bias"):
                name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
            new = _map(table, name)
            if new == f"blk.{bid}.ssm_conv1d.weight":
                t = t.squeeze()
            elif new in (f"blk.{bid}.ssm_a", f"blk.{bid}.ssm_d"):
                t = t.reshape((*t.shape, 1))
            elif new == f"blk.{bid}.ssm_norm.weight":
                t = t.reshape((m.n_groups, m.d_inner // m.n_groups))
            if name.endswith(".A_log"):
                t = -torch.exp(t)
            out[new] = t.numpy()
            continue
        if bid in att:  # GraniteMoeModel -> LlamaModel.modify_tensors (undo_permute)
            if name.endswith("q_proj.weight"):
                t = llama_permute(t, a.num_heads, a.num_heads)
            if name.endswith("k_proj.weight"):
                t = llama_permute(t, a.num_heads, a.num_kv_heads)
        out[_map(table, name)] = t.numpy()  # ModelBase.modify_tensors
    return meta, out


# ---- dense (LlamaModel / Qwen2Model / Qwen3Model: TextModel's keys; Llama permutes q/k) --------
def dense_meta(cfg: Any) -> Metadata:
    """TextModel.set_gguf_parameters' keys of a dense model (arch-relative)."""
    return {
        "block_count": cfg.num_layers, "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_heads,
        "attention.head_count_kv": cfg.num_kv_heads, "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim, "rope.dimension_count": cfg.head_dim,
        "rope.freq_base": float(cfg.rope.theta),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
    }


def dense_tensors(cfg: Any, weights: Mapping[str, torch.Tensor],
                  type_of: Mapping[str, str] | None = None) -> Tensors:
    """The GGUF tensors of a dense model: llama.cpp's names, Llama's q/k permutation, each
    tensor stored as `type_of.get(hf name)` (F32 when absent)."""
    table = name_table(cfg.gguf_arch, cfg.num_layers)
    out: Tensors = {}
    for hf, t in _f32(weights).items():
        if cfg.gguf_arch == "llama" and "q_proj." in hf:
            t = llama_permute(t, cfg.num_heads, None)
        elif cfg.gguf_arch == "llama" and "k_proj." in hf:
            t = llama_permute(t, cfg.num_heads, cfg.num_kv_heads)
        kind = (type_of or {}).get(hf)
        out[_map(table, hf)] = t.numpy() if kind is None else (t.numpy(), kind)
    return out


def write_dense(path: str | Path, cfg: Any, weights: Mapping[str, torch.Tensor],
                type_of: Mapping[str, str] | None = None) -> Path:
    return write_gguf(path, cfg.gguf_arch, dense_meta(cfg), dense_tensors(cfg, weights, type_of))
