"""Hybrid linear-attention / SSM models: Qwen3.5 (GDN), Kimi Linear (KDA + MLA + MoE), Nemotron-H
(Mamba2). Configs and presets (config.py), weights (weights.py), greedy generation (decode.py)."""

from .config import (
    PRESETS,
    REAL_PRESETS,
    HybridConfig,
    KimiLinearConfig,
    NemotronHConfig,
    Qwen35Config,
    config_from_hf_dict,
    config_from_hf_dir,
    preset,
    resolve_hybrid,
)
from .decode import generate
from .weights import (
    WeightError,
    expected_shapes,
    load_checkpoint,
    load_model,
    random_weights,
    save_checkpoint,
)

__all__ = [
    "PRESETS",
    "REAL_PRESETS",
    "HybridConfig",
    "KimiLinearConfig",
    "NemotronHConfig",
    "Qwen35Config",
    "WeightError",
    "config_from_hf_dict",
    "config_from_hf_dir",
    "expected_shapes",
    "generate",
    "load_checkpoint",
    "load_model",
    "preset",
    "random_weights",
    "resolve_hybrid",
    "save_checkpoint",
]
