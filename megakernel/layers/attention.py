"""Softmax attention over a KV cache: Llama, Qwen3 (q/k norm), Qwen2 (q/k/v biases), Qwen3.5
(gated, (1+w) q/k norm, partial RoPE) and Nemotron-H (no RoPE).

Block: h += o_proj(attention(q, k, v)) with q, k, v from RMSNorm(h). Per kv head g the packed QKV
rows are the q heads g*G .. g*G+G-1, then (output gate) their gate heads, then k_g, then v_g, each
head D consecutive rows; with q/k/v biases the bias [rows] directly follows the matrix in the arena
(same order). A QKV slab is whole heads of one group, so q/k norm and RoPE run in its epilogue.

Rounding points (the reference's bf16 mode): q/k get the (q/k norm in fp32), then RoPE in fp32
with the fp32 cos/sin table, then round to bf16 (q to the q buffer, k to the cache); v rounded into
the cache; the gate stays fp32; attention in fp32; the output times sigmoid(gate) rounded to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megakernel.common.errors import ConfigError, positive
from megakernel.common.rope import RopeConfig
from megakernel.isa.records import SUPPORTED_HEAD_DIMS
from megakernel.isa.registry import MATVEC, OpSpec, register
from megakernel.isa.stages import Instr, ProgramError, Stage
from megakernel.kernel.host.dense_index import (
    attn_merge_round_trips,
    attn_mma_work,
    attn_round_trips,
    attn_tensor_cores,
)
from megakernel.layers.base import (
    CONST,
    LayerKind,
    Need,
    StepShape,
    misaligned,
    register_kind,
)
from megakernel.layers.frame import OPROJ, residual_stage


@dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention. `rotary_dim` dims of each q/k head get RoPE (0: none); q/k norm
    uses the model's RMSNorm form; `output_gate`: q_proj holds [q | gate] per head and the output
    is multiplied by sigmoid(gate); `qkv_bias`: q, k, v projections have biases."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int = 0
    rope: RopeConfig = field(default_factory=RopeConfig)
    qk_norm: bool = False
    output_gate: bool = False
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        positive(self, "num_heads", "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                              f"({self.num_kv_heads})")
        if self.rotary_dim < 0 or self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"rotary_dim must be even and in [0, head_dim={self.head_dim}], "
                              f"got {self.rotary_dim}")

    # query heads per kv head
    group_size = property(lambda self: self.num_heads // self.num_kv_heads)
    q_size = property(lambda self: self.num_heads * self.head_dim)
    kv_size = property(lambda self: self.num_kv_heads * self.head_dim)

    @property
    def slots(self) -> int:
        """Packed head slots per kv group: q heads, (gate heads,) k, v."""
        return self.group_size * (2 if self.output_gate else 1) + 2

    @property
    def qkv_rows(self) -> int:
        return self.num_kv_heads * self.slots * self.head_dim

    def inv_freq(self) -> list[float]:
        """Inverse frequencies [rotary_dim / 2] in float64."""
        return self.rope.inv_freq(self.rotary_dim)


QKV = register(OpSpec(
    2, "QKV", "attention",
    "RMSNorm(h) -> slab of the fused QKV (whole heads of one kv group) -> (+ bias) -> q/k norm ->"
    " RoPE -> q (bf16), gate (f32), k/v into the KV cache",
    MATVEC + (
        ("QK_NORM_OFF", "weights: q_norm [D] then k_norm [D] (-1: no q/k norm)"),
        ("ROPE_OFF", "f32: cos [S_max, R/2] then sin [S_max, R/2], R = header ROTARY_DIM (-1: "
                     "no RoPE)"),
    ),
    notes="OUT_OFF = bf16 q [N, Hq, D]. Packed row r is head slot r // D of the layer; slot j of "
    "group g = slot // SLOTS (header QKV_SLOTS) is q head g*G + j for j < G, its gate head (header "
    "OUTPUT_GATE) for G <= j < 2G, then k, then v. Bias (header QKV_BIAS): bias[row] follows the "
    "layer's matrix directly, at (W - ROW0 * K) + QKV_ROWS * K. q/k: bias, RMSNorm per head with "
    "the weight (NORM_KIND: w or 1 + w), RoPE (rotate-half) on the first R dims at position "
    "lengths[b] + t, bf16. gate -> f32 header F32_GATE_OFF [N, Hq, D]. k, v -> KV cache slot of "
    "LAYER (kv slot: attention layers in order), sequence b, kv head g, position lengths[b] + t.",
    slab=True, matvec="qkv.QKV", device=True))

ATTN_PARTIAL = register(OpSpec(
    3, "ATTN_PARTIAL", "attention",
    "split-KV attention of one (sequence, kv head, split): T tokens, G q heads; the last split to "
    "finish merges all S into the bf16 attention output",
    (
        ("B_IDX", "sequence b"),
        ("KV_HEAD", "kv head g (serves q heads g*G .. g*G+G-1)"),
        ("SPLIT", "split s"),
        ("N_SPLITS", "S"),
        ("Q_OFF", "bf16: q [N, Hq, D]"),
        ("PO_OFF", "f32: partial o [S, N, Hq, D]"),
        ("PML_OFF", "f32: partial (m, l) [S, N, Hq, 2]"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("OUT_OFF", "bf16: attention output [N, Hq * D] (written by the merge)"),
        ("DONE_CID", "counter the merging CTA adds 1 to after storing the merged output"),
    ),
    notes="Keys 0 .. ctx-1 of sequence b (ctx = lengths[b] + T) are divided into S ranges "
    "[floor(s ctx / S), floor((s + 1) ctx / S)); split s of query token t covers that range "
    "clipped to keys <= lengths[b] + t (possibly empty: m = -inf, l = 0, o = 0). Partial: m = max "
    "score, l = sum exp(score - m), o = sum exp(score - m) v, scores (q . k) / sqrt(D) in fp32. "
    "SIGNAL_CID is the (b, g) ticket counter (S increments per step): after storing its partial "
    "the CTA adds 1 with acq_rel and gets the old value; the one that gets epoch * S + S - 1 "
    "merges splits 0..S-1 in order (M = max m, out = sum(o_s e^(m_s - M)) / sum(l_s e^(m_s - M)))"
    ", multiplies by sigmoid(gate) (header OUTPUT_GATE), rounds to bf16, stores heads g*G .. "
    "g*G+G-1 of all T tokens and adds 1 to DONE_CID (B * Hkv increments per step).",
    reach=True, ticket=True, device=True, handler="attention.Attention"))


LANES = 32  # a warp: the QKV epilogue holds head dims lane + 32 e


def rope_layout_error(rotary: int, head_dim: int) -> str:
    """Why the kernel's QKV epilogue cannot rotate `rotary` of `head_dim` dims ('' when it can).
    Lane holds dims lane + 32 e: the partners d, d +- R/2 share a lane when R/2 is a multiple of
    32, or are lanes of e = 0 (one shuffle) when R <= 32."""
    if rotary in (0, head_dim) or (rotary // 2) % LANES == 0 or rotary <= LANES:
        return ""
    return (f"RoPE on {rotary} of {head_dim} head dims (the kernel rotates R <= {LANES} dims "
            f"or R/2 a multiple of {LANES})")


@register_kind
class Attention(LayerKind):
    name = "attention"
    config = AttentionConfig
    kv_cache = True
    flow = {"QKV": None, "ATTN_PARTIAL": "QKV", "OPROJ": "ATTN_PARTIAL"}

    @classmethod
    def split_heads(cls, cfg: AttentionConfig) -> int:
        return cfg.num_kv_heads

    # ---- kernel build --------------------------------------------------------------------------
    @classmethod
    def kernel_constants(cls, c: AttentionConfig) -> tuple[int, ...]:
        # (KernelSpec.heads, kv_heads, head_dim, qk_norm, qkv_bias, rotary_dim, output_gate)
        return (c.num_heads, c.num_kv_heads, c.head_dim, int(c.qk_norm), int(c.qkv_bias),
                c.rotary_dim, int(c.output_gate))

    @classmethod
    def kernel_support(cls, c: AttentionConfig) -> str:
        return rope_layout_error(c.rotary_dim, c.head_dim)

    @classmethod
    def kernel_check(cls, spec) -> str:  # noqa: ANN001 (KernelSpec)
        if spec.head_dim not in SUPPORTED_HEAD_DIMS:
            return (f"unsupported head_dim {spec.head_dim}; the kernel supports "
                    f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
        if spec.head_dim % (2 * LANES):  # E = D / 32 per lane, split in RoPE halves
            return f"head_dim {spec.head_dim} must be a multiple of {2 * LANES}"
        if spec.output_gate and spec.gate_off < 0:
            return "a gated build needs the gate buffer's offset (gate_off)"
        return rope_layout_error(spec.rotary_dim, spec.head_dim)

    @classmethod
    def matvec_shapes(cls, spec) -> dict[str, list[tuple[int, int]]]:  # noqa: ANN001
        return {"QKV": [(spec.hidden, spec.qkv_rows)],
                "OPROJ": [(spec.heads * spec.head_dim, spec.hidden)]}

    @classmethod
    def kernel_header(cls, spec) -> dict[str, int]:  # noqa: ANN001
        out = {"ROTARY_DIM": spec.rotary_dim, "OUTPUT_GATE": int(spec.output_gate)}
        if spec.output_gate:
            out["F32_GATE_OFF"] = spec.gate_off
        return out

    @classmethod
    def kv_layout(cls, spec) -> dict[str, tuple[int, int]]:  # noqa: ANN001
        return {"k_cache": (spec.kv_heads, spec.head_dim),
                "v_cache": (spec.kv_heads, spec.head_dim)}

    @classmethod
    def check_kernel_record(cls, d: dict, spec) -> str:  # noqa: ANN001
        if d["OPCODE"] == QKV and (d["NROWS"] % spec.head_dim or d["ROW0"] % spec.head_dim):
            return (f"a QKV slab of {d['NROWS']} rows at row {d['ROW0']} is not whole heads of "
                    f"{spec.head_dim}")
        if d["OPCODE"] == ATTN_PARTIAL:
            if not (0 <= d["B_IDX"] < spec.batch and 0 <= d["KV_HEAD"] < spec.kv_heads
                    and 0 <= d["SPLIT"] < d["N_SPLITS"]):
                return (f"sequence {d['B_IDX']}, kv head {d['KV_HEAD']}, split {d['SPLIT']}/"
                        f"{d['N_SPLITS']} outside the build's B={spec.batch}, "
                        f"Hkv={spec.kv_heads}")
            return misaligned(d, {"PO_OFF": 4})
        return ""

    # ---- checkpoint --------------------------------------------------------------------------
    @classmethod
    def shapes(cls, blk, model) -> dict[str, tuple[int, ...]]:  # noqa: ANN001
        c, h = blk.cfg, model.hidden_size
        q_out = c.q_size * (2 if c.output_gate else 1)  # gated: [q | gate] per head
        out = {"q_proj.weight": (q_out, h),
               "k_proj.weight": (c.kv_size, h), "v_proj.weight": (c.kv_size, h),
               "o_proj.weight": (h, c.q_size)}
        if c.qk_norm:
            out.update({"q_norm.weight": (c.head_dim,), "k_norm.weight": (c.head_dim,)})
        if c.qkv_bias:
            out.update({"q_proj.bias": (q_out,), "k_proj.bias": (c.kv_size,),
                        "v_proj.bias": (c.kv_size,)})
        return out

    @classmethod
    def init_role(cls, local: str, blk) -> str:  # noqa: ANN001
        if local in ("q_norm.weight", "k_norm.weight"):
            return "qk_norm"
        if local in ("q_proj.weight", "k_proj.weight"):
            return "qk_proj"
        if local == "o_proj.weight":
            return "out"
        return super().init_role(local, blk)

    @classmethod
    def check(cls, blk, model) -> None:  # noqa: ANN001
        d = blk.cfg.head_dim
        if d not in SUPPORTED_HEAD_DIMS:
            raise ConfigError(f"unsupported head_dim {d}; megakernel supports "
                              f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")

    # ---- packing -----------------------------------------------------------------------------
    @classmethod
    def vectors(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        return [("qk_norm", (2, blk.cfg.head_dim))] if blk.cfg.qk_norm else []

    @classmethod
    def matrices(cls, blk, model) -> list[tuple[str, tuple[int, ...]]]:  # noqa: ANN001
        c, h = blk.cfg, model.hidden_size
        out = [("qkv", (c.qkv_rows, h))]
        if c.qkv_bias:
            out.append(("qkv_bias", (c.qkv_rows,), True))  # directly after the matrix
        return out + [("o", (h, c.q_size))]

    @classmethod
    def quantized(cls, blk, model) -> list[str]:  # noqa: ANN001
        return [f"{n}_proj.weight" for n in "qkvo"]

    @classmethod
    def pack(cls, blk, model, w) -> dict[str, torch.Tensor]:  # noqa: ANN001
        c = blk.cfg
        out = {"qkv": qkv_rows(c, w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")),
               "o": w("o_proj.weight")}
        if c.qk_norm:
            out["qk_norm"] = torch.stack((w("q_norm.weight"), w("k_norm.weight")))
        if c.qkv_bias:
            out["qkv_bias"] = qkv_rows(c, w("q_proj.bias")[:, None], w("k_proj.bias")[:, None],
                                       w("v_proj.bias")[:, None])[:, 0]
        return out

    # ---- buffers -----------------------------------------------------------------------------
    @classmethod
    def needs(cls, blk, model, shape: StepShape) -> list[Need]:  # noqa: ANN001
        c, n, s = blk.cfg, shape.rows, shape.n_splits
        # the gate first: its offset then does not depend on the split count (the kernel takes
        # it as a compile-time constant, kernel/config/spec.py gate_offset)
        out = [Need("f32", "gate", (n, c.num_heads, c.head_dim))] if c.output_gate else []
        out += [Need("f32", "part_o", (s, n, c.num_heads, c.head_dim)),
                Need("f32", "part_ml", (s, n, c.num_heads, 2)),
                Need("bf16", "q", (n, c.num_heads, c.head_dim)),
                Need("bf16", "attn", (n, c.q_size))]
        if c.rotary_dim:
            out.append(Need("f32", "rope", (2, shape.max_seq_len, c.rotary_dim // 2), CONST,
                            const=True))
        return out

    @classmethod
    def constants(cls, blk, model, shape: StepShape) -> dict[str, torch.Tensor]:  # noqa: ANN001
        """The fp32 cos/sin tables [2, S_max, R/2] from float64 angles (the reference's recipe)."""
        c = blk.cfg
        if not c.rotary_dim:
            return {}
        inv = torch.tensor(c.inv_freq(), dtype=torch.float64)
        ang = torch.arange(shape.max_seq_len, dtype=torch.float64)[:, None] * inv
        return {"rope": torch.stack((ang.cos(), ang.sin())).to(torch.float32)}

    @classmethod
    def kv(cls, blk, model, batch: int, max_seq_len: int):  # noqa: ANN001, ANN206
        c = blk.cfg
        s = (batch, c.num_kv_heads, max_seq_len, c.head_dim)
        return s, s

    # ---- program -----------------------------------------------------------------------------
    @classmethod
    def header(cls, blk, model) -> dict[str, int]:  # noqa: ANN001
        c = blk.cfg
        return dict(HQ=c.num_heads, HKV=c.num_kv_heads, D=c.head_dim, QK_NORM=int(c.qk_norm),
                    ROTARY_DIM=c.rotary_dim, OUTPUT_GATE=int(c.output_gate),
                    QKV_BIAS=int(c.qkv_bias), QKV_SLOTS=c.slots, QKV_ROWS=c.qkv_rows)

    @classmethod
    def stages(cls, blk, ctx, wait: int) -> tuple[list[Stage], int]:  # noqa: ANN001
        c, layer, key = blk.cfg, blk.layer, blk.key
        n, hid, d, g, hkv = ctx.rows, ctx.model.hidden_size, c.head_dim, c.group_size, \
            c.num_kv_heads
        tokens, n_splits, context = ctx.tokens, ctx.n_splits, ctx.context
        lay, f32, bf, i32, ctr = ctx.lay, ctx.buf.f32, ctx.buf.bf16, ctx.buf.i32, ctx.ctr
        slots = c.slots
        qkv_off = lay[f"{key}.qkv"].offset
        qkn = lay[f"{key}.qk_norm"].offset if c.qk_norm else -1
        rope = f32["rope"].offset if c.rotary_dim else -1
        gate_bytes = tokens * g * d * 4 if c.output_gate else 0

        def mk_qkv(u0: int, u1: int) -> Instr:
            grp = u0 // slots
            assert (u1 - 1) // slots == grp, "a QKV slab must stay within one kv group"
            rows = (u1 - u0) * d
            return ctx.matvec(QKV, layer, qkv_off, u0 * d, rows, hid, lay[f"{key}.norm"].offset,
                              f32["h"].offset, bf["q"].offset, wait, ctr(f"L{layer}.qkv.g{grp}"),
                              n * rows * 2, QK_NORM_OFF=qkn, ROPE_OFF=rope)

        out = [Stage(f"L{layer}.qkv", QKV, layer, hkv * slots, False, mk_qkv)]
        c_attn = ctr(f"L{layer}.attn")
        keys_split = -(-(context + tokens) // n_splits)
        tight, recurrent = ctx.buf.paged is not None, bool(ctx.model.recurrent_layers())
        if attn_tensor_cores(d, g, tokens, tight=tight, recurrent=recurrent):  # attention_mma.py
            tensor_flops, fp32_flops = attn_mma_work(keys_split, d)
        else:
            tensor_flops, fp32_flops = 0.0, 4.0 * tokens * g * keys_split * d

        def mk_part(u0: int, u1: int) -> Instr:
            b, rest = divmod(u0, hkv * n_splits)
            kvh, s = divmod(rest, n_splits)
            cached = max(0, min(keys_split, context - s * keys_split))
            return Instr(ATTN_PARTIAL, layer, dict(
                B_IDX=b, KV_HEAD=kvh, SPLIT=s, N_SPLITS=n_splits, Q_OFF=bf["q"].offset,
                PO_OFF=f32["part_o"].offset, PML_OFF=f32["part_ml"].offset,
                LEN_OFF=i32["lengths"].offset, OUT_OFF=bf["attn"].offset, DONE_CID=c_attn),
                wait=ctr(f"L{layer}.qkv.g{kvh}"), signal=ctr(f"L{layer}.part.b{b}.g{kvh}"),
                w_bytes=cached * d * 4, l2_bytes=tokens * g * d * 2 + tokens * d * 4,
                store_bytes=tokens * g * (d + 2) * 4,
                fp32_flops=fp32_flops, tensor_flops=tensor_flops,
                merge_l2_bytes=n_splits * tokens * g * (d + 2) * 4 + gate_bytes,
                round_trips=attn_round_trips(keys_split, d, g, tokens, tight=tight,
                                             recurrent=recurrent),
                merge_store_bytes=tokens * g * d * 2,
                merge_flops=4.0 * n_splits * tokens * g * d,
                merge_round_trips=attn_merge_round_trips(n_splits, d, g, tokens))

        out.append(Stage(f"L{layer}.attn_partial", ATTN_PARTIAL, layer,
                         ctx.batch * hkv * n_splits, False, mk_part))
        o_stage, c_o = residual_stage(ctx, OPROJ, blk, "o", c.q_size, bf["attn"].offset, c_attn,
                                      f"L{layer}.oproj")
        return out + [o_stage], c_o

    @classmethod
    def check_record(cls, d: dict, blk, prog, where: str) -> None:  # noqa: ANN001
        if d["OPCODE"].name != "QKV":
            return
        dh, slots = blk.cfg.head_dim, blk.cfg.slots
        if d["ROW0"] % dh or d["NROWS"] % dh:
            raise ProgramError(f"{where}: QKV slab is not whole heads")
        h0, h1 = d["ROW0"] // dh, (d["ROW0"] + d["NROWS"]) // dh
        if h0 // slots != (h1 - 1) // slots:
            raise ProgramError(f"{where}: QKV slab crosses kv groups")

    @classmethod
    def coverage(cls, blk, prog) -> dict[str, int]:  # noqa: ANN001
        return {"ATTN_PARTIAL": prog.batch * blk.cfg.num_kv_heads * prog.n_splits}

    @classmethod
    def cover(cls, d: dict, blk, prog) -> tuple[int, int]:  # noqa: ANN001
        """The work unit of a record of an opcode in `coverage`: (sequence, kv head, split)."""
        u = (d["B_IDX"] * blk.cfg.num_kv_heads + d["KV_HEAD"]) * prog.n_splits + d["SPLIT"]
        return u, u + 1

    # ---- cost --------------------------------------------------------------------------------
    @classmethod
    def step_bytes(cls, blk, prog) -> dict[str, float]:  # noqa: ANN001
        c = blk.cfg
        row = c.num_kv_heads * c.head_dim * 2 * 2  # k and v, bf16, one position
        return {"kv_read": prog.batch * prog.context * row, "kv_written": prog.rows * row}


def qkv_rows(c: AttentionConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
             ) -> torch.Tensor:
    """q_proj [Hq (2) D, X] ([q | gate] per head when gated), k, v [Hkv D, X] -> the packed
    [Hkv SLOTS D, X], grouped by kv head (module docstring)."""
    hkv, g, d = c.num_kv_heads, c.group_size, c.head_dim
    x = q.shape[1]
    if c.output_gate:
        q = q.reshape(hkv, g, 2, d, x)  # [group, j, q|gate, D, X]
        heads = torch.cat((q[:, :, 0].reshape(hkv, g * d, x), q[:, :, 1].reshape(hkv, g * d, x)),
                          dim=1)
    else:
        heads = q.reshape(hkv, g * d, x)
    return torch.cat((heads, k.reshape(hkv, d, x), v.reshape(hkv, d, x)), dim=1).reshape(-1, x)
