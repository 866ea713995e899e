"""relu^2 feed-forward block of Nemotron-H: down(relu(up x)^2), no gate.

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
class Relu2MLP(ReferenceLayer):
    """down(relu(up x)^2), weights `{p}{up,down}_proj.weight`."""

    kind = "relu2"

    def __init__(self, w: dict[str, torch.Tensor], p: str, mode: str):
        self.up, self.down, self.mode = w[p + "up_proj.weight"], w[p + "down_proj.weight"], mode

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> Relu2MLP:
        return cls(w, blk.prefix, mode)

    def __call__(self, xn: torch.Tensor) -> torch.Tensor:
        """xn [..., D] (normed, stored) -> [..., D] fp32."""
        act = torch.relu(linear(xn, self.up)).square()
        return linear(store(act, self.mode), self.down)

    def forward(self, xn: torch.Tensor, cache: Any = None, lengths: torch.Tensor | None = None,
                replay: bool = False, prefill: bool = False) -> torch.Tensor:
        return self(xn)
