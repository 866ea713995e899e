"""What the families with a mixer chosen per layer (Qwen3.5, Kimi Linear, Nemotron-H) share:
`layer_types`, the mixer of each layer in the family's own words, checked against the kinds the
family allows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
