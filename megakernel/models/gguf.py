"""GGUF checkpoints: a model's config, weights and tokenizer from one `.gguf` file.

The `gguf` package parses the file (header, metadata, tensor directory, memory-mapped data); the
rest is ours. The config comes from the metadata through the family whose `gguf_arch` is the
file's `general.architecture` (`ModelConfig.hf_dict_from_gguf` writes the Hugging Face config
fields, so the family's usual parsing and checks apply). Tensor names are mapped generically: each
Hugging Face name the model expects is looked up in the `gguf` package's name table for that
architecture (the table llama.cpp's converter writes with); llama.cpp's per-tensor transforms are
undone by the family (`ModelConfig.from_gguf_tensor`, e.g. Llama's q/k row permutation). Block
types are dequantized to fp32 by models/gguf_quants.py; F32, F16 and BF16 are read as they are.

A tied model has no `output.weight`: tie_word_embeddings is read from its absence. The tokenizer
is built from the metadata (`tokenizer.ggml.*`, with the chat template) by transformers' GGUF
support, so a bare `.gguf` file takes text prompts.

Every problem is a `WeightError` or `ConfigError` naming the file and, where there is one, the
tensor: not a GGUF file, truncated data, an architecture no family has, a block type not
supported, a missing, unexpected or misshapen tensor, NaN/Inf values.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megakernel.models.config import ConfigError, ModelConfig, expected_shapes
from megakernel.models.gguf_quants import BLOCK_TYPES, dequantize
from megakernel.models.weights import LOAD_DTYPES, WeightError, _finite, _raise, _shape_str

__all__ = ["GGUF_SUFFIX", "GGUFMetadata", "config_from_gguf", "gguf_tokenizer", "is_gguf",
           "load_gguf", "open_gguf"]

GGUF_SUFFIX = ".gguf"
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED_TYPES = (*PLAIN_TYPES, *BLOCK_TYPES)
# metadata arrays read only by the tokenizer (tens of thousands of entries)
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
                     "tokenizer.ggml.token_type")


def is_gguf(spec: str | Path) -> bool:
    """`spec` names a .gguf file (it may not exist: loading says so)."""
    return str(spec).lower().endswith(GGUF_SUFFIX) and not Path(spec).is_dir()


@dataclass(frozen=True)
class GGUFMetadata:
    """The metadata of a GGUF file (tokenizer arrays left out) with typed accessors for the
    architecture's own keys (`{arch}.block_count`, ...): ConfigError naming a missing or
    ill-typed key."""

    arch: str
    values: dict[str, Any]
    tensor_names: frozenset[str]
    tensor_shapes: dict[str, tuple[int, ...]]  # torch order (rows first)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{key}", default)

    def int(self, key: str, default: Any = ...) -> int:
        v = self._need(key, default)
        if isinstance(v, list):
            if not v or len(set(v)) != 1:
                raise ConfigError(f"GGUF key {self.arch}.{key} varies by layer ({v[:8]}...); "
                                  "only uniform layers are supported")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ConfigError(f"GGUF key {self.arch}.{key} must be an integer, got {v!r}")
        return int(v)

    def float(self, key: str, default: Any = ...) -> float:
        """A float key as the decimal the converter wrote: GGUF stores float32 (1e-6 reads back
        as 9.99999997e-07); the shortest decimal that rounds to the same float32 is the config's
        value for any decimal of at most 7 significant digits."""
        if default is not ... and self.get(key) is None:
            return default
        v = self._need(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float | np.number):
            raise ConfigError(f"GGUF key {self.arch}.{key} must be a number, got {v!r}")
        return float(str(np.float32(v)))

    def attention(self) -> tuple[int, int, int]:
        """(query heads, hidden size, head size) of llama.cpp's attention keys, refusing RoPE
        scaling and unequal key/value head sizes."""
        scaling = self.get("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ConfigError(f"unsupported GGUF RoPE scaling {self.arch}.rope.scaling.type="
                              f"{scaling!r}")
        heads = self.int("attention.head_count")
        hidden = self.int("embedding_length")
        head_dim = self.int("attention.key_length", hidden // heads)
        if self.int("attention.value_length", head_dim) != head_dim:
            raise ConfigError(f"GGUF {self.arch}.attention.value_length differs from key_length "
                              f"({head_dim}); only equal head sizes are supported")
        return heads, hidden, head_dim

    def vocab(self) -> dict[str, Any]:
        """vocab_size from the embedding's rows (llama.cpp may pad the token list, never the
        tensor) and tie_word_embeddings from the absence of `output.weight`."""
        if "token_embd.weight" not in self.tensor_names:
            raise ConfigError("GGUF file has no token_embd.weight")
        return {"vocab_size": self.tensor_shapes["token_embd.weight"][0],
                "tie_word_embeddings": "output.weight" not in self.tensor_names}

    def _need(self, key: str, default: Any) -> Any:
        v = self.get(key)
        if v is None:
            if default is ...:
                raise ConfigError(f"GGUF metadata has no {self.arch}.{key}")
            return default
        return v


class GGUFFile:
    """An open GGUF file (an existing one: `open_gguf`): its metadata and tensor directory
    (data memory-mapped, read per tensor)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            from gguf import GGUFReader
        except ImportError as e:
            raise WeightError(f"reading {self.path.name} needs the gguf package ({e})") from None
        try:
            self.reader = GGUFReader(str(self.path), "r")
        except Exception as e:  # the reader raises ValueError, struct and numpy errors alike
            raise WeightError(f"{self.path.name} is not a readable GGUF file (truncated or "
                                f"corrupt): {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    @cached_property
    def metadata(self) -> GGUFMetadata:
        values = {k: _field_value(f) for k, f in self.reader.fields.items()
                  if k not in _TOKENIZER_ARRAYS}
        arch = values.get("general.architecture")
        if not isinstance(arch, str):
            raise ConfigError(f"{self.path.name} has no general.architecture")
        shapes = {n: tuple(int(x) for x in reversed(t.shape)) for n, t in self.tensors.items()}
        return GGUFMetadata(arch, values, frozenset(self.tensors), shapes)

    def raw(self, name: str) -> tuple[str, torch.Tensor]:
        """(type name, the tensor's bytes as uint8) of tensor `name`, its size checked."""
        t = self.tensors[name]
        type_name = t.tensor_type.name
        data = np.asarray(t.data)
        if data.nbytes != int(t.n_bytes):
            raise WeightError(f"tensor {name!r} in {self.path.name} holds {data.nbytes} bytes, "
                                f"its header says {int(t.n_bytes)} (truncated file?)")
        # a copy: the file's mapping is read-only, and the tensor must outlive the reader
        return type_name, torch.from_numpy(np.array(data, copy=True).view(np.uint8).reshape(-1))


def _field_value(field: Any) -> Any:
    try:
        v = field.contents()
    except Exception:  # a field the gguf package cannot decode: left out, never needed by us
        return None
    return v


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file, shared by the calls that read one file in turn (its config, weights and
    tokenizer, a plan): parsing the metadata of a model with a 50K-token vocabulary takes
    seconds. Keyed by path, size and modification time, so a rewritten file is parsed again."""
    p = Path(path)
    if not p.is_file():
        raise WeightError(f"GGUF file {str(p)!r} does not exist")
    st = p.stat()
    return _parsed(str(p.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=2)
def _parsed(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def _family_config(f: GGUFFile) -> ModelConfig:
    from megakernel.models.registry import config_from_hf_dict, gguf_family

    meta = f.metadata
    fam = gguf_family(meta.arch, f.path.name)
    return config_from_hf_dict(fam.cls.hf_dict_from_gguf(meta), name=f.path.stem)


def config_from_gguf(path: str | Path) -> ModelConfig:
    """The model config of a GGUF file, from its metadata (no tensor data read)."""
    return _family_config(open_gguf(path))


def _gguf_names(cfg: ModelConfig, arch: str) -> dict[str, str]:
    """Every Hugging Face tensor name `cfg` expects -> its GGUF name (llama.cpp's table)."""
    import gguf

    arch_ids = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    table = gguf.get_tensor_name_map(arch_ids[arch], len({b.layer for b in cfg.blocks}))
    out, unmapped = {}, []
    for ours in expected_shapes(cfg):
        theirs = table.get_name(cfg.gguf_source_name(ours), try_suffixes=(".weight", ".bias"))
        if theirs is None:
            unmapped.append(ours)
        else:
            out[ours] = theirs
    if unmapped:
        raise ConfigError(f"GGUF architecture {arch!r} has no tensor name for {unmapped[0]!r}"
                          + (f" (and {len(unmapped) - 1} more)" if len(unmapped) > 1 else ""))
    return out


def _check_directory(f: GGUFFile, cfg: ModelConfig, names: dict[str, str]) -> None:
    want, meta = expected_shapes(cfg), f.metadata
    problems = []
    for ours, theirs in names.items():
        if theirs not in meta.tensor_names:
            problems.append(f"missing tensor {theirs!r} (for {ours!r}, shape "
                            f"{_shape_str(want[ours])})")
            continue
        shape, type_name = meta.tensor_shapes[theirs], f.tensors[theirs].tensor_type.name
        exp = cfg.gguf_shape(ours, want[ours])
        if shape != exp:
            problems.append(f"tensor {theirs!r} has shape {_shape_str(shape)}, expected "
                            f"{_shape_str(exp)} for {ours!r}")
        elif type_name not in SUPPORTED_TYPES:
            problems.append(f"tensor {theirs!r} has GGUF type {type_name}, not supported "
                            f"(supported: {', '.join(SUPPORTED_TYPES)})")
    # llama.cpp's precomputed RoPE factors (llama3 scaling) have no Hugging Face tensor
    used = set(names.values())
    for theirs in sorted(meta.tensor_names - used):
        if theirs == "rope_freqs.weight":
            problems.append("tensor 'rope_freqs.weight' (llama.cpp's precomputed RoPE scaling "
                            "factors, e.g. llama3 scaling) is not supported")
        else:
            problems.append(f"unexpected tensor {theirs!r} (not part of this {cfg.num_layers}-"
                            f"layer {cfg.family} model)")
    _raise(problems)


def _tensors(f: GGUFFile, cfg: ModelConfig, names: dict[str, str]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor in fp32 or its plain dtype) one at a time, transforms undone."""
    want = expected_shapes(cfg)
    for ours, theirs in names.items():
        type_name, raw = f.raw(theirs)
        shape = cfg.gguf_shape(ours, want[ours])
        if type_name in PLAIN_TYPES:
            t = raw.view(PLAIN_TYPES[type_name]).reshape(shape)
        else:
            try:
                t = dequantize(raw, type_name, int(np.prod(shape))).reshape(shape)
            except ValueError as e:
                raise WeightError(f"tensor {theirs!r} in {f.path.name}: {e}") from None
        if not _finite(t):
            raise WeightError(f"tensor {theirs!r} in {f.path.name} holds NaN or Inf values")
        t = cfg.from_gguf_tensor(ours, t)
        if tuple(t.shape) != want[ours]:  # a family's transform that does not invert its shape
            raise ValueError(f"{cfg.family}.from_gguf_tensor gave {ours!r} the shape "
                             f"{tuple(t.shape)}, expected {want[ours]}")
        yield ours, t


def load_gguf(path: str | Path, dtype: torch.dtype | None = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and weights (Hugging Face names) of a GGUF file. `dtype=None` keeps F32/F16/BF16
    tensors as stored and block-quantized ones in fp32 (their exact dequantized values);
    otherwise every tensor is converted to `dtype`, one at a time."""
    from megakernel.common.progress import stage

    if dtype is not None and dtype not in LOAD_DTYPES:
        raise WeightError(f"unsupported dtype {dtype}; use torch.bfloat16, float16 or float32")
    f = open_gguf(path)
    cfg = _family_config(f)
    names = _gguf_names(cfg, f.metadata.arch)
    _check_directory(f, cfg, names)
    weights: dict[str, torch.Tensor] = {}
    with stage(f"reading {len(names)} GGUF tensors from {f.path.name}",
               quiet=f.path.stat().st_size < 5e8):
        for ours, t in _tensors(f, cfg, names):
            weights[ours] = t.to(t.dtype if dtype is None else dtype).contiguous()
    return cfg, weights


def gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer a GGUF file's metadata describes (transformers builds it, chat template
    included); ConfigError when the file has none."""
    f = open_gguf(path)
    if "tokenizer.ggml.model" not in f.reader.fields:
        raise ConfigError(f"{f.path.name} has no tokenizer (no tokenizer.ggml.model in its "
                          "metadata); use token ids")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError(f"text prompts on a GGUF file need the transformers package ({e})"
                          ) from None
    try:
        return AutoTokenizer.from_pretrained(str(f.path.parent), gguf_file=f.path.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ConfigError(f"cannot build the tokenizer of {f.path.name}: {e}") from None
