"""Mamba2 SSD mixer (Nemotron-H `M` blocks).

    [z | xBC | dt] = in_proj x;  xBC = silu(conv(xBC) + bias) -> x [H, P], B [G, N], C [G, N]
    dt = softplus(dt + dt_bias);  A = -exp(A_log);  head h reads group h // (H / G)
    y = e^{dt A} S C + dt (B . C) x + D x;   S <- e^{dt A} S + x (dt B)^T        (state S [P, N])
    out = out_proj(bf16(w * GroupRMSNorm(y * silu(z))))   (group size H P / G)
Packed: proj [P', H] = in_proj rows [z | xBC | dt], zero rows up to a multiple of 16; conv [C (K +
1)] = conv1d taps [C, K] then its bias [C] (zeros without one); out_norm [H P]; o [H, H P]. fp32
params row: A_log [H], D [H], dt_bias [H]. Ring entries per token: x [H, P], B [G, N], dt [H].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.common.errors import ConfigError, positive
from megakernel.kernel.host.mamba_index import MambaShape, check_mamba
from megakernel.layers.base import register_kind
from megakernel.layers.recurrent import RecurrentKind, Sizes, register_commit_op, register_core_ops


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 SSD mixer: in_proj -> [z | xBC | dt], conv over xBC, state [H, P, N] per head."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int = 4
    use_conv_bias: bool = True
    # Lower clamp on dt in the chunked (prefill) path, as HF's mixer does (time_step_min); the
    # single-token update (HF and mamba_ssm alike) does not clamp.
    dt_min: float = 0.0

    def __post_init__(self) -> None:
        positive(self, "num_heads", "head_dim", "state_size", "n_groups")
        positive(self, "conv_kernel", minimum=2)
        if self.num_heads % self.n_groups:
            raise ConfigError(f"mamba_num_heads ({self.num_heads}) must be a multiple of n_groups "
                              f"({self.n_groups})")

    d_inner = property(lambda self: self.num_heads * self.head_dim)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: [x (d_inner) | B (G*N) | C (G*N)]."""
        return self.d_inner + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        return self.d_inner + self.conv_dim + self.num_heads


_UNIT = ("GROUP", "group j (heads j*R .. j*R+R-1, R = H / G)")
_NOTES = ("Per sequence b and group j: causal conv (+ bias) of the x channels of the group's "
          "heads and its B, C channels over the fp32 window, silu; dt = softplus(dt + dt_bias); "
          "A = -exp(A_log). CONV_W: taps [C, K] then bias [C]; PARAM_OFF: A_log [H], D [H], "
          "dt_bias [H]. Output: bf16(w * RMSNorm over the group of (y * silu(z))) into ssm_out "
          "[N, H P]. State block: conv [B, C, K-1], S [B, H, P, N], ring x [B, CAP, H, P], "
          "B [B, CAP, G, N], dt [B, CAP, H].")
MAMBA_CORE, MAMBA_REPLAY = register_core_ops(
    20, "MAMBA", "mamba2", _UNIT,
    ("conv + SSD recurrent update + gated group RMSNorm of one (sequence, group)",
     "conv + SSD by ReplaySSM (committed state + ring, fold every L) + gated group RMSNorm of "
     "one (sequence, group)"), _NOTES,
    ("Recurrent: per token y = e^{dt A} S C + dt (B . C) x + D x, S <- e^{dt A} S + x (dt "
     "B)^T.",
     "ReplaySSM: with n committed entries (x, B, dt) and Lam(t, j) = A * sum of dt over (j, t]: "
     "y_t = e^Lam(t,c) S_c C_t + sum_{j<=t} dt_j e^Lam(t,j) (B_j . C_t) x_j + D x_t; appends "
     "the T entries; folds when n + T >= L (S_c <- e^Lam(n+T,c) S_c + sum_j x_j (dt_j "
     "e^Lam(n+T,j) B_j)^T, count 0)."), handler=("mamba2.Mamba2",
                                                        "mamba_replay.Mamba2Replay"))


MAMBA_COMMIT = register_commit_op(33, "MAMBA", "mamba2", _UNIT,
                                  handler="commit.Mamba2Commit")


@register_kind
class Mamba2(RecurrentKind):
    name = "mamba2"
    config = Mamba2Config
    core_op, replay_op, commit_op = MAMBA_CORE, MAMBA_REPLAY, MAMBA_COMMIT
    unit_label = ("group", "G")
    index_shape, index_check = MambaShape, staticmethod(check_mamba)

    @classmethod
    def kernel_constants(cls, c) -> tuple[int, ...]:  # noqa: ANN001
        return (c.num_heads, c.head_dim, c.state_size, c.n_groups, c.conv_kernel)

    @classmethod
    def sizes(cls, m: Mamba2Config) -> Sizes:
        ch = m.conv_dim // m.n_groups  # the x channels of a group's heads, its B and C
        ring = [("x", (m.num_heads, m.head_dim)), ("B", (m.n_groups, m.state_size)),
                ("dt", (m.num_heads,))]
        return Sizes(m.n_groups, (m.num_heads, m.head_dim, m.state_size), ring, m.d_inner,
                     3 * m.num_heads, m.in_proj_size, ch, ch * (m.conv_kernel + 1) * 2,
                     m.num_heads // m.n_groups)

    @classmethod
    def unit_segments(cls, m: Mamba2Config, unit: int) -> list[slice]:
        """Group j's x channels (its heads), then its B and C channels."""
        rep, hp, ns, di = m.num_heads // m.n_groups, m.head_dim, m.state_size, m.d_inner
        bc = di + m.n_groups * ns
        return [slice(unit * rep * hp, (unit + 1) * rep * hp),
                slice(di + unit * ns, di + (unit + 1) * ns),
                slice(bc + unit * ns, bc + (unit + 1) * ns)]

    # ---- checkpoint --------------------------------------------------------------------------
    @classmethod
    def shapes(cls, blk, model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
        m, h = blk.cfg, model.hidden_size
        out = {"in_proj.weight": (m.in_proj_size, h),
               "conv1d.weight": (m.conv_dim, 1, m.conv_kernel)}
        if m.use_conv_bias:
            out["conv1d.bias"] = (m.conv_dim,)
        out.update({"dt_bias": (m.num_heads,), "A_log": (m.num_heads,), "D": (m.num_heads,),
                    "norm.weight": (m.d_inner,), "out_proj.weight": (h, m.d_inner)})
        return out

    @classmethod
    def init_role(cls, local: str, blk) -> str:  # noqa: ANN001
        return {"conv1d.weight": "conv", "conv1d.bias": "bias", "dt_bias": "dt_bias",
                "A_log": "A_log", "D": "D", "norm.weight": "norm_plain",
                "out_proj.weight": "out"}.get(local, "proj")

    # ---- packing -----------------------------------------------------------------------------
    @classmethod
    def vectors(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        m = blk.cfg
        return [("out_norm", (m.d_inner,)), ("conv", (m.conv_dim * (m.conv_kernel + 1),))]

    @classmethod
    def matrices(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        m, h = blk.cfg, model.hidden_size
        return [("proj", (cls.proj_width(m), h)), ("o", (h, m.d_inner))]

    @classmethod
    def quantized(cls, blk, model) -> list[str]:  # noqa: ANN001
        return ["in_proj.weight", "out_proj.weight"]

    @classmethod
    def pack(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        m = blk.cfg
        proj = w("in_proj.weight")
        bias = w("conv1d.bias") if m.use_conv_bias else proj.new_zeros(m.conv_dim)
        pad = cls.proj_width(m) - proj.shape[0]
        return {"out_norm": w("norm.weight"),
                "conv": torch.cat((w("conv1d.weight")[:, 0].reshape(-1), bias)),
                "proj": torch.cat((proj, proj.new_zeros(pad, proj.shape[1]))),
                "o": w("out_proj.weight")}

    @classmethod
    def tables(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        return {"ssm_params": torch.cat((w("A_log"), w("D"), w("dt_bias")))}
