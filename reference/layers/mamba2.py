"""Mamba2 (SSD) layer of Nemotron-H.

    [z | xBC | dt] = in_proj x;  xBC = silu(conv(xBC) + bias) -> x [H, P], B [G, N], C [G, N]
    dt = softplus(dt + dt_bias);  A = -exp(A_log);  head h reads group h // (H / G)
    y = e^{dt A} S C + dt (B . C) x + D x;   S <- e^{dt A} S + x (dt B)^T        (state S [P, N])
    out = out_proj( w * GroupRMSNorm(y * silu(z)) )   (group size H P / G, fp32, then bf16 store)
As in gdn.py the decay is applied on read (the output is computed before the write), which
is the form ReplaySSM reduces to exactly for a window of 1. Like HF's chunked path (and unlike the
single-token update of HF and mamba_ssm) prefill clamps dt below at `dt_min`.

Layouts: state [B, H, P, N] fp32; conv window [B, H P + 2 G N, K-1] over [x | B | C]; ring
entries x [H, P], B [G, N] (per group), dt [H].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megakernel.layers.mamba2 import Mamba2Config

from .base import register_layer
from .common import linear, softplus, store
from .replay import RecurrentMixer, ssd_fold, ssd_replay

if TYPE_CHECKING:
    from megakernel.models.config import Block, ModelConfig


def ssd_step(
    state: torch.Tensor,  # [B, H, P, N]
    x: torch.Tensor,  # [B, H, P]
    b: torch.Tensor,  # [B, H, N]
    c: torch.Tensor,  # [B, H, N]
    dt: torch.Tensor,  # [B, H]
    a: torch.Tensor,  # [H]
    d: torch.Tensor,  # [H]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent SSD token for a batch: (y [B, H, P], new state)."""
    da = (a * dt).exp()  # [B, H]
    y = da[..., None] * (state * c[..., None, :]).sum(-1) + (dt * (b * c).sum(-1))[..., None] * x
    y = y + d[:, None] * x
    new_state = da[..., None, None] * state + x[..., :, None] * (dt[..., None] * b)[..., None, :]
    return y, new_state


@register_layer
class Mamba2Mixer(RecurrentMixer):
    """One Nemotron-H `M` block mixer (weights under prefix `p`)."""

    kind = "mamba2"

    def __init__(self, cfg: Mamba2Config, w: dict[str, torch.Tensor], p: str, eps: float,
                 mode: str):
        self.cfg, self.eps, self.mode = cfg, eps, mode
        self.w = {n[len(p):]: t for n, t in w.items() if n.startswith(p)}
        self.a = -self.w["A_log"].to(torch.float32).exp()  # [H]
        self.d = self.w["D"].to(torch.float32)
        self.dt_bias = self.w["dt_bias"].to(torch.float32)
        self.conv_dim, self.conv_kernel = cfg.conv_dim, cfg.conv_kernel
        self.rep = cfg.num_heads // cfg.n_groups

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> Mamba2Mixer:
        return cls(blk.cfg, w, blk.prefix, model.rms_norm_eps, mode)

    def state_shape(self) -> tuple[int, ...]:
        c = self.cfg
        return (c.num_heads, c.head_dim, c.state_size)

    def ring_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        return {"x": (c.num_heads, c.head_dim), "B": (c.n_groups, c.state_size),
                "dt": (c.num_heads,)}

    def conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.w["conv1d.weight"], self.w.get("conv1d.bias")

    def project(self, xn: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.cfg
        z, xbc, dt = linear(xn, self.w["in_proj.weight"]).split(
            [c.d_inner, c.conv_dim, c.num_heads], dim=-1)
        return xbc, {"z": z, "dt": dt}

    def inputs(self, conv: torch.Tensor, aux: dict[str, torch.Tensor], prefill: bool
               ) -> dict[str, torch.Tensor]:
        c = self.cfg
        bsz, t, _ = conv.shape
        gn = c.n_groups * c.state_size
        x, b, cc = torch.nn.functional.silu(conv).split([c.d_inner, gn, gn], dim=-1)
        dt = softplus(aux["dt"] + self.dt_bias)  # [B, T, H]
        if prefill:
            dt = dt.clamp_min(c.dt_min)
        return {"x": x.reshape(bsz, t, c.num_heads, c.head_dim),
                "B": b.reshape(bsz, t, c.n_groups, c.state_size),
                "C": cc.reshape(bsz, t, c.n_groups, c.state_size), "dt": dt}

    def _heads(self, g: torch.Tensor) -> torch.Tensor:
        """Groups -> heads along dim -2."""
        return g.repeat_interleave(self.rep, dim=-2)

    def step(self, state: torch.Tensor, inp: dict[str, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return ssd_step(state, inp["x"], self._heads(inp["B"]), self._heads(inp["C"]), inp["dt"],
                        self.a, self.d)

    def replay(self, state: torch.Tensor, ring: dict[str, torch.Tensor],
               inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        full = {"x": ring["x"], "B": self._heads(ring["B"]), "dt": ring["dt"]}
        y, _ = ssd_replay(state, full, inp["x"], self._heads(inp["B"]), self._heads(inp["C"]),
                          inp["dt"], self.a, self.d)
        return y, {"x": inp["x"], "B": inp["B"], "dt": inp["dt"]}

    def fold(self, state: torch.Tensor, ring: dict[str, torch.Tensor]) -> torch.Tensor:
        return ssd_fold(state, {"x": ring["x"], "B": self._heads(ring["B"]), "dt": ring["dt"]},
                        self.a)

    def output(self, y: torch.Tensor, aux: dict[str, torch.Tensor]) -> torch.Tensor:
        c = self.cfg
        bsz, t = y.shape[:2]
        y = y.reshape(bsz, t, c.d_inner) * torch.nn.functional.silu(aux["z"])
        grp = y.reshape(bsz, t, c.n_groups, c.d_inner // c.n_groups)
        grp = grp * torch.rsqrt(grp.pow(2).mean(-1, keepdim=True) + self.eps)
        y = grp.reshape(bsz, t, c.d_inner) * self.w["norm.weight"].to(torch.float32)
        return linear(store(y, self.mode), self.w["out_proj.weight"])
