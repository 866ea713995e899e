"""Building blocks of the reference decode step: rounding, RMSNorm, matvec, attention.

Activations are always fp32 tensors. In "bf16" mode the values that the kernel stores as bf16 are
passed through `store` (round to bf16, back to fp32), and weights are bf16 tensors upcast inside
`linear`; a bf16 x bf16 product is exact in fp32, so `linear` is "bf16 inputs, fp32 accumulation".
"""

from __future__ import annotations

import torch

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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Attention of T new queries of one sequence over its cached keys, in fp32.

    q: [T, Hq, D], queries at positions start .. start+T-1.
    k, v: [Hkv, S, D] with S = start + T (the cache prefix, new tokens included).
    Query head h reads kv head h // (Hq / Hkv) (grouped-query attention).
    Returns [T, Hq, D].
    """
    t, hq, d = q.shape
    hkv, s, _ = k.shape
    assert s == start + t, (s, start, t)
    g = hq // hkv
    q = q.to(torch.float32).reshape(t, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
    k = k.to(torch.float32)
    v = v.to(torch.float32)
    scores = torch.einsum("hgtd,hsd->hgts", q, k) * d**-0.5  # [Hkv, G, T, S]
    q_pos = start + torch.arange(t, device=q.device)  # [T]
    k_pos = torch.arange(s, device=q.device)  # [S]
    visible = k_pos[None, :] <= q_pos[:, None]  # [T, S], causal
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgts,hsd->hgtd", probs, v)  # [Hkv, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(t, hq, d)
