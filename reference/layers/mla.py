"""Multi-head latent attention (MLA) of Kimi Linear, with the latent cache.

    q = q_proj x  (or q_b(RMSNorm(q_a x)))                      [H, d_nope + d_rope]
    [c | k_rope] = kv_a_proj_with_mqa x;  c = RMSNorm(c)        c [r], k_rope [d_rope] (all heads)
    cache <- (c, k_rope);  [k_nope | v] = kv_b_proj c  per cached position and head
    o = softmax(q . [k_nope | k_rope] / sqrt(d_nope + d_rope)) v  -> bf16 store -> o_proj
No RoPE is applied anywhere, as in the HF KimiLinear model (its checkpoints set mla_use_nope).
The q_a / kv_a norms use eps 1e-6 (HF constructs them without the config's eps).

Cache layout (`MLACache`): c [B, S_max, r], k_rope [B, S_max, d_rope]; NaN in unwritten slots; fp32
in "fp32" mode, bf16 in "bf16" mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megakernel.layers.mla import MLAConfig

from .attention import cache_dtype
from .base import ReferenceLayer, check_tensor, register_layer
from .common import attend, linear, rms_norm, store

if TYPE_CHECKING:
    from megakernel.models.config import Block, ModelConfig

LATENT_NORM_EPS = 1e-6


@dataclass
class MLACache:
    """The latent cache of one MLA layer; layout in the module docstring."""

    c: torch.Tensor  # [B, S_max, r]
    k_rope: torch.Tensor  # [B, S_max, d_rope]

    def row(self, b: int) -> MLACache:
        """A batch-1 view of sequence b."""
        return MLACache(self.c[b : b + 1], self.k_rope[b : b + 1])


@register_layer
class MLA(ReferenceLayer):
    """One Kimi `full_attention` layer (weights under prefix `p`)."""

    kind = "mla"
    state = "kv"

    def __init__(self, cfg: MLAConfig, w: dict[str, torch.Tensor], p: str, mode: str):
        self.cfg, self.mode = cfg, mode
        self.w = {n[len(p):]: t for n, t in w.items() if n.startswith(p)}

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> MLA:
        return cls(blk.cfg, w, blk.prefix, mode)

    def new_cache(self, batch: int, max_seq_len: int, ring_capacity: int,
                  device: torch.device) -> MLACache:
        c, dt, nan = self.cfg, cache_dtype(self.mode), float("nan")
        return MLACache(
            torch.full((batch, max_seq_len, c.kv_lora_rank), nan, dtype=dt, device=device),
            torch.full((batch, max_seq_len, c.qk_rope_head_dim), nan, dtype=dt, device=device))

    def check_cache(self, cache: Any, batch: int, max_seq_len: int, ring_capacity: int,
                    device: torch.device) -> None:
        c, dt = self.cfg, cache_dtype(self.mode)
        check_tensor("cache c", getattr(cache, "c", None), "[B, S_max, r]",
                     (batch, max_seq_len, c.kv_lora_rank), dt, device, f"{self.mode} mode")
        check_tensor("cache k_rope", getattr(cache, "k_rope", None), "[B, S_max, d_rope]",
                     (batch, max_seq_len, c.qk_rope_head_dim), dt, device, f"{self.mode} mode")

    def forward(self, xn: torch.Tensor, cache: MLACache, lengths: torch.Tensor,
                replay: bool = False, prefill: bool = False) -> torch.Tensor:
        c, w = self.cfg, self.w
        b, t, _ = xn.shape
        if c.q_lora_rank is None:
            q = linear(xn, w["q_proj.weight"])
        else:
            qa = rms_norm(linear(xn, w["q_a_proj.weight"]), w["q_a_layernorm.weight"],
                          LATENT_NORM_EPS)
            q = linear(store(qa, self.mode), w["q_b_proj.weight"])
        q = store(q.reshape(b, t, c.num_heads, c.qk_head_dim), self.mode)
        lat, k_rope = linear(xn, w["kv_a_proj_with_mqa.weight"]).split(
            [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        lat = rms_norm(lat, w["kv_a_layernorm.weight"], LATENT_NORM_EPS)
        outs = []
        for i in range(b):
            start = int(lengths[i])
            end = start + t
            cache.c[i, start:end] = store(lat[i], self.mode).to(cache.c.dtype)
            cache.k_rope[i, start:end] = store(k_rope[i], self.mode).to(cache.k_rope.dtype)
            kv = linear(cache.c[i, :end].to(torch.float32), w["kv_b_proj.weight"])
            k_nope, v = kv.reshape(end, c.num_heads, -1).split(
                [c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [S, H, .]
            kr = cache.k_rope[i, :end].to(torch.float32)[:, None].expand(end, c.num_heads, -1)
            keys = torch.cat((k_nope, kr), dim=-1).transpose(0, 1)  # [H, S, d_qk]
            outs.append(attend(q[i], keys, v.transpose(0, 1), start, c.qk_head_dim**-0.5))
        o = torch.stack(outs, dim=0).reshape(b, t, c.num_heads * c.v_head_dim)
        return linear(store(o, self.mode), w["o_proj.weight"])
