"""Multi-head latent attention (Kimi Linear `full_attention`) with the latent cache.

    q = q_proj x                                                [H, d_nope + d_rope]
    [c | k_rope] = kv_a_proj_with_mqa x;  c = RMSNorm(c)        c [r], k_rope [d_rope] (all heads)
    cache <- (c, k_rope);  [k_nope | v] = kv_b_proj c  per cached position and head
    o = softmax(q . [k_nope | k_rope] / sqrt(d_nope + d_rope)) v  -> bf16 -> o_proj
No RoPE is applied anywhere, as in the HF KimiLinear model (its checkpoints set mla_use_nope); the
latent norm uses eps 1e-6 (HF constructs it without the config's eps).

Packed: proj [P, H] = [q_proj (H (dn + dr)) | kv_a_proj_with_mqa (r + dr)], zero rows up to a
multiple of 16; lat_norm [r] and kv_b [H (dn + dv), r] at the arena head; o [H, H dv]. The KV
cache slot of the layer holds k = c [B, 1, S_max, r] and v = k_rope [B, 1, S_max, dr], bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.isa.registry import OpSpec, register
from megakernel.layers.base import LayerKind, Need, StepShape, register_kind
from megakernel.layers.frame import OPROJ, proj_stage, residual_stage, round_rows
from megakernel.models.config import ConfigError, positive
from megakernel.program.stages import Instr, Stage

LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (Kimi). The cache holds (c, k_rope); HF applies no RoPE."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        positive(self, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim")
        if self.q_lora_rank is not None:
            positive(self, "q_lora_rank")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


MLA = register(OpSpec(
    24, "MLA", "mla", "latent norm -> latent cache, kv_b over the cache, attention of one "
    "(sequence, head)",
    (
        ("B_IDX", "sequence b"),
        ("HEAD", "head h"),
        ("PROJ_OFF", "f32: proj [N, P], columns [q (H (dn + dr)) | c (r) | k_rope (dr)]"),
        ("KVB_W", "weights: kv_b [H (dn + dv), r]"),
        ("NORM_W", "weights: kv_a_layernorm [r] (eps 1e-6)"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("OUT_OFF", "bf16: attention output [N, H dv]"),
    ),
    notes="For one sequence and head: c = bf16(RMSNorm(c)), computed by every head, stored by head "
    "0 into the latent cache (k of LAYER's KV slot, kv head 0, position lengths[b] + t), "
    "bf16(k_rope) into v (other heads use their own copy of the new positions, so they need not "
    "wait for head 0); [k_nope | v] = the head's rows of kv_b times c for every cached "
    "position; q = bf16(q); softmax(q . [k_nope | k_rope] / sqrt(dn + dr)) v -> bf16 columns "
    "h dv .. (h + 1) dv.",
    reach=True))


@register_kind
class MultiLatentAttention(LayerKind):
    name = "mla"
    config = MLAConfig
    kv_cache = True
    flow = {"PROJ": None, "MLA": "PROJ", "OPROJ": "MLA"}

    @classmethod
    def check(cls, blk, model) -> None:  # noqa: ANN001
        if blk.cfg.q_lora_rank is not None:
            raise ConfigError("MLA with a low-rank query projection (q_lora_rank) is not "
                              "implemented")

    @classmethod
    def proj_rows(cls, m: MLAConfig) -> int:
        return m.num_heads * m.qk_head_dim + m.latent

    # ---- checkpoint --------------------------------------------------------------------------
    @classmethod
    def shapes(cls, blk, model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
        m, h = blk.cfg, model.hidden_size
        q_out = m.num_heads * m.qk_head_dim
        out: dict[str, tuple[int, ...]] = {}
        if m.q_lora_rank is None:
            out["q_proj.weight"] = (q_out, h)
        else:
            out.update({"q_a_proj.weight": (m.q_lora_rank, h),
                        "q_a_layernorm.weight": (m.q_lora_rank,),
                        "q_b_proj.weight": (q_out, m.q_lora_rank)})
        out.update({
            "kv_a_proj_with_mqa.weight": (m.latent, h),
            "kv_a_layernorm.weight": (m.kv_lora_rank,),
            "kv_b_proj.weight": (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                 m.kv_lora_rank),
            "o_proj.weight": (h, m.num_heads * m.v_head_dim)})
        return out

    @classmethod
    def init_role(cls, local: str, blk) -> str:  # noqa: ANN001
        if local.endswith("layernorm.weight"):
            return "norm_plain"
        return "out" if local == "o_proj.weight" else "proj"

    # ---- packing -----------------------------------------------------------------------------
    @classmethod
    def vectors(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        m = blk.cfg
        return [("lat_norm", (m.kv_lora_rank,)),
                ("kvb", (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))]

    @classmethod
    def matrices(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        m, h = blk.cfg, model.hidden_size
        return [("proj", (round_rows(cls.proj_rows(m)), h)), ("o", (h, m.num_heads * m.v_head_dim))]

    @classmethod
    def pack(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        proj = torch.cat((w("q_proj.weight"), w("kv_a_proj_with_mqa.weight")))
        pad = round_rows(cls.proj_rows(blk.cfg)) - proj.shape[0]
        return {"lat_norm": w("kv_a_layernorm.weight"), "kvb": w("kv_b_proj.weight"),
                "proj": torch.cat((proj, proj.new_zeros(pad, proj.shape[1]))),
                "o": w("o_proj.weight")}

    # ---- buffers -----------------------------------------------------------------------------
    @classmethod
    def needs(cls, blk, model, shape: StepShape) -> list[Need]:  # noqa: ANN001
        m, n = blk.cfg, shape.rows
        return [Need("f32", "proj", (n, round_rows(cls.proj_rows(m)))),
                Need("bf16", "attn", (n, m.num_heads * m.v_head_dim))]

    @classmethod
    def kv(cls, blk, model, batch: int, max_seq_len: int):  # noqa: ANN001, ANN206
        m = blk.cfg
        return (batch, 1, max_seq_len, m.kv_lora_rank), (batch, 1, max_seq_len,
                                                         m.qk_rope_head_dim)

    # ---- program -----------------------------------------------------------------------------
    @classmethod
    def stages(cls, blk, ctx, wait: int) -> tuple[list[Stage], int]:  # noqa: ANN001
        m, layer, key = blk.cfg, blk.layer, blk.key
        proj, c_p = proj_stage(ctx, blk, round_rows(cls.proj_rows(m)), wait)
        f32, bf, i32 = ctx.buf.f32, ctx.buf.bf16, ctx.buf.i32
        tokens, context, lat = ctx.tokens, ctx.context, m.latent
        keys = context + tokens
        kvb_rows = m.qk_nope_head_dim + m.v_head_dim  # per head
        c_attn = ctx.ctr(f"L{layer}.attn")
        common = dict(PROJ_OFF=f32["proj"].offset, KVB_W=ctx.lay[f"{key}.kvb"].offset,
                      NORM_W=ctx.lay[f"{key}.lat_norm"].offset, LEN_OFF=i32["lengths"].offset,
                      OUT_OFF=bf["attn"].offset)

        def mk_mla(u0: int, u1: int) -> Instr:
            b, h = divmod(u0, m.num_heads)
            return Instr(MLA, layer, dict(B_IDX=b, HEAD=h, **common), wait=c_p, signal=c_attn,
                         # the first head of a sequence pulls the cached latents from HBM, the
                         # others find them in L2
                         w_bytes=(context * lat * 2 if h == 0 else 0)
                         + kvb_rows * m.kv_lora_rank * 2,
                         l2_bytes=tokens * (m.qk_head_dim + lat) * 4
                         + (context * lat * 2 if h else 0),
                         store_bytes=tokens * ((lat if h == 0 else 0) + m.v_head_dim) * 2,
                         fp32_flops=2.0 * keys * kvb_rows * m.kv_lora_rank
                         + 4.0 * tokens * keys * m.qk_head_dim)

        attn = Stage(f"L{layer}.attn", MLA, layer, ctx.batch * m.num_heads, False, mk_mla)
        o, c_o = residual_stage(ctx, OPROJ, blk, "o", m.num_heads * m.v_head_dim,
                                bf["attn"].offset, c_attn, f"L{layer}.oproj")
        return [proj, attn, o], c_o

    @classmethod
    def coverage(cls, blk, prog) -> dict[str, int]:  # noqa: ANN001
        return {"MLA": prog.batch * blk.cfg.num_heads}

    @classmethod
    def cover(cls, d: dict, blk, prog) -> tuple[int, int]:  # noqa: ANN001
        u = d["B_IDX"] * blk.cfg.num_heads + d["HEAD"]
        return u, u + 1

    @classmethod
    def step_bytes(cls, blk, prog) -> dict[str, float]:  # noqa: ANN001
        m = blk.cfg
        row = m.latent * 2  # latent c and k_rope, bf16, one position
        kvb = m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * 2
        return {"weights": prog.batch * kvb, "kv_read": prog.batch * prog.context * row,
                "kv_written": prog.rows * row}
