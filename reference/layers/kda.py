"""Kimi delta attention (KDA): the delta rule with a channel-wise decay, short convs on q, k, v
and a sigmoid-gated output norm.

Per head h, state S [d, d], per token:
    q, k, v = silu(conv([q_proj x | k_proj x | v_proj x]));  q, k = x / sqrt(|x|^2 + 1e-6);
    q *= d^-1/2;  beta = sigmoid(b_proj x);
    g = -exp(A_log[h]) softplus(f_b(f_a x) + dt_bias) in R^d;
    then the delta-rule step of gdn.py with decay diag(e^g);
    y = w * RMSNorm(o) * sigmoid(g_b(g_a x))  -> bf16 store -> o_proj.
Layouts: state [B, H, d, d] fp32; conv window [B, 3 H d, K-1] over [q | k | v]; ring entries
k [H, d], u [H, d], g [H, d].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megakernel.layers.kda import KDAConfig

from .base import register_layer
from .common import l2norm, linear, rms_norm, softplus, store
from .gdn import delta_rule_step
from .replay import RecurrentMixer, delta_rule_fold, delta_rule_replay

if TYPE_CHECKING:
    from megakernel.models.config import Block, ModelConfig


@register_layer
class KimiDeltaAttention(RecurrentMixer):
    """One Kimi `linear_attention` layer (weights under prefix `p`, hub names)."""

    kind = "kda"

    def __init__(self, cfg: KDAConfig, w: dict[str, torch.Tensor], p: str, eps: float, mode: str):
        self.cfg, self.eps, self.mode = cfg, eps, mode
        self.w = {n[len(p):]: t for n, t in w.items() if n.startswith(p)}
        self.conv_weight = torch.cat([self.w[f"{n}_conv1d.weight"] for n in "qkv"], dim=0)
        self.a_neg = -self.w["A_log"].to(torch.float32).reshape(cfg.num_heads).exp()  # [H]
        self.dt_bias = self.w["dt_bias"].to(torch.float32)  # [H d]
        self.conv_dim, self.conv_kernel = cfg.conv_dim, cfg.conv_kernel

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> KimiDeltaAttention:
        return cls(blk.cfg, w, blk.prefix, model.rms_norm_eps, mode)

    def state_shape(self) -> tuple[int, ...]:
        c = self.cfg
        return (c.num_heads, c.head_dim, c.head_dim)

    def ring_shapes(self) -> dict[str, tuple[int, ...]]:
        s = (self.cfg.num_heads, self.cfg.head_dim)
        return {"k": s, "u": s, "g": s}

    def conv_params(self) -> tuple[torch.Tensor, None]:
        return self.conv_weight, None

    def project(self, xn: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        w = self.w
        xc = torch.cat([linear(xn, w[f"{n}_proj.weight"]) for n in "qkv"], dim=-1)
        low = lambda a, b: linear(store(linear(xn, w[a]), self.mode), w[b])  # low-rank pair
        aux = {"f": low("f_a_proj.weight", "f_b_proj.weight"),  # [B, T, H d]
               "b": linear(xn, w["b_proj.weight"]),  # [B, T, H]
               "gate": low("g_a_proj.weight", "g_b_proj.weight")}
        return xc, aux

    def inputs(self, conv: torch.Tensor, aux: dict[str, torch.Tensor], prefill: bool
               ) -> dict[str, torch.Tensor]:
        c = self.cfg
        b, t, _ = conv.shape
        shape = (b, t, c.num_heads, c.head_dim)
        q, k, v = (x.reshape(shape) for x in torch.nn.functional.silu(conv).chunk(3, dim=-1))
        g = self.a_neg[:, None] * softplus(aux["f"] + self.dt_bias).reshape(shape)
        return {"q": l2norm(q, divide=True) * c.head_dim**-0.5, "k": l2norm(k, divide=True),
                "v": v, "beta": torch.sigmoid(aux["b"]), "g": g}

    def step(self, state: torch.Tensor, inp: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_rule_step(state, inp["q"], inp["k"], inp["v"], inp["beta"], inp["g"])

    def replay(self, state: torch.Tensor, ring: dict[str, torch.Tensor],
               inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return delta_rule_replay(state, ring, inp["q"], inp["k"], inp["v"], inp["beta"], inp["g"])

    def fold(self, state: torch.Tensor, ring: dict[str, torch.Tensor]) -> torch.Tensor:
        return delta_rule_fold(state, ring)

    def output(self, y: torch.Tensor, aux: dict[str, torch.Tensor]) -> torch.Tensor:
        gate = aux["gate"].reshape(y.shape)
        o = rms_norm(y, self.w["o_norm.weight"], self.eps) * torch.sigmoid(gate)
        return linear(store(o.flatten(2), self.mode), self.w["o_proj.weight"])
