"""Shared math of the reference layers: rounding, norms, matvec, the short causal conv, segment
sums, RoPE, attention; and `ReferenceError`.

Activations are always fp32 tensors. In "bf16" mode the values that the kernel stores as bf16 are
passed through `store` (round to bf16, back to fp32), and weights are bf16 tensors upcast inside
`linear`; a bf16 x bf16 product is exact in fp32, so `linear` is "bf16 inputs, fp32 accumulation".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megakernel.common.errors import UserError

__all__ = [
    "MODES",
    "HybridError",
    "ReferenceError",
    "linear",
    "rms_norm",
    "store",
    "rms_norm_1p",
    "model_norm",
    "l2norm",
    "softplus",
    "short_conv",
    "shift_window",
    "segsum",
    "rope_tables",
    "apply_partial_rope",
    "attend",
]


MODES = ("fp32", "bf16")


def store(x: torch.Tensor, mode: str) -> torch.Tensor:
    """A kernel store of an activation: rounds to bf16 in "bf16" mode, identity in "fp32" mode."""
    if mode == "bf16":
        return x.to(torch.bfloat16).to(torch.float32)
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim, all in fp32."""
    x = x.to(torch.float32)
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(torch.float32)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out] in fp32 (weight upcast if bf16)."""
    return torch.nn.functional.linear(x.to(torch.float32), weight.to(torch.float32))


class ReferenceError(UserError, ValueError):  # noqa: A001 (shares its name with a builtin on purpose)
    """Bad input to the reference model: token ids, prompts, cache capacity, speculative commits,
    ReplaySSM ring overflow, weights."""


HybridError = ReferenceError  # the hybrid models' former name for it


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of Qwen3.5: `x * rsqrt(mean(x^2) + eps) * (1 + w)`, all fp32."""
    x = x.to(torch.float32)
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * (1.0 + weight.to(torch.float32))


def model_norm(norm_kind: str) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """The RMSNorm of a model's `norm_kind`: "rms" (x * w) or "rms_1p" (x * (1 + w))."""
    if norm_kind == "rms":
        return rms_norm
    if norm_kind == "rms_1p":
        return rms_norm_1p
    raise ReferenceError(f"unknown norm kind {norm_kind!r}; expected 'rms' or 'rms_1p'")


def l2norm(x: torch.Tensor, eps: float = 1e-6, divide: bool = False) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dim. Qwen3.5 multiplies by rsqrt (divide=False),
    Kimi divides by sqrt (divide=True), as the respective HF/FLA code does."""
    ss = (x * x).sum(dim=-1, keepdim=True) + eps
    return x / torch.sqrt(ss) if divide else x * torch.rsqrt(ss)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), linear above 20 (torch's and FLA's threshold), fp32."""
    return F.softplus(x.to(torch.float32), beta=1.0, threshold=20.0)


def short_conv(
    window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Causal depthwise conv of T new inputs after a window of the K-1 previous ones.

    window: [B, C, K-1] fp32, oldest first; x: [B, T, C]; weight: [C, 1, K] (tap K-1 multiplies
    the newest input); bias: [C] or None. Returns the pre-activation output [B, T, C] in fp32.
    """
    k = weight.shape[-1]
    u = torch.cat((window, x.transpose(1, 2).to(torch.float32)), dim=-1)  # [B, C, K-1+T]
    taps = u.unfold(-1, k, 1)  # [B, C, T, K]
    out = (taps * weight.to(torch.float32)[:, 0][None, :, None, :]).sum(-1)  # [B, C, T]
    if bias is not None:
        out = out + bias.to(torch.float32)[None, :, None]
    return out.transpose(1, 2)


def shift_window(window: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The conv window after appending inputs x [B, T, C] to window [B, C, K-1]."""
    km1 = window.shape[-1]
    return torch.cat((window, x.transpose(1, 2).to(torch.float32)), dim=-1)[..., -km1:]


def segsum(g: torch.Tensor) -> torch.Tensor:
    """Segment sums of log-decays g [n, ...] along dim 0: out[t, j] = sum of g[j+1 .. t] for
    j <= t (0 on the diagonal) and -inf above it; shape [n, n, ...].

    Summed from the short segment itself rather than as a difference of long cumulative sums, so
    no precision is lost to cancellation (and exp(out) never overflows)."""
    n = g.shape[0]
    x = g[:, None].expand(n, n, *g.shape[1:])  # x[i, j] = g[i]
    strict = torch.tril(torch.ones(n, n, dtype=torch.bool, device=g.device), diagonal=-1)
    strict = strict.reshape(n, n, *([1] * (g.dim() - 1)))
    x = torch.where(strict, x, torch.zeros((), dtype=g.dtype, device=g.device))
    out = x.cumsum(dim=0)  # out[t, j] = sum_{j < i <= t} g[i]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=g.device))
    causal = causal.reshape(n, n, *([1] * (g.dim() - 1)))
    return torch.where(causal, out, torch.full((), float("-inf"), dtype=g.dtype, device=g.device))


# ---- RoPE and attention -------------------------------------------------------------------------
def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, 2 * len(inv_freq)] in fp32 from float64 angles."""
    angle = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    angle = torch.cat((angle, angle), dim=-1)
    return angle.cos().to(torch.float32), angle.sin().to(torch.float32)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R = cos.shape[-1] dims of x [T, H, D]; cos, sin [T, R]."""
    r = cos.shape[-1]
    if r == 0:
        return x
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((rot, rest), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
           ) -> torch.Tensor:
    """Causal attention of T new queries of one sequence over its cache, fp32.

    q: [T, Hq, Dk] at positions start .. start+T-1; k: [Hkv, S, Dk], v: [Hkv, S, Dv] with
    S = start + T; query head h reads kv head h // (Hq / Hkv). Returns [T, Hq, Dv].
    """
    t, hq, dk = q.shape
    hkv, s, dv = v.shape
    if s != start + t:
        raise AssertionError((s, start, t))
    g = hq // hkv
    q = q.to(torch.float32).reshape(t, hkv, g, dk).permute(1, 2, 0, 3)  # [Hkv, G, T, Dk]
    scores = torch.einsum("hgtd,hsd->hgts", q, k.to(torch.float32)) * scale
    q_pos = start + torch.arange(t, device=q.device)
    visible = torch.arange(s, device=q.device)[None, :] <= q_pos[:, None]  # [T, S]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("hgts,hsd->hgtd", probs, v.to(torch.float32))  # [Hkv, G, T, Dv]
    return out.permute(2, 0, 1, 3).reshape(t, hq, dv)
