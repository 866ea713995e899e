"""Softmax attention layers with a KV cache: Qwen3.5 gated attention and Nemotron-H attention.

Qwen3.5: q_proj gives [q | gate] per head; q, k get the (1 + w) RMSNorm per head, then RoPE on
the first `rotary_dim` dims (rotate-half); the attention output is multiplied by sigmoid(gate).
Nemotron-H: plain grouped-query attention without RoPE.

KV cache layout (`KVLayerCache`): k, v [B, Hkv, S_max, D], NaN in unwritten slots; fp32 in "fp32"
mode, bf16 in "bf16" mode (k after norm and RoPE). Positions come from `lengths` [B].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.hybrid.config import AttentionConfig

from .common import apply_partial_rope, attend, linear, rms_norm_1p, rope_tables, store


@dataclass
class KVLayerCache:
    k: torch.Tensor  # [B, Hkv, S_max, Dk]
    v: torch.Tensor  # [B, Hkv, S_max, Dv]

    def row(self, b: int) -> KVLayerCache:
        return KVLayerCache(self.k[b : b + 1], self.v[b : b + 1])


def new_kv_cache(batch: int, heads: int, max_len: int, dk: int, dv: int, mode: str,
                 device: torch.device | str) -> KVLayerCache:
    dt = torch.bfloat16 if mode == "bf16" else torch.float32
    nan = float("nan")
    return KVLayerCache(torch.full((batch, heads, max_len, dk), nan, dtype=dt, device=device),
                        torch.full((batch, heads, max_len, dv), nan, dtype=dt, device=device))


class Attention:
    """One attention layer (weights under prefix `p`)."""

    def __init__(self, cfg: AttentionConfig, w: dict[str, torch.Tensor], p: str, eps: float,
                 mode: str, device: torch.device | str):
        self.cfg, self.eps, self.mode = cfg, eps, mode
        self.w = {n[len(p):]: t for n, t in w.items() if n.startswith(p)}
        self.inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float64, device=device)

    def new_cache(self, batch: int, max_len: int, device: torch.device | str) -> KVLayerCache:
        c = self.cfg
        return new_kv_cache(batch, c.num_kv_heads, max_len, c.head_dim, c.head_dim, self.mode,
                            device)

    def __call__(self, xn: torch.Tensor, cache: KVLayerCache, lengths: torch.Tensor
                 ) -> torch.Tensor:
        """xn [B, T, D] (normed, stored) -> output [B, T, D]; appends T keys/values per sequence
        at positions lengths[b] .. lengths[b]+T-1 (lengths itself is advanced by the caller)."""
        c = self.cfg
        b, t, _ = xn.shape
        q = linear(xn, self.w["q_proj.weight"])
        gate = None
        if c.output_gate:
            q, gate = q.reshape(b, t, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, t, c.num_heads * c.head_dim)
        q = q.reshape(b, t, c.num_heads, c.head_dim)
        k = linear(xn, self.w["k_proj.weight"]).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = linear(xn, self.w["v_proj.weight"]).reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm_1p(q, self.w["q_norm.weight"], self.eps)
            k = rms_norm_1p(k, self.w["k_norm.weight"], self.eps)
        outs = []
        for i in range(b):
            start = int(lengths[i])
            qi, ki = q[i], k[i]
            if c.rotary_dim:
                pos = torch.arange(start, start + t, device=xn.device)
                cos, sin = rope_tables(self.inv_freq, pos)
                qi, ki = apply_partial_rope(qi, cos, sin), apply_partial_rope(ki, cos, sin)
            kv_dt = cache.k.dtype
            cache.k[i, :, start : start + t] = store(ki, self.mode).transpose(0, 1).to(kv_dt)
            cache.v[i, :, start : start + t] = store(v[i], self.mode).transpose(0, 1).to(kv_dt)
            end = start + t
            outs.append(attend(store(qi, self.mode), cache.k[i, :, :end], cache.v[i, :, :end],
                               start, c.head_dim**-0.5))
        o = torch.stack(outs, dim=0).reshape(b, t, c.num_heads * c.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return linear(store(o, self.mode), self.w["o_proj.weight"])
