"""Softmax attention with a KV cache, one implementation for every family:

    Llama       q, k, v projections; RoPE (llama3 scaling) on every dim
    Qwen3       + per-head q/k RMSNorm (x * w) before RoPE
    Qwen2       + q/k/v biases, added right after the projections
    Qwen3.5     q_proj gives [q | gate] per head; (1 + w) q/k norm; RoPE on the first
                `rotary_dim` dims only; the output is multiplied by sigmoid(gate)
    Nemotron-H  no RoPE, no q/k norm

Per sequence and token: q, k, v = projections (+ bias) -> q/k norm (the model's RMSNorm form, model
eps) -> RoPE (rotate-half on the first R = rotary_dim dims; cos/sin from float64 angles rounded
once to fp32) -> q and the cache entries k, v stored (bf16 in "bf16" mode); attention in fp32 over
the cached positions (query head h reads kv head h // (Hq / Hkv)); output (times sigmoid(gate))
stored -> o_proj.

KV cache layout (`KVLayerCache`): k, v [B, Hkv, S_max, D], NaN in unwritten slots, fp32 in "fp32"
mode and bf16 in "bf16" mode (k after q/k norm and RoPE). Positions come from `lengths` [B].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megakernel.layers.attention import AttentionConfig

from .base import ReferenceLayer, check_tensor, register_layer
from .common import apply_partial_rope, attend, linear, model_norm, rope_tables, store

if TYPE_CHECKING:
    from megakernel.models.config import Block, ModelConfig

KV_LAYOUT = "[B, Hkv, S_max, D]"


@dataclass
class KVLayerCache:
    """Keys and values of one attention layer; layout in the module docstring."""

    k: torch.Tensor  # [B, Hkv, S_max, D]
    v: torch.Tensor  # [B, Hkv, S_max, D]

    def row(self, b: int) -> KVLayerCache:
        """A batch-1 view of sequence b."""
        return KVLayerCache(self.k[b : b + 1], self.v[b : b + 1])


def cache_dtype(mode: str) -> torch.dtype:
    """dtype of KV / latent caches: what the kernel stores (bf16) in "bf16" mode, else fp32."""
    return torch.bfloat16 if mode == "bf16" else torch.float32


def new_kv_cache(batch: int, heads: int, max_len: int, dk: int, dv: int, mode: str,
                 device: torch.device | str) -> KVLayerCache:
    """A NaN-filled cache, so that a read of an unwritten slot shows up."""
    dt, nan = cache_dtype(mode), float("nan")
    return KVLayerCache(torch.full((batch, heads, max_len, dk), nan, dtype=dt, device=device),
                        torch.full((batch, heads, max_len, dv), nan, dtype=dt, device=device))


@register_layer
class Attention(ReferenceLayer):
    """One attention layer (weights under prefix `p`; `norm_kind`: the model's RMSNorm form)."""

    kind = "attention"
    state = "kv"

    def __init__(self, cfg: AttentionConfig, w: dict[str, torch.Tensor], p: str, eps: float,
                 mode: str, device: torch.device | str, norm_kind: str = "rms"):
        self.cfg, self.eps, self.mode = cfg, eps, mode
        self.norm = model_norm(norm_kind)
        self.w = {n[len(p):]: t for n, t in w.items() if n.startswith(p)}
        self.inv_freq = torch.tensor(cfg.inv_freq(), dtype=torch.float64, device=device)

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> Attention:
        return cls(blk.cfg, w, blk.prefix, model.rms_norm_eps, mode, device, model.norm_kind)

    def new_cache(self, batch: int, max_seq_len: int, ring_capacity: int,
                  device: torch.device) -> KVLayerCache:
        c = self.cfg
        return new_kv_cache(batch, c.num_kv_heads, max_seq_len, c.head_dim, c.head_dim,
                            self.mode, device)

    def check_cache(self, cache: Any, batch: int, max_seq_len: int, ring_capacity: int,
                    device: torch.device) -> None:
        c = self.cfg
        want = (batch, c.num_kv_heads, max_seq_len, c.head_dim)
        for name in ("k", "v"):
            check_tensor(f"cache {name}", getattr(cache, name, None), KV_LAYOUT, want,
                         cache_dtype(self.mode), device, f"{self.mode} mode")

    def _proj(self, xn: torch.Tensor, name: str) -> torch.Tensor:
        """xn @ W^T (+ bias), fp32."""
        out = linear(xn, self.w[f"{name}.weight"])
        if self.cfg.qkv_bias:
            out = out + self.w[f"{name}.bias"].to(torch.float32)
        return out

    def forward(self, xn: torch.Tensor, cache: KVLayerCache, lengths: torch.Tensor,
                replay: bool = False, prefill: bool = False) -> torch.Tensor:
        """xn [B, T, D] (normed, stored) -> output [B, T, D]; appends T keys/values per sequence
        at positions lengths[b] .. lengths[b]+T-1 (lengths itself is advanced by the caller)."""
        c = self.cfg
        b, t, _ = xn.shape
        q = self._proj(xn, "q_proj")
        gate = None
        if c.output_gate:
            q, gate = q.reshape(b, t, c.num_heads, 2 * c.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, t, c.num_heads * c.head_dim)
        q = q.reshape(b, t, c.num_heads, c.head_dim)
        k = self._proj(xn, "k_proj").reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self._proj(xn, "v_proj").reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:  # per head, over D, before RoPE
            q = self.norm(q, self.w["q_norm.weight"], self.eps)
            k = self.norm(k, self.w["k_norm.weight"], self.eps)
        outs = []
        for i in range(b):
            start = int(lengths[i])
            end = start + t
            qi, ki = q[i], k[i]
            if c.rotary_dim:
                pos = torch.arange(start, end, device=xn.device)
                cos, sin = rope_tables(self.inv_freq, pos)  # [T, R] fp32
                qi, ki = apply_partial_rope(qi, cos, sin), apply_partial_rope(ki, cos, sin)
            kv_dt = cache.k.dtype
            cache.k[i, :, start:end] = store(ki, self.mode).transpose(0, 1).to(kv_dt)
            cache.v[i, :, start:end] = store(v[i], self.mode).transpose(0, 1).to(kv_dt)
            outs.append(attend(store(qi, self.mode), cache.k[i, :, :end], cache.v[i, :, :end],
                               start, c.head_dim**-0.5))
        o = torch.stack(outs, dim=0).reshape(b, t, c.num_heads * c.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return linear(store(o, self.mode), self.w["o_proj.weight"])
