"""SwiGLU feed-forward block (Llama, Qwen3, Qwen2, Qwen3.5, Kimi dense layers and experts):
down(silu(gate x) * up x).

The intermediate activation is the down projection's input, so it is rounded in "bf16" mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .base import ReferenceLayer, register_layer
from .common import linear, store

if TYPE_CHECKING:
    from megakernel.models.config import Block, ModelConfig


@register_layer
class SwiGLU(ReferenceLayer):
    """down(silu(gate x) * up x), weights `{p}{gate,up,down}_proj.weight` (or given directly)."""

    kind = "swiglu"

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, mode: str):
        self.gate, self.up, self.down, self.mode = gate, up, down, mode

    @classmethod
    def from_prefix(cls, w: dict[str, torch.Tensor], p: str, mode: str) -> SwiGLU:
        return cls(w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"],
                   mode)

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> SwiGLU:
        return cls.from_prefix(w, blk.prefix, mode)

    def __call__(self, xn: torch.Tensor) -> torch.Tensor:
        """xn [..., D] (normed, stored) -> [..., D] fp32."""
        act = torch.nn.functional.silu(linear(xn, self.gate)) * linear(xn, self.up)
        return linear(store(act, self.mode), self.down)

    def forward(self, xn: torch.Tensor, cache: Any = None, lengths: torch.Tensor | None = None,
                replay: bool = False, prefill: bool = False) -> torch.Tensor:
        return self(xn)
