"""Rotary position embedding parameters (`RopeConfig`), shared by the model configs and the
attention layer kinds. It imports only megakernel.common.errors, so that the layer kinds need
nothing from megakernel.models (which finds them through their registry)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megakernel.common.errors import ConfigError

ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is "default" or "llama3" (Llama 3.1 scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        if not self.theta > 0:
            raise ConfigError(f"rope theta must be positive, got {self.theta}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                "llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}")

    def inv_freq(self, dims: int) -> list[float]:
        """Inverse frequencies [dims // 2] in float64 for `dims` rotated dimensions, with llama3
        scaling applied."""
        inv = [1.0 / (self.theta ** (2 * i / dims)) for i in range(dims // 2)]
        if self.rope_type == "default":
            return inv
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / self.factor)
            else:
                smooth = (old / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor)
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out
