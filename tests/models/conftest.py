"""Fixtures of the model-family tests: transformers classes of each family (the oracle, from
tests/layers/helpers.py), their configs, tiny dense transformers models, the torch reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from megakernel.models import ModelConfig
from tests.layers import helpers


@pytest.fixture
def hf_classes() -> Callable[[str], tuple[type, type]]:
    """family -> (transformers config class, transformers model class): the oracle table of
    tests/layers/helpers.py."""
    return helpers.hf_classes


@pytest.fixture
def hf_config(hf_classes: Callable[[str], tuple[type, type]]
              ) -> Callable[..., Any]:
    """(cfg, **extra) -> the transformers config object of `cfg.to_hf_dict()`."""

    def make(cfg: ModelConfig, **extra: Any) -> Any:
        return hf_classes(cfg.family)[0](**cfg.to_hf_dict(), **extra)

    return make


@pytest.fixture
def dense_hf_model(hf_classes: Callable[[str], tuple[type, type]]
                   ) -> Callable[..., torch.nn.Module]:
    """(cfg, seed=0) -> a transformers model of a dense family, initialised at std 0.1.

    transformers initialises norm weights to ones and biases to zeros; they are perturbed by
    N(0, 0.1^2) so that a mix-up of names would show.
    """

    def make(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
        cfg_cls, model_cls = hf_classes(cfg.family)
        torch.manual_seed(seed)
        model = model_cls(cfg_cls(**cfg.to_hf_dict(), initializer_range=0.1)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", ".bias")):
                    p.add_(0.1 * torch.randn(p.shape))
        return model

    return make


@pytest.fixture
def reference_model() -> Callable[..., Any]:
    """(cfg, weights, mode="fp32") -> the torch reference model of any family (prefill,
    new_cache, ...), and `reference_model.generate`: greedy decoding."""
    from megakernel.reference.model import ReferenceModel, generate

    def make(cfg: ModelConfig, weights: dict[str, torch.Tensor], mode: str = "fp32") -> Any:
        return ReferenceModel(cfg, weights, mode=mode)

    make.generate = generate  # type: ignore[attr-defined]
    return make
