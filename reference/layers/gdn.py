"""Gated delta rule (GDN) layer of Qwen3.5, and the delta-rule step it shares with KDA.

Per value head h (key head h // (Hv / Hk)), state S [dk, dv], per token:
    q, k = l2norm(silu(conv(.))), q *= dk^-1/2;  beta = sigmoid(b);
    g = -exp(A_log) softplus(a + dt_bias)
    u = beta (v - S^T (e^g k));  o = S^T (e^g q) + (k . q) u;  S <- e^g S + k u^T
which is the usual "decay, delta-update, read" form with the decay applied on read, so that
ReplaySSM (replay.py) reduces to it exactly for a window of 1. The output is
    y = w * RMSNorm(o) * silu(z)  (per head, fp32)  -> bf16 store -> out_proj.

Layouts: state [B, Hv, dk, dv] fp32; conv window [B, 2*Hk*dk + Hv*dv, K-1] fp32 over [q | k | v];
ring entries k [Hk, dk] (per key head), u [Hv, dv], g [Hv] (scalar log-decay per value head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megakernel.layers.gdn import GDNConfig

from .base import register_layer
from .common import l2norm, linear, rms_norm, softplus, store
from .replay import RecurrentMixer, delta_rule_fold, delta_rule_replay

if TYPE_CHECKING:
    from megakernel.models.config import Block, ModelConfig


def delta_rule_step(
    state: torch.Tensor,  # [B, H, dk, dv]
    q: torch.Tensor,  # [B, H, dk]
    k: torch.Tensor,  # [B, H, dk]
    v: torch.Tensor,  # [B, H, dv]
    beta: torch.Tensor,  # [B, H]
    g: torch.Tensor,  # [B, H, dk] log-decay (channel-wise; GDN broadcasts a scalar)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent delta-rule token for a batch: (o [B, H, dv], new state)."""
    a = g.exp()
    pre = (state * (a * k)[..., :, None]).sum(-2)  # S^T (e^g k)   [B, H, dv]
    u = beta[..., None] * (v - pre)
    o = (state * (a * q)[..., :, None]).sum(-2) + (k * q).sum(-1)[..., None] * u
    new_state = a[..., None] * state + k[..., :, None] * u[..., None, :]
    return o, new_state


@register_layer
class GatedDeltaNet(RecurrentMixer):
    """One Qwen3.5 `linear_attn` layer (weights under prefix `p`)."""

    kind = "gdn"

    def __init__(self, cfg: GDNConfig, w: dict[str, torch.Tensor], p: str, eps: float, mode: str):
        self.cfg, self.eps, self.mode = cfg, eps, mode
        self.w = {n: w[p + n] for n in ("in_proj_qkv.weight", "in_proj_z.weight",
                                        "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
                                        "norm.weight", "out_proj.weight")}
        self.a_neg = -w[p + "A_log"].to(torch.float32).exp()  # [Hv]
        self.dt_bias = w[p + "dt_bias"].to(torch.float32)
        self.conv_dim, self.conv_kernel = cfg.conv_dim, cfg.conv_kernel
        self.rep = cfg.num_v_heads // cfg.num_k_heads

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> GatedDeltaNet:
        return cls(blk.cfg, w, blk.prefix, model.rms_norm_eps, mode)

    def state_shape(self) -> tuple[int, ...]:
        c = self.cfg
        return (c.num_v_heads, c.k_head_dim, c.v_head_dim)

    def ring_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        return {"k": (c.num_k_heads, c.k_head_dim), "u": (c.num_v_heads, c.v_head_dim),
                "g": (c.num_v_heads,)}

    def conv_params(self) -> tuple[torch.Tensor, None]:
        return self.w["conv1d.weight"], None

    def project(self, xn: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.cfg
        b, t, _ = xn.shape
        aux = {
            "z": linear(xn, self.w["in_proj_z.weight"]).reshape(b, t, c.num_v_heads, c.v_head_dim),
            "b": linear(xn, self.w["in_proj_b.weight"]),  # [B, T, Hv]
            "a": linear(xn, self.w["in_proj_a.weight"]),
        }
        return linear(xn, self.w["in_proj_qkv.weight"]), aux

    def inputs(self, conv: torch.Tensor, aux: dict[str, torch.Tensor], prefill: bool
               ) -> dict[str, torch.Tensor]:
        c = self.cfg
        b, t, _ = conv.shape
        act = torch.nn.functional.silu(conv)
        q, k, v = act.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = l2norm(q.reshape(b, t, c.num_k_heads, c.k_head_dim)) * c.k_head_dim**-0.5
        k = l2norm(k.reshape(b, t, c.num_k_heads, c.k_head_dim))
        return {
            "q": q, "k": k, "v": v.reshape(b, t, c.num_v_heads, c.v_head_dim),
            "beta": torch.sigmoid(aux["b"]),
            "g": self.a_neg * softplus(aux["a"] + self.dt_bias),  # [B, T, Hv]
        }

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        """Key heads -> value heads along dim -2."""
        return x.repeat_interleave(self.rep, dim=-2)

    def _g(self, g: torch.Tensor) -> torch.Tensor:
        return g[..., None].expand(*g.shape, self.cfg.k_head_dim)

    def step(self, state: torch.Tensor, inp: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_rule_step(state, self._expand(inp["q"]), self._expand(inp["k"]), inp["v"],
                               inp["beta"], self._g(inp["g"]))

    def replay(self, state: torch.Tensor, ring: dict[str, torch.Tensor],
               inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        full_ring = {"k": self._expand(ring["k"]), "u": ring["u"], "g": self._g(ring["g"])}
        o, entries = delta_rule_replay(state, full_ring, self._expand(inp["q"]),
                                       self._expand(inp["k"]), inp["v"], inp["beta"],
                                       self._g(inp["g"]))
        return o, {"k": inp["k"], "u": entries["u"], "g": inp["g"]}  # compact entries

    def fold(self, state: torch.Tensor, ring: dict[str, torch.Tensor]) -> torch.Tensor:
        return delta_rule_fold(state, {"k": self._expand(ring["k"]), "u": ring["u"],
                                       "g": self._g(ring["g"])})

    def output(self, y: torch.Tensor, aux: dict[str, torch.Tensor]) -> torch.Tensor:
        # y [B, T, Hv, dv]; gated RMSNorm per head, then the output projection
        o = rms_norm(y, self.w["norm.weight"], self.eps) * torch.nn.functional.silu(aux["z"])
        o = store(o.flatten(2), self.mode)
        return linear(o, self.w["out_proj.weight"])
