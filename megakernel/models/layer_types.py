"""What the families with a mixer chosen per layer (Qwen3.5, Kimi Linear, Nemotron-H) share:
`layer_types`, the mixer of each layer in the family's own words, checked against the kinds the
family allows; helpers of their GGUF forms (the inverses of llama.cpp's converter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megakernel.models.config import ConfigError, ModelConfig


@dataclass(frozen=True, kw_only=True)
class LayerTypesConfig(ModelConfig):
    """A model whose layers mix recurrent (linear-attention / SSM) and attention layers.
    `layer_types[i]` is the mixer of layer i, one of the family's `mixers`."""

    mixers: ClassVar[tuple[str, ...]] = ()
    layer_types: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.layer_types:
            raise ConfigError("a model needs at least one layer")
        for i, t in enumerate(self.layer_types):
            if t not in self.mixers:
                raise ConfigError(f"layer {i}: unsupported layer type {t!r} for {self.family}; "
                                  f"supported: {', '.join(self.mixers)}")
        super().__post_init__()

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def ffn_type(self, i: int) -> str:
        """The feed-forward block after the mixer of layer i ("swiglu", "moe" or "none")."""
        return "none"


# ---- GGUF form (models/gguf.py): what the hybrid families' inverses of llama.cpp share ----------
def a_log_from_gguf(name: str, a: torch.Tensor) -> torch.Tensor:
    """A_log from llama.cpp's `ssm_a` = -exp(A_log), computed in fp64: the fp32 result is within
    an ulp or two of A_log (exp then log is not bit-exact; rounded to bf16 it is the bf16 value
    again)."""
    if not bool((a < 0).all()):
        from megakernel.models.weights import WeightError

        raise WeightError(f"GGUF ssm_a of {name!r} must be negative (-exp(A_log)), got "
                          f"max {float(a.max())}")
    return torch.log(-a.double()).to(a.dtype)


def v_heads_grouped(t: torch.Tensor, dim: int, num_k_heads: int, num_v_heads: int,
                    head_dim: int) -> torch.Tensor:
    """Inverse of llama.cpp's `_reorder_v_heads` (Qwen3.5's gated delta rule with Hk < Hv): axis
    `dim` of `t` holds value heads (`head_dim` entries each) in its tiled order [r, Hk] (value
    head j of every key head, then j + 1); back to Hugging Face's grouped order [Hk, r] (the r
    value heads of key head 0 first)."""
    r = num_v_heads // num_k_heads
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], r, num_k_heads, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)
