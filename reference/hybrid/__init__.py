"""Torch reference models for the hybrid families (Qwen3.5, Kimi Linear, Nemotron-H), recurrent or
ReplaySSM; see model.py for the API, cache layout and bf16 rounding points, replay.py for
ReplaySSM."""

from __future__ import annotations

import torch

from megakernel.hybrid.config import HybridConfig

from .common import HybridError
from .kimi_linear import KimiLinearModel
from .model import HybridCache, HybridModel, generate
from .nemotron_h import NemotronHModel
from .qwen35 import Qwen35Model
from .replay import DEFAULT_WINDOW

MODEL_CLASSES: dict[str, type[HybridModel]] = {
    "qwen3_5": Qwen35Model,
    "kimi_linear": KimiLinearModel,
    "nemotron_h": NemotronHModel,
}


def build_model(cfg: HybridConfig, weights: dict[str, torch.Tensor], mode: str = "fp32",
                device: torch.device | str = "cpu", replay_window: int | None = None
                ) -> HybridModel:
    """The reference model of `cfg.family`."""
    return MODEL_CLASSES[cfg.family](cfg, weights, mode=mode, device=device,
                                     replay_window=replay_window)


__all__ = [
    "DEFAULT_WINDOW",
    "HybridCache",
    "HybridError",
    "HybridModel",
    "KimiLinearModel",
    "MODEL_CLASSES",
    "NemotronHModel",
    "Qwen35Model",
    "build_model",
    "generate",
]
