"""Multi-head latent attention (MLA) of Kimi Linear, with the latent cache.

    q = q_proj x  (or q_b(RMSNorm(q_a x)))                      [H, d_nope + d_rope]
    [c | k_rope] = kv_a_proj_with_mqa x;  c = RMSNorm(c)        c [r], k_rope [d_rope] (all heads)
    cache <- (c, k_rope);  [k_nope | v] = kv_b_proj c  per cached position and head
    o = softmax(q . [k_nope | k_rope] / sqrt(d_nope + d_rope)) v  -> bf16 store -> o_proj
With `absorb=True` the same attention never expands kv_b over the cache: per head h, with
kv_b's rows W_UK_h [d_nope, r] and W_UV_h [d_v, r],
    q_lat = W_UK_h^T q_nope  [r];  scores = (q_lat . c + q_rope . k_rope) / sqrt(d_nope + d_rope)
    o = W_UV_h (softmax(scores) c)
(q_nope . W_UK_h c = (W_UK_h^T q_nope) . c), an MQA over the latent cache that every head
shares. Both paths round at the same points (q, the latent, o), so they differ only by fp32
reassociation.
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

    def __init__(self, cfg: MLAConfig, w: dict[str, torch.Tensor], p: str, mode: str,
                 absorb: bool = False):
        self.cfg, self.mode, self.absorb = cfg, mode, absorb
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
            c_i = cache.c[i, :end].to(torch.float32)  # [S, r]
            kr = cache.k_rope[i, :end].to(torch.float32)  # [S, d_rope]
            attn = self._absorbed if self.absorb else self._expanded
            outs.append(attn(q[i], c_i, kr, start))
        o = torch.stack(outs, dim=0).reshape(b, t, c.num_heads * c.v_head_dim)
        return linear(store(o, self.mode), w["o_proj.weight"])

    def _expanded(self, q: torch.Tensor, c_s: torch.Tensor, k_rope: torch.Tensor, start: int
                  ) -> torch.Tensor:
        """[k_nope | v] = kv_b c for every cached position and head. q [T, H, d_qk],
        c_s [S, r], k_rope [S, d_rope] -> [T, H, d_v]."""
        m, s = self.cfg, c_s.shape[0]
        k_nope, v = linear(c_s, self.w["kv_b_proj.weight"]).reshape(s, m.num_heads, -1).split(
            [m.qk_nope_head_dim, m.v_head_dim], dim=-1)  # [S, H, .]
        kr = k_rope[:, None].expand(s, m.num_heads, -1)
        keys = torch.cat((k_nope, kr), dim=-1).transpose(0, 1)  # [H, S, d_qk]
        return attend(q, keys, v.transpose(0, 1), start, m.qk_head_dim**-0.5)

    def _absorbed(self, q: torch.Tensor, c_s: torch.Tensor, k_rope: torch.Tensor, start: int
                  ) -> torch.Tensor:
        """W_UK into the query, W_UV after the attention: one latent key/value head. Same
        arguments and result as `_expanded`."""
        m = self.cfg
        w_uk, w_uv = self.w["kv_b_proj.weight"].to(torch.float32).view(
            m.num_heads, -1, m.kv_lora_rank).split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, H, r]
        keys = torch.cat((c_s, k_rope), dim=-1)[None]  # [1, S, r + d_rope]
        o_lat = attend(torch.cat((q_lat, q_rope), dim=-1), keys, c_s[None], start,
                       m.qk_head_dim**-0.5)  # [T, H, r]
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)
