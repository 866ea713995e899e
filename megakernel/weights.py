"""Weights: the Hugging Face tensor layout, checkpoint loading, and seeded random weights.

Weights are a plain `dict[str, torch.Tensor]` keyed by Hugging Face names, linear weights
[out, in] as in torch. A tied model has no "lm_head.weight" entry: the LM head reads
"model.embed_tokens.weight".

Loading opens safetensors files lazily and converts one tensor at a time, so the host never holds
two copies of the model (an 8B checkpoint loads in about its own size of RAM). Every name and
shape is checked against `expected_shapes(cfg)` from the file headers before any data is read.

Random weights are drawn per tensor from a generator seeded by (seed, tensor name), at scales that
keep the residual stream bounded over many layers (see `init_scale`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from megakernel.config import PRESETS, ModelConfig, resolve_model

__all__ = [
    "WeightError",
    "expected_shapes",
    "load_checkpoint",
    "random_weights",
    "load_model",
]

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Buffers some exporters write that carry no parameters (recomputed from the config).
_HARMLESS_EXTRA = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

# safetensors dtype strings we accept, and their torch dtypes.
_DISK_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class WeightError(ValueError):
    """A checkpoint is missing, incomplete, or does not match its config."""


# ---- layout -------------------------------------------------------------------------------------
def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name of `cfg`'s model -> its shape, in checkpoint order."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, h)}
    for layer in range(cfg.num_layers):
        p = layer_prefix(layer)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes[FINAL_NORM] = (h,)
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, h)
    return shapes


# ---- checkpoint loading ------------------------------------------------------------------------
def _tensor_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded index)."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightError(
                f"{index} is not a safetensors index with a 'weight_map': {e}"
            ) from None
        files = {name: root / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise WeightError(f"shard {f.name} listed in {INDEX_FILE} is missing from {root}")
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise WeightError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")


def _by_file(files: dict[str, Path]) -> dict[Path, list[str]]:
    groups: dict[Path, list[str]] = {}
    for name, f in files.items():
        groups.setdefault(f, []).append(name)
    return groups


def _headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, safetensors dtype string), read from the file headers only."""
    from safetensors import safe_open

    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path, names in _by_file(files).items():
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise WeightError(
                        f"tensor {name!r} is listed in {INDEX_FILE} but absent from {path.name}"
                    )
                s = f.get_slice(name)
                out[name] = (tuple(s.get_shape()), s.get_dtype())
    return out


def _shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def _check_headers(
    cfg: ModelConfig, headers: dict[str, tuple[tuple[int, ...], str]]
) -> None:
    """Raise one WeightError listing every missing, unexpected, misshaped or mistyped tensor."""
    want = expected_shapes(cfg)
    problems: list[str] = []
    for name, shape in want.items():
        if name not in headers:
            problems.append(f"missing tensor {name!r} (expected shape {_shape_str(shape)})")
    for name, (shape, dt) in headers.items():
        if name == LM_HEAD and cfg.tie_word_embeddings:
            want_shape = want[EMBED]  # a tied duplicate; checked for equality when loaded
        elif name in want:
            want_shape = want[name]
        elif _HARMLESS_EXTRA.search(name):
            continue
        else:
            problems.append(
                f"unexpected tensor {name!r} with shape {_shape_str(shape)} "
                f"(not part of a {cfg.num_layers}-layer {cfg.family} model)"
            )
            continue
        if shape != want_shape:
            problems.append(
                f"tensor {name!r} has shape {_shape_str(shape)}, expected {_shape_str(want_shape)}"
            )
        elif dt not in _DISK_DTYPES:
            problems.append(
                f"tensor {name!r} has dtype {dt}; supported on disk: {', '.join(_DISK_DTYPES)}"
            )
    if problems:
        more = f" (and {len(problems) - 8} more problems)" if len(problems) > 8 else ""
        raise WeightError("; ".join(problems[:8]) + more)


def _iter_tensors(files: dict[str, Path], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, each file opened once, in `names` order per file."""
    from safetensors import safe_open

    wanted = set(names)
    for path, in_file in _by_file(files).items():
        todo = [n for n in in_file if n in wanted]
        if not todo:
            continue
        with safe_open(str(path), framework="pt") as f:
            for name in todo:
                yield name, f.get_tensor(name)


def load_checkpoint(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a Hugging Face Llama/Qwen3 directory (config.json + safetensors, single or sharded).

    `dtype=None` keeps each tensor's dtype from disk (bf16, fp16 or fp32); otherwise every tensor
    is converted to `dtype`. Conversion and the move to `device` happen tensor by tensor, so the
    host holds at most one unconverted tensor at a time. A tied model's duplicate
    "lm_head.weight" is checked to equal the embedding and dropped.
    """
    root = Path(path)
    if not root.is_dir():
        raise WeightError(f"checkpoint directory {str(root)!r} does not exist")
    if dtype is not None and dtype not in _DISK_DTYPES.values():
        raise WeightError(f"unsupported dtype {dtype}; use torch.bfloat16, float16 or float32")
    cfg = ModelConfig.from_hf_dir(root)
    files = _tensor_files(root)
    headers = _headers(files)
    _check_headers(cfg, headers)

    want = expected_shapes(cfg)
    names = [n for n in headers if n in want]
    duplicate_head = cfg.tie_word_embeddings and LM_HEAD in headers
    if duplicate_head:
        names.append(LM_HEAD)
    weights: dict[str, torch.Tensor] = {}
    head_matches: bool | None = None
    for name, raw in _iter_tensors(files, names):
        if name == LM_HEAD and duplicate_head:
            # Compare against the on-disk embedding (re-read it: the stored copy may be converted).
            head_matches = _equals_embedding(files, raw)
            del raw
            continue
        weights[name] = raw.to(device=device, dtype=raw.dtype if dtype is None else dtype)
        del raw  # drop the unconverted tensor before reading the next one
    if head_matches is False:
        raise WeightError(
            f"{LM_HEAD!r} differs from {EMBED!r} but config.json sets tie_word_embeddings=true"
        )
    return cfg, {n: weights[n] for n in want}


def _equals_embedding(files: dict[str, Path], head: torch.Tensor) -> bool:
    for _, emb in _iter_tensors(files, [EMBED]):
        return emb.dtype == head.dtype and torch.equal(emb, head)
    return False


# ---- random weights ----------------------------------------------------------------------------
def _generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from (seed, tensor name): each tensor is independent of the others."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


QK_GAIN = 2.0  # q, k entries of RMS ~2: attention scores with std ~4, selective like trained ones
RESIDUAL_GAIN = 2.0  # each layer's additions to the residual stream, against the embedding


def init_scale(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the random init of tensor `name` with `shape`.

    - norms: 1 + N(0, 0.1^2); Qwen3's q/k norms: QK_GAIN * (1 + N(0, 0.1^2));
    - q, k: N(0, QK_GAIN^2/fan_in), v, gate, up: N(0, 1/fan_in), so v/gate/up outputs have unit
      variance and attention scores q.k/sqrt(D) have std ~QK_GAIN^2 (with std ~1, attention is
      nearly uniform and greedy decoding soon repeats one token; sharper attention keeps the
      generated tokens varied, which makes token-level comparisons meaningful);
    - o_proj, down_proj: N(0, RESIDUAL_GAIN^2/(fan_in * 2 * num_layers)): the 2 * num_layers
      residual additions sum to a variance that does not depend on depth, so the stream neither
      grows nor vanishes over many layers;
    - embedding (and untied LM head): N(0, 1/hidden). Small against the layers' additions, so a
      tied LM head does not just echo the input token; logits come out with std about 1.
    """
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return QK_GAIN, 0.1 * QK_GAIN
    if len(shape) == 1:
        return 1.0, 0.1
    if name in (EMBED, LM_HEAD):
        return 0.0, 1.0 / math.sqrt(cfg.hidden_size)
    fan_in = shape[-1]
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0.0, QK_GAIN / math.sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, RESIDUAL_GAIN / math.sqrt(fan_in * 2 * cfg.num_layers)
    return 0.0, 1.0 / math.sqrt(fan_in)


def random_weights(
    cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Deterministic random weights for `cfg` (see `init_scale` for the scales).

    Values are drawn in bf16 and then converted, so every dtype of one seed holds the same
    (bf16-representable) model: an fp32 run and a bf16 run describe one set of weights.
    """
    if dtype not in _DISK_DTYPES.values():
        raise WeightError(f"unsupported dtype {dtype}; use torch.bfloat16, float16 or float32")
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        mean, std = init_scale(cfg, name, shape)
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.normal_(mean, std, generator=_generator(seed, name))  # one pass, in bf16
        out[name] = t if dtype == torch.bfloat16 else t.to(dtype)
    return out


def load_model(
    spec: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A preset name -> random weights from `seed`; a directory -> its checkpoint in `dtype`."""
    if spec in PRESETS:
        cfg = PRESETS[spec]
        return cfg, random_weights(cfg, seed, dtype)
    if Path(spec).is_dir():
        return load_checkpoint(spec, dtype=dtype)
    resolve_model(spec)  # raises the error naming every preset
    raise AssertionError("unreachable")
