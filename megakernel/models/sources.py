"""Where a model comes from: a preset name (random weights), a Hugging Face checkpoint directory
or a GGUF file. `resolve` gives the config alone (no tensor read), `load_model` config and
weights; every command and the API take a model through these two."""

from __future__ import annotations

from pathlib import Path

import torch

from megakernel.models.config import ConfigError, ModelConfig
from megakernel.models.gguf import config_from_gguf, is_gguf, load_gguf
from megakernel.models.registry import config_from_hf_dir, presets
from megakernel.models.weights import load_checkpoint, random_weights

__all__ = ["load_model", "resolve"]


def resolve(spec: str) -> ModelConfig:
    """The config of a preset name, a Hugging Face checkpoint directory or a GGUF file."""
    if spec in presets():
        return presets()[spec]
    if Path(spec).is_dir():
        return config_from_hf_dir(spec)
    if is_gguf(spec):
        return config_from_gguf(spec)
    raise ConfigError(f"{spec!r} is neither a preset ({', '.join(presets())}), a checkpoint "
                      "directory nor a .gguf file")


def load_model(spec: str, seed: int = 0, dtype: torch.dtype | None = torch.bfloat16
               ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A preset name -> random weights from `seed`; a directory or a .gguf file -> its checkpoint
    in `dtype` (None: as stored)."""
    if spec in presets():
        cfg = presets()[spec]
        return cfg, random_weights(cfg, seed, dtype or torch.bfloat16)
    if Path(spec).is_dir():
        return load_checkpoint(spec, dtype=dtype)
    if is_gguf(spec):
        return load_gguf(spec, dtype=dtype)
    resolve(spec)  # raises the error naming every preset
    raise ConfigError(f"cannot load {spec!r}")
