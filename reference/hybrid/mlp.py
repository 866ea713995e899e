"""Dense feed-forward blocks: SwiGLU (Qwen3.5, Kimi dense layers, experts) and relu^2 (Nemotron-H).

The intermediate activation is the down projection's input, so it is rounded in "bf16" mode.
"""

from __future__ import annotations

import torch

from .common import linear, store


class SwiGLU:
    """down(silu(gate x) * up x), weights `{p}{gate,up,down}_proj.weight` (or given directly)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, mode: str):
        self.gate, self.up, self.down, self.mode = gate, up, down, mode

    @classmethod
    def from_prefix(cls, w: dict[str, torch.Tensor], p: str, mode: str) -> SwiGLU:
        return cls(w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"],
                   mode)

    def __call__(self, xn: torch.Tensor) -> torch.Tensor:
        act = torch.nn.functional.silu(linear(xn, self.gate)) * linear(xn, self.up)
        return linear(store(act, self.mode), self.down)


class Relu2MLP:
    """down(relu(up x)^2), Nemotron-H's MLP block (no gate)."""

    def __init__(self, w: dict[str, torch.Tensor], p: str, mode: str):
        self.up, self.down, self.mode = w[p + "up_proj.weight"], w[p + "down_proj.weight"], mode

    def __call__(self, xn: torch.Tensor) -> torch.Tensor:
        act = torch.relu(linear(xn, self.up)).square()
        return linear(store(act, self.mode), self.down)
