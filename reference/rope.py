"""Rotary position embedding (rotate-half form, as in Llama and Qwen3).

The angle of frequency i at position p is `inv_freq[i] * p`, with `inv_freq` taken from
`RopeConfig.inv_freq` (float64, llama3 scaling already applied). The angle, cos and sin are computed
in float64 and rounded once to fp32, so every implementation that follows the same recipe gets the
same fp32 tables bit for bit. Rotation itself happens in fp32.
"""

from __future__ import annotations

import torch

from megakernel.config import ModelConfig


def inv_freq_tensor(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies [D / 2] in float64 on `device`."""
    return torch.tensor(cfg.rope.inv_freq(cfg.head_dim), dtype=torch.float64, device=device)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [*positions.shape, D] in fp32 for integer `positions`.

    The half-size table is repeated twice along the last dim to match rotate_half.
    """
    angle = positions.to(torch.float64)[..., None] * inv_freq  # [..., D/2] float64
    angle = torch.cat((angle, angle), dim=-1)  # [..., D]
    return angle.cos().to(torch.float32), angle.sin().to(torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] along the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, T, H, D] by tables `cos`, `sin` [B, T, D] (fp32 in, fp32 out)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    return x * cos + rotate_half(x) * sin
