"""Multi-head latent attention (Kimi Linear `full_attention`) with the latent cache, decoded with
weight absorption.

    q = q_proj x                                                [H, d_nope + d_rope]
    [c | k_rope] = kv_a_proj_with_mqa x;  c = RMSNorm(c)        c [r], k_rope [d_rope] (all heads)
    cache <- (c, k_rope);  [k_nope | v] = kv_b_proj c  per cached position and head
    o = softmax(q . [k_nope | k_rope] / sqrt(d_nope + d_rope)) v  -> bf16 -> o_proj
No RoPE is applied anywhere, as in the HF KimiLinear model (its checkpoints set mla_use_nope); the
latent norm uses eps 1e-6 (HF constructs it without the config's eps).

Absorbed decode (kv_b's rows of head h: W_UK_h [dn, r], then W_UV_h [dv, r]): q_nope . W_UK_h c =
(W_UK_h^T q_nope) . c and softmax(.) W_UV_h c = W_UV_h (softmax(.) c), so a step never expands
kv_b over the cache; the heads share one latent key/value head (c, k_rope):
    MLA_Q   per head:                 q_lat = W_UK_h^T bf16(q_nope)  [N, H, r] f32
    MLA     per (sequence, split):    the latent of the new positions -> cache; split-KV attention
                                      of all H heads over [c | k_rope] with values c -> partials
    MLA_O   per head:                 merge the splits, o = W_UV_h o_lat -> bf16 -> OPROJ
The latent cache is read once per (sequence, step), kv_b once per step (not per sequence).

Packed: proj [P, H] = [q_proj (H (dn + dr)) | kv_a_proj_with_mqa (r + dr)], zero rows up to a
multiple of 16; lat_norm [r] and kv_b [H (dn + dv), r] at the arena head; o [H, H dv]. The KV
cache slot of the layer holds k = c [B, 1, S_max, r] and v = k_rope [B, 1, S_max, dr], bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.common.errors import ConfigError, positive
from megakernel.isa.registry import OpSpec, register
from megakernel.isa.stages import Instr, Stage
from megakernel.kernel.host.mla_index import MLAShape, check_mla, key_chunk
from megakernel.layers.base import LayerKind, Need, StepShape, register_kind
from megakernel.layers.frame import OPROJ, proj_stage, residual_stage, round_rows


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


MLA_Q = register(OpSpec(
    29, "MLA_Q", "mla", "absorb W_UK into one head's query: q_lat = W_UK_h^T q_nope, all N rows",
    (
        ("HEAD", "head h"),
        ("PROJ_OFF", "f32: proj [N, P], columns [q (H (dn + dr)) | c (r) | k_rope (dr)]"),
        ("KVB_W", "weights: kv_b [H (dn + dv), r]; W_UK_h = rows h (dn + dv) .. + dn"),
        ("QLAT_OFF", "f32: latent query [N, H, r]"),
    ),
    notes="For every row n: q_lat[n, h] = sum_i bf16(q[n, h, i]) W_UK_h[i, :] over the dn "
    "non-rotary columns of head h, fp32 accumulation.", device=True,
    handler="mla.LatentAttention"))

MLA = register(OpSpec(
    24, "MLA", "mla", "latent norm -> latent cache, split-KV attention of one (sequence, split) "
    "for all heads over the latent cache (keys [c | k_rope], values c)",
    (
        ("B_IDX", "sequence b"),
        ("SPLIT", "split s"),
        ("N_SPLITS", "S"),
        ("PROJ_OFF", "f32: proj [N, P], columns [q (H (dn + dr)) | c (r) | k_rope (dr)]"),
        ("QLAT_OFF", "f32: latent query [N, H, r] (MLA_Q)"),
        ("NORM_W", "weights: kv_a_layernorm [r] (eps 1e-6)"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("PO_OFF", "f32: partial latent o [S, N, H, r]"),
        ("PML_OFF", "f32: partial (m, l) [S, N, H, 2]"),
    ),
    notes="Keys 0 .. ctx-1 of sequence b (ctx = lengths[b] + T) are divided into S ranges "
    "[floor(s ctx / S), floor((s + 1) ctx / S)) (ATTN_PARTIAL's rule). The new positions "
    "lengths[b] + t in split s's range: c = bf16(RMSNorm(c)), k_rope = bf16(k_rope) from proj, "
    "stored into the latent cache (k / v of LAYER's KV slot, kv head 0) by this split alone; "
    "the other keys of the range are read from the cache (each cached latent is read once per "
    "step, by one split, for all heads). Token t sees keys <= lengths[b] + t; for each head h: "
    "score = (q_lat[n, h] . c + bf16(q_rope[n, h]) . k_rope) / sqrt(dn + dr) in fp32, partial "
    "m = max score, l = sum e^(score - m), o = sum e^(score - m) c [r] (an empty range: m = -inf, "
    "l = 0, o = 0) -> split s of PO_OFF / PML_OFF, rows bT .. bT + T - 1.",
    reach=True, device=True, handler="mla.LatentAttention"))

MLA_O = register(OpSpec(
    30, "MLA_O", "mla", "merge one head's MLA splits and apply W_UV after the attention, all N "
    "rows",
    (
        ("HEAD", "head h"),
        ("N_SPLITS", "S"),
        ("PO_OFF", "f32: partial latent o [S, N, H, r]"),
        ("PML_OFF", "f32: partial (m, l) [S, N, H, 2]"),
        ("KVB_W", "weights: kv_b [H (dn + dv), r]; W_UV_h = rows h (dn + dv) + dn .. + dv"),
        ("OUT_OFF", "bf16: attention output [N, H dv]"),
    ),
    notes="For every row n: merge splits 0..S-1 of head h in order (M = max m_s, o_lat = "
    "sum o_s e^(m_s - M) / sum l_s e^(m_s - M)), o = W_UV_h o_lat in fp32 -> bf16 columns "
    "h dv .. (h + 1) dv.", device=True, handler="mla.LatentAttention"))


def split_keys(s: int, n_splits: int, context: int, tokens: int) -> tuple[int, int]:
    """(cached, new) keys of split s when every sequence has `context` cached keys (MLA's split
    rule at the planned context): what the split reads from the cache and stores into it."""
    ctx = context + tokens
    k0, k1 = s * ctx // n_splits, (s + 1) * ctx // n_splits
    return max(0, min(k1, context) - k0), max(0, k1 - max(k0, context))


@register_kind
class MultiLatentAttention(LayerKind):
    name = "mla"
    config = MLAConfig
    kv_cache = True
    flow = {"PROJ": None, "MLA_Q": "PROJ", "MLA": "MLA_Q", "MLA_O": "MLA", "OPROJ": "MLA_O"}
    # a split attends all H heads of its sequence (one latent kv head), H times a dense split's
    # work per key: about one split per SM at B = 1, each at least two of the kernel's key
    # chunks (kernel/mla_index.key_chunk: 8 keys at Kimi's rank 512)
    splits = (64, 16)

    @classmethod
    def split_heads(cls, cfg: MLAConfig) -> int:
        return 1

    @classmethod
    def kernel_constants(cls, c) -> tuple[int, ...]:  # noqa: ANN001
        return (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                c.v_head_dim)

    @classmethod
    def matvec_shapes(cls, spec) -> dict[str, list[tuple[int, int]]]:  # noqa: ANN001 (KernelSpec)
        c, h = MLAConfig(*spec.constants(cls.name)), spec.hidden
        return {"PROJ": [(h, round_rows(cls.proj_rows(c)))],
                "OPROJ": [(c.num_heads * c.v_head_dim, h)]}

    @classmethod
    def kernel_shape(cls, spec):  # noqa: ANN001, ANN206 (KernelSpec -> mla_index.MLAShape)
        return MLAShape.for_spec(spec)

    @classmethod
    def kernel_check(cls, spec) -> str:  # noqa: ANN001
        return check_mla(cls.kernel_shape(spec))

    @classmethod
    def kv_layout(cls, spec) -> dict[str, tuple[int, int]]:  # noqa: ANN001
        c = MLAConfig(*spec.constants(cls.name))  # the latent cache: c [.., r], k_rope [.., dr]
        return {"k_cache": (1, c.kv_lora_rank), "v_cache": (1, c.qk_rope_head_dim)}

    @classmethod
    def check_kernel_record(cls, d: dict, spec) -> str:  # noqa: ANN001
        heads = spec.constants(cls.name)[0]
        if d["OPCODE"] in (MLA_Q, MLA_O) and not 0 <= d["HEAD"] < heads:
            return f"head {d['HEAD']} outside the build's H={heads}"
        if d["OPCODE"] == MLA and not (0 <= d["B_IDX"] < spec.batch
                                       and 0 <= d["SPLIT"] < d["N_SPLITS"]):
            return (f"sequence {d['B_IDX']}, split {d['SPLIT']}/{d['N_SPLITS']} outside the "
                    f"build's B={spec.batch}")
        return ""

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
    def quantized(cls, blk, model) -> list[str]:  # noqa: ANN001
        return ["q_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight"]

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
        m, n, s, hh = blk.cfg, shape.rows, shape.n_splits, blk.cfg.num_heads
        return [Need("f32", "proj", (n, round_rows(cls.proj_rows(m)))),
                Need("f32", "qlat", (n, hh, m.kv_lora_rank)),
                Need("f32", "part_o", (s, n, hh, m.kv_lora_rank)),
                Need("f32", "part_ml", (s, n, hh, 2)),
                Need("bf16", "attn", (n, hh * m.v_head_dim))]

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
        n, tokens, hh, r, s_n = ctx.rows, ctx.tokens, m.num_heads, m.kv_lora_rank, ctx.n_splits
        dn, dv, lat = m.qk_nope_head_dim, m.v_head_dim, m.latent
        kvb = ctx.lay[f"{key}.kvb"].offset
        c_q, c_attn, c_mo = (ctx.ctr(f"L{layer}.{x}") for x in ("mla_q", "attn", "mla_o"))
        parts = dict(N_SPLITS=s_n, PO_OFF=f32["part_o"].offset, PML_OFF=f32["part_ml"].offset)

        def mk_q(u0: int, u1: int) -> Instr:
            return Instr(MLA_Q, layer, dict(HEAD=u0, PROJ_OFF=f32["proj"].offset, KVB_W=kvb,
                                            QLAT_OFF=f32["qlat"].offset),
                         wait=c_p, signal=c_q, w_bytes=dn * r * 2, l2_bytes=n * dn * 4,
                         store_bytes=n * r * 4, **ctx.matvec_flops(r, dn))

        kc = key_chunk(lat)  # the kernel scores whole chunks of keys

        def mk_attn(u0: int, u1: int) -> Instr:
            b, sp = divmod(u0, s_n)
            cached, new = split_keys(sp, s_n, ctx.context, tokens)
            keys = cached + new
            scored = -(-keys // kc) * kc
            return Instr(MLA, layer, dict(
                B_IDX=b, SPLIT=sp, PROJ_OFF=f32["proj"].offset, QLAT_OFF=f32["qlat"].offset,
                NORM_W=ctx.lay[f"{key}.lat_norm"].offset, LEN_OFF=i32["lengths"].offset,
                **parts), wait=c_q, signal=c_attn,
                w_bytes=cached * lat * 2,  # the split's cached latents: once for all heads
                l2_bytes=tokens * hh * (r + m.qk_rope_head_dim) * 4 + new * lat * 4,
                store_bytes=tokens * hh * (r + 2) * 4 + new * lat * 2,
                fp32_flops=2.0 * tokens * hh * (scored * lat + keys * r))

        def mk_o(u0: int, u1: int) -> Instr:
            return Instr(MLA_O, layer, dict(HEAD=u0, KVB_W=kvb, OUT_OFF=bf["attn"].offset,
                                            **parts),
                         wait=c_attn, signal=c_mo, w_bytes=dv * r * 2,
                         l2_bytes=s_n * n * (r + 2) * 4, store_bytes=n * dv * 2,
                         fp32_flops=2.0 * n * (s_n + dv) * r)

        stages = [proj, Stage(f"L{layer}.mla_q", MLA_Q, layer, hh, False, mk_q),
                  Stage(f"L{layer}.attn", MLA, layer, ctx.batch * s_n, False, mk_attn),
                  Stage(f"L{layer}.mla_o", MLA_O, layer, hh, False, mk_o)]
        o, c_o = residual_stage(ctx, OPROJ, blk, "o", hh * dv, bf["attn"].offset, c_mo,
                                f"L{layer}.oproj")
        return [*stages, o], c_o

    @classmethod
    def coverage(cls, blk, prog) -> dict[str, int]:  # noqa: ANN001
        h = blk.cfg.num_heads
        return {"MLA_Q": h, "MLA": prog.batch * prog.n_splits, "MLA_O": h}

    @classmethod
    def cover(cls, d: dict, blk, prog) -> tuple[int, int]:  # noqa: ANN001
        """The work unit of a record: a head (MLA_Q, MLA_O) or a (sequence, split) (MLA)."""
        u = d["HEAD"] if "HEAD" in d else d["B_IDX"] * prog.n_splits + d["SPLIT"]
        return u, u + 1

    @classmethod
    def step_bytes(cls, blk, prog) -> dict[str, float]:  # noqa: ANN001
        """kv_b once per step (W_UK by MLA_Q, W_UV by MLA_O); the latent cache once per
        (sequence, step), shared by all heads."""
        m = blk.cfg
        row = m.latent * 2  # latent c and k_rope, bf16, one position
        kvb = m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * 2
        return {"weights": kvb, "kv_read": prog.batch * prog.context * row,
                "kv_written": prog.rows * row}
