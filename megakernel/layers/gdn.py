"""Gated delta rule (Qwen3.5 `linear_attention`).

Per value head h (key head h // (Hv / Hk)), state S [dk, dv], per token:
    q, k = l2norm(silu(conv(.))), q *= dk^-1/2;  beta = sigmoid(b);  g = -exp(A_log) softplus(a +
    dt_bias);  u = beta (v - S^T (e^g k));  o = S^T (e^g q) + (k . q) u;  S <- e^g S + k u^T
    out = out_proj(bf16(w * RMSNorm(o) * silu(z)))   (plain RMSNorm per head)
Packed: proj [P, H] = [in_proj_qkv (C = 2 Hk dk + Hv dv) | in_proj_z (Hv dv) | in_proj_b (Hv) |
in_proj_a (Hv)], zero rows up to P; conv [C, K]; out_norm [dv]; o [H, Hv dv]. fp32 params row:
A_log [Hv], dt_bias [Hv]. Ring entries per token: k [Hk, dk], u [Hv, dv], g [Hv].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.common.errors import ConfigError, positive
from megakernel.kernel.host.gdn_index import GDNShape, check_gdn
from megakernel.layers.base import register_kind
from megakernel.layers.recurrent import RecurrentKind, Sizes, register_commit_op, register_core_ops


@dataclass(frozen=True)
class GDNConfig:
    """Gated delta rule. Value head h reads key head h // (num_v_heads / num_k_heads)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        positive(self, "num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim")
        positive(self, "conv_kernel", minimum=2)
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.num_k_heads})")

    key_dim = property(lambda self: self.num_k_heads * self.k_head_dim)
    value_dim = property(lambda self: self.num_v_heads * self.v_head_dim)

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: [q | k | v]."""
        return 2 * self.key_dim + self.value_dim


_UNIT = ("K_HEAD", "key head kh (value heads kh*R .. kh*R+R-1, R = Hv / Hk)")
_NOTES = ("Per sequence b and key head kh, for its T tokens: causal conv of the q, k channels of "
          "kh and the v channels of its value heads over the fp32 window (window in, window out), "
          "silu, q = l2norm(q) dk^-1/2, k = l2norm(k), beta = sigmoid(b), g = -exp(A_log) "
          "softplus(a + dt_bias). PARAM_OFF: A_log [Hv] then dt_bias [Hv]. Output per value head: "
          "bf16(RMSNorm(o) * w * silu(z)) into ssm_out [N, Hv dv]. State block: conv [B, C, K-1], "
          "S [B, Hv, dk, dv], ring k [B, CAP, Hk, dk], u [B, CAP, Hv, dv], g [B, CAP, Hv] "
          "(CAP = header RING_CAP).")
GDN_CORE, GDN_REPLAY = register_core_ops(
    17, "GDN", "gdn", _UNIT,
    ("conv + gated delta rule (recurrent) + gated RMSNorm of one (sequence, key head)",
     "conv + gated delta rule by ReplaySSM (committed state + ring, fold every L) + gated "
     "RMSNorm of one (sequence, key head)"), _NOTES,
    ("Recurrent: per token u = beta (v - S^T (e^g k)); o = S^T (e^g q) + (k . q) u; S <- e^g S "
     "+ k u^T.",
     "ReplaySSM: with n = count[b, kh] committed ring entries and the committed state S_c, token "
     "i (t = n + i) computes, with G(t, j) the sum of g over entries (j, t], u_t = beta (v - "
     "S_c^T (e^G(t,c) k) - sum_{j<t} (e^G(t,j) k_j . k) u_j), o_t = S_c^T (e^G(t,c) q) + "
     "sum_{j<=t} (e^G(t,j) k_j . q) u_j, appends (k, u_t, g) at ring position t; then if n + T "
     ">= L (header REPLAY_WINDOW) it folds all n + T entries into S_c and stores count 0, else "
     "n + T."), handler=("gdn.GatedDeltaRule",) * 2)


GDN_COMMIT = register_commit_op(32, "GDN", "gdn", _UNIT,
                                handler="commit.GatedDeltaCommit")


@register_kind
class GatedDeltaNet(RecurrentKind):
    name = "gdn"
    config = GDNConfig
    core_op, replay_op, commit_op = GDN_CORE, GDN_REPLAY, GDN_COMMIT
    unit_label = ("key head", "Hk")
    index_shape, index_check = GDNShape, staticmethod(check_gdn)

    @classmethod
    def kernel_constants(cls, c) -> tuple[int, ...]:  # noqa: ANN001
        return (c.num_k_heads, c.num_v_heads, c.k_head_dim, c.v_head_dim, c.conv_kernel)

    @classmethod
    def sizes(cls, c: GDNConfig) -> Sizes:
        rep = c.num_v_heads // c.num_k_heads  # value heads per key head (one unit)
        ch = 2 * c.k_head_dim + rep * c.v_head_dim
        ring = [("k", (c.num_k_heads, c.k_head_dim)), ("u", (c.num_v_heads, c.v_head_dim)),
                ("g", (c.num_v_heads,))]
        return Sizes(c.num_k_heads, (c.num_v_heads, c.k_head_dim, c.v_head_dim), ring,
                     c.value_dim, 2 * c.num_v_heads,
                     c.conv_dim + c.value_dim + 2 * c.num_v_heads, ch, ch * c.conv_kernel * 2, rep)

    @classmethod
    def unit_segments(cls, c: GDNConfig, unit: int) -> list[slice]:
        """Key head kh's q and k channels, then its value heads' v channels."""
        dk, dv, kd, rep = c.k_head_dim, c.v_head_dim, c.key_dim, c.num_v_heads // c.num_k_heads
        return [slice(unit * dk, (unit + 1) * dk), slice(kd + unit * dk, kd + (unit + 1) * dk),
                slice(2 * kd + unit * rep * dv, 2 * kd + (unit + 1) * rep * dv)]

    # ---- checkpoint --------------------------------------------------------------------------
    @classmethod
    def shapes(cls, blk, model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
        g, h = blk.cfg, model.hidden_size
        return {"in_proj_qkv.weight": (g.conv_dim, h), "in_proj_z.weight": (g.value_dim, h),
                "in_proj_b.weight": (g.num_v_heads, h), "in_proj_a.weight": (g.num_v_heads, h),
                "conv1d.weight": (g.conv_dim, 1, g.conv_kernel), "dt_bias": (g.num_v_heads,),
                "A_log": (g.num_v_heads,), "norm.weight": (g.v_head_dim,),
                "out_proj.weight": (h, g.value_dim)}

    @classmethod
    def init_role(cls, local: str, blk) -> str:  # noqa: ANN001
        return {"conv1d.weight": "conv", "dt_bias": "dt_bias", "A_log": "A_log",
                "norm.weight": "norm_plain", "out_proj.weight": "out"}.get(local, "proj")

    # ---- packing -----------------------------------------------------------------------------
    @classmethod
    def vectors(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        g = blk.cfg
        return [("out_norm", (g.v_head_dim,)), ("conv", (g.conv_dim, g.conv_kernel))]

    @classmethod
    def matrices(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        g, h = blk.cfg, model.hidden_size
        return [("proj", (cls.proj_width(g), h)), ("o", (h, g.value_dim))]

    @classmethod
    def quantized(cls, blk, model) -> list[str]:  # noqa: ANN001
        return [f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")] + ["out_proj.weight"]

    @classmethod
    def pack(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        proj = torch.cat([w(f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])
        pad = cls.proj_width(blk.cfg) - proj.shape[0]
        return {"out_norm": w("norm.weight"), "conv": w("conv1d.weight")[:, 0],
                "proj": torch.cat((proj, proj.new_zeros(pad, proj.shape[1]))),
                "o": w("out_proj.weight")}

    @classmethod
    def tables(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        return {"ssm_params": torch.cat((w("A_log"), w("dt_bias")))}
