"""Kimi delta attention (KDA, Kimi Linear `linear_attention`): the delta rule with a channel-wise
decay, short convs on q, k, v and a sigmoid-gated output norm.

Per head h, state S [d, d], per token:
    q, k, v = silu(conv([q_proj x | k_proj x | v_proj x]));  q, k = x / sqrt(|x|^2 + 1e-6);
    q *= d^-1/2;  beta = sigmoid(b_proj x);  g = -exp(A_log[h]) softplus(f_b(f_a x) + dt_bias)
    in R^d;  the delta-rule step of layers/gdn.py with decay diag(e^g);
    out = o_proj(bf16(w * RMSNorm(o) * sigmoid(g_b(g_a x))))
Packed: proj [P, H] = [q | k | v (H d each) | f_a (d) | b (H) | g_a (d)], zero rows up to a
multiple of 16; conv = q|k|v conv taps [3 H d, K], then f_b [H d, d], then g_b [H d, d] (flat);
out_norm [d]; o [H, H d]. fp32 params row: A_log [H], dt_bias [H d]. Ring entries per token:
k, u, g [H, d] each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.common.errors import positive
from megakernel.kernel.host.kda_index import KDAShape, check_kda
from megakernel.layers.base import register_kind
from megakernel.layers.recurrent import RecurrentKind, Sizes, register_commit_op, register_core_ops


@dataclass(frozen=True)
class KDAConfig:
    """Kimi delta attention: q, k, v each num_heads x head_dim, channel-wise decay."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        positive(self, "num_heads", "head_dim")
        positive(self, "conv_kernel", minimum=2)

    qkv_dim = property(lambda self: self.num_heads * self.head_dim)
    conv_dim = property(lambda self: 3 * self.qkv_dim)  # [q | k | v]


_UNIT = ("HEAD", "head h")
_NOTES = ("Per sequence b and head h: proj columns [q | k | v (H d each) | f_a (d) | b (H) | g_a "
          "(d)]; conv + silu of the head's q, k, v channels; q, k = x / sqrt(|x|^2 + 1e-6), "
          "q *= d^-1/2; beta = sigmoid(b); g = -exp(A_log) softplus(f_b bf16(f_a) + dt_bias) "
          "(channel-wise, [d]); the delta rule of GDN_CORE / GDN_REPLAY with decay diag(e^g) "
          "(ring entries k, u, g [H, d] each); out = bf16(RMSNorm(o) * w * sigmoid(g_b "
          "bf16(g_a))) into ssm_out [N, H d]. CONV_W: q|k|v taps [3 H d, K], then f_b [H d, d], "
          "then g_b [H d, d]; PARAM_OFF: A_log [H] then dt_bias [H d].")
KDA_CORE, KDA_REPLAY = register_core_ops(
    22, "KDA", "kda", _UNIT,
    ("conv + low-rank decay/gate + KDA delta rule (recurrent) + gated norm of one (sequence, "
     "head)", "as KDA_CORE by ReplaySSM (committed state + ring, fold every L)"), _NOTES,
    handler=("kda.KimiDeltaAttention",) * 2)


KDA_COMMIT = register_commit_op(34, "KDA", "kda", _UNIT,
                                handler="commit.KimiDeltaCommit")


@register_kind
class KimiDeltaAttention(RecurrentKind):
    name = "kda"
    config = KDAConfig
    core_op, replay_op, commit_op = KDA_CORE, KDA_REPLAY, KDA_COMMIT
    unit_label = ("head", "H")
    index_shape, index_check = KDAShape, staticmethod(check_kda)

    @classmethod
    def kernel_constants(cls, c) -> tuple[int, ...]:  # noqa: ANN001
        return (c.num_heads, c.head_dim, c.conv_kernel)

    @classmethod
    def sizes(cls, k: KDAConfig) -> Sizes:
        d = k.head_dim  # one unit = one head: its q, k, v channels, f_b and g_b rows
        return Sizes(k.num_heads, (k.num_heads, d, d), [(n, (k.num_heads, d)) for n in "kug"],
                     k.qkv_dim, k.num_heads + k.qkv_dim, 3 * k.qkv_dim + 2 * d + k.num_heads,
                     3 * d, (3 * d * k.conv_kernel + 2 * d * d) * 2, 1)

    @classmethod
    def unit_segments(cls, k: KDAConfig, unit: int) -> list[slice]:
        """Head h's q, k and v channels."""
        d = k.head_dim
        return [slice(o + unit * d, o + (unit + 1) * d) for o in (0, k.qkv_dim, 2 * k.qkv_dim)]

    # ---- checkpoint --------------------------------------------------------------------------
    @classmethod
    def shapes(cls, blk, model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
        k, h = blk.cfg, model.hidden_size
        d, hd = k.head_dim, k.qkv_dim
        out = {f"{n}_proj.weight": (hd, h) for n in "qkv"}
        out.update({f"{n}_conv1d.weight": (hd, 1, k.conv_kernel) for n in "qkv"})
        out.update({"f_a_proj.weight": (d, h), "f_b_proj.weight": (hd, d), "dt_bias": (hd,),
                    "A_log": (1, 1, k.num_heads, 1), "b_proj.weight": (k.num_heads, h),
                    "g_a_proj.weight": (d, h), "g_b_proj.weight": (hd, d),
                    "o_norm.weight": (d,), "o_proj.weight": (h, hd)})
        return out

    @classmethod
    def init_role(cls, local: str, blk) -> str:  # noqa: ANN001
        if local.endswith("conv1d.weight"):
            return "conv"
        return {"dt_bias": "dt_bias", "A_log": "A_log", "o_norm.weight": "norm_plain",
                "o_proj.weight": "out"}.get(local, "proj")

    # ---- packing -----------------------------------------------------------------------------
    @classmethod
    def vectors(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        k = blk.cfg
        return [("out_norm", (k.head_dim,)),
                ("conv", (k.conv_dim * k.conv_kernel + 2 * k.qkv_dim * k.head_dim,))]

    @classmethod
    def matrices(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        k, h = blk.cfg, model.hidden_size
        return [("proj", (cls.proj_width(k), h)), ("o", (h, k.qkv_dim))]

    @classmethod
    def quantized(cls, blk, model) -> list[str]:  # noqa: ANN001
        return [f"{n}_proj.weight" for n in ("q", "k", "v", "f_a", "b", "g_a", "o")]

    @classmethod
    def pack(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        proj = torch.cat([w(f"{n}_proj.weight") for n in ("q", "k", "v", "f_a", "b", "g_a")])
        pad = cls.proj_width(blk.cfg) - proj.shape[0]
        conv = torch.cat([w(f"{n}_conv1d.weight")[:, 0] for n in "qkv"])
        return {"out_norm": w("o_norm.weight"),
                "conv": torch.cat((conv.reshape(-1), w("f_b_proj.weight").reshape(-1),
                                   w("g_b_proj.weight").reshape(-1))),
                "proj": torch.cat((proj, proj.new_zeros(pad, proj.shape[1]))),
                "o": w("o_proj.weight")}

    @classmethod
    def tables(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        return {"ssm_params": torch.cat((w("A_log").reshape(-1), w("dt_bias").reshape(-1)))}
