"""Where a model comes from: a preset name (random weights), a Hugging Face checkpoint directory
or a GGUF file. `resolve` gives the config alone (no tensor read), `load_model` config and
weights; every command and the API take a model through these two.

`weights="fp8"` (`--weights fp8`) quantizes a bf16 model on load, with scales per output channel
(`granularity="channel"`) or per 128x128 block (`"block"`), the LM head too with `lm_head=True`:
the config gets `quant` and the weights are the FP8 form (models/fp8.py). A checkpoint that is
already FP8 keeps its own format whatever `weights` says ("bf16", the default, means the
checkpoint's own form), so `resolve` and `load_model` agree on the config either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from megakernel.models import fp8
from megakernel.models.config import ConfigError, ModelConfig
from megakernel.models.gguf import config_from_gguf, is_gguf, load_gguf
from megakernel.models.registry import config_from_hf_dir, presets
from megakernel.models.weights import (
    LazyRandomWeights,
    load_checkpoint,
    quantize_weights,
    random_weights,
)

__all__ = ["load_model", "resolve"]


def _format(weights: str | None, granularity: str, lm_head: bool) -> fp8.Fp8Format | None:
    """The FP8 format `weights=` asks for (None: the model's own form); ConfigError naming a
    bad value."""
    if not isinstance(lm_head, bool):
        raise ConfigError(f"lm_head must be a bool, got {lm_head!r}")
    fmt = fp8.Fp8Format(granularity, lm_head=lm_head)  # validated even when unused
    return fmt if fp8.parse_weights(weights) == "fp8" else None


def _with(cfg: ModelConfig, fmt: fp8.Fp8Format | None) -> ModelConfig:
    """`cfg` in format `fmt`, unless it is FP8 already (its own format wins)."""
    return cfg if fmt is None or cfg.quant is not None else cfg.replace(quant=fmt)


def resolve(spec: str, weights: str = "bf16", granularity: str = "channel",
            lm_head: bool = False) -> ModelConfig:
    """The config of a preset name, a Hugging Face checkpoint directory or a GGUF file, with
    `quant` set as `load_model(spec, weights=..., granularity=..., lm_head=...)` sets it."""
    fmt = _format(weights, granularity, lm_head)
    if spec in presets():
        return _with(presets()[spec], fmt)
    if Path(spec).is_dir():
        return _with(config_from_hf_dir(spec), fmt)
    if is_gguf(spec):
        return _with(config_from_gguf(spec), fmt)
    raise ConfigError(f"{spec!r} is neither a preset ({', '.join(presets())}), a checkpoint "
                      "directory nor a .gguf file")


def load_model(spec: str, seed: int = 0, dtype: torch.dtype | None = torch.bfloat16,
               weights: str = "bf16", granularity: str = "channel", lm_head: bool = False,
               mtp: bool = False) -> tuple[ModelConfig, Mapping[str, torch.Tensor]]:
    """A preset name -> random weights from `seed`; a directory or a .gguf file -> its checkpoint
    in `dtype` (None: as stored).

    `weights="fp8"` returns the FP8 form (e4m3 codes plus `_scale` grids for the names of
    `fp8.quantized_names`, `dtype` for the rest) with `cfg.quant = Fp8Format(granularity,
    lm_head=lm_head)`, each matrix quantized as it is loaded; a preset's weights then come as
    a lazy mapping that draws and quantizes a matrix when it is read. An FP8 checkpoint loads
    in its own format for either value (no requantization). `mtp`: a checkpoint directory's
    multi-token-prediction modules are loaded too (the `mtp:K` drafter; weights.load_checkpoint).
    """
    fmt = _format(weights, granularity, lm_head)
    if spec in presets():
        cfg = presets()[spec]
        if fmt is None:
            return cfg, random_weights(cfg, seed, dtype or torch.bfloat16)
        cfg = _with(cfg, fmt)
        base = (LazyRandomWeights(cfg, seed) if dtype in (None, torch.bfloat16)
                else random_weights(cfg, seed, dtype))
        return cfg, fp8.QuantizedWeights(cfg, base)
    if Path(spec).is_dir():
        return load_checkpoint(spec, dtype=dtype, quant=fmt, mtp=mtp)
    if is_gguf(spec):
        cfg, w = load_gguf(spec, dtype=dtype)
        if fmt is None:
            return cfg, w
        cfg = _with(cfg, fmt)
        return cfg, quantize_weights(cfg, w)
    resolve(spec)  # raises the error naming every preset
    raise ConfigError(f"cannot load {spec!r}")
