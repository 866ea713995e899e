"""Model families: one module per family (llama, qwen3, qwen2, qwen3_5, kimi_linear, nemotron_h),
each a `ModelConfig` subclass registered with `@register_family`; the checkpoint loader and random
weights (weights.py), GGUF files (gguf.py), where a model comes from (sources.py); `validate`,
the one check of what megakernel supports that the reference, the program, the executor, `plan`,
`build` and the kernel all call."""

from __future__ import annotations

from megakernel.models.config import (
    Block,
    ConfigError,
    ModelConfig,
    RopeConfig,
)
from megakernel.models.registry import (
    FAMILIES,
    config_from_hf_dict,
    config_from_hf_dir,
    family,
    load_all,
    preset,
    presets,
    real_presets,
    register_family,
)

__all__ = [
    "FAMILIES", "Block", "ConfigError", "ModelConfig", "RopeConfig", "config_from_hf_dict",
    "config_from_hf_dir", "family", "load_all", "preset", "presets", "real_presets",
    "register_family", "resolve", "validate",
]

HIDDEN_ALIGN = 64  # hidden size: 16-byte loads in 256-element sweeps, row slabs of 16


def validate(cfg: ModelConfig) -> ModelConfig:
    """ConfigError naming the first shape megakernel does not support (same answer everywhere)."""
    if cfg.hidden_size % HIDDEN_ALIGN:
        raise ConfigError(f"hidden_size = {cfg.hidden_size} must be a multiple of "
                          f"{HIDDEN_ALIGN} for the kernel's tiling")
    from megakernel.layers import kind

    for blk in cfg.blocks:
        kind(blk.kind).check(blk, cfg)
    return cfg


def __getattr__(name: str):  # noqa: ANN202 (PEP 562: `resolve` imported on first use)
    """`resolve` from models/sources.py, imported when first asked for: importing the package
    stays cheap (no family module, no GGUF or safetensors reader)."""
    if name == "resolve":
        from megakernel.models.sources import resolve

        return resolve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
