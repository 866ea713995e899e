"""The QKV epilogue (attention's matvec; epilogue.py's interface): per (head, row) of a chunk of
whole heads, the bias, the per-head q/k RMSNorm, RoPE on the first rotary dims, then bf16 into the
q buffer or the layer's KV cache slot (contiguous or paged), gate heads in fp32 into the gate
buffer. Lane holds head dims lane + 32 e, e < E = D / 32 (D = 64, 128, 256).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.config.fields import mv, word
from megakernel.kernel.device.epilogue import Chunk, Epilogue
from megakernel.kernel.device.memory import join64, ld, st
from megakernel.kernel.host.dense_index import (
    gate_index,
    kv_row,
    kv_slot,
    qkv_bias_index,
    qkv_slot,
    rope_pair,
)
from megakernel.kernel.host.fp8_index import qkv_bias_index as fp8_qkv_bias_index
from megakernel.kernel.host.limits import LANES
from megakernel.kernel.host.paged_index import k_elem, page_base, slot_block, v_elem


class QKV(Epilogue):
    """QKV: the fused q/k/v (and gate) projection's epilogue (layers/attention.py)."""

    def __init__(self, m):  # noqa: ANN001 (matvec.Matvec)
        super().__init__(m)
        spec = self.spec = m.spec
        self.QKV_ROWS = spec.qkv_rows  # rows of a layer's packed QKV matrix (bias follows it)
        self.N, self.T, self.B, self.NO, self.NW = spec.rows, spec.tokens, spec.batch, m.NO, m.NW
        self.D, self.Hq, self.Hkv, self.G = spec.head_dim, spec.heads, spec.kv_heads, spec.group
        self.E = spec.head_dim // LANES  # head elements per lane
        self.eps = spec.eps

    @property
    def fp8(self) -> bool:
        """The layer's QKV matrix is FP8 (spec.fp8_ops): its bias follows R*K bytes of codes."""
        return any(op in self.spec.fp8_ops for op in self.ops)

    @cute.jit
    def run(self, op: Int32, c: Chunk):
        """Per (head, row): (qwen2) + bias, (qwen3) per-head RMSNorm, RoPE on the first
        spec.rotary_dim dims, bf16 -> q buffer or the KV cache slot of the layer (spec.kv_slot);
        (Qwen3.5) gate heads in fp32 -> the gate buffer. Lane holds head dims lane + 32 e,
        e < E = D / 32 (D = 64, 128, 256)."""
        rec, layer, row0, rc0, nr, n0 = c.rec, c.layer, c.row0, c.rc0, c.nr, c.n0
        ksplit, nrp, q_off, sAcc, warp, lane = c.ksplit, c.nrp, c.out_off, c.sAcc, c.warp, c.lane
        pW, pF, pB, pI, pK, pV = c.weights, c.f32, c.bf16, c.i32, c.k_cache, c.v_cache
        s_max, len_off = c.s_max, c.len_off
        D, E, G = self.D, self.E, self.G
        NG = G if self.spec.output_gate else 0  # gate head slots per group
        qkn_off, rope_off = rec[word(Op.QKV, "QK_NORM_OFF")], rec[word(Op.QKV, "ROPE_OFF")]
        bias0 = Int64(0)  # arena element of the bias of chunk row 0 (spec.qkv_bias_index)
        if cutlass.const_expr(self.spec.qkv_bias):  # after the matrix: bf16 or FP8 codes
            w_qkv = join64(rec[mv("W_LO")], rec[mv("W_HI")])
            if cutlass.const_expr(self.fp8):
                bias0 = fp8_qkv_bias_index(w_qkv, Int64(row0), Int64(rec[mv("K")]), self.QKV_ROWS,
                                           Int64(rc0))
            else:
                bias0 = qkv_bias_index(w_qkv, Int64(row0), Int64(rec[mv("K")]), self.QKV_ROWS,
                                       Int64(rc0))
        hd = self.spec.rotary_dim // 2  # R/2: cos/sin columns
        half = hd // LANES  # registers e < half pair with e + half (R/2 a multiple of 32)
        sin_off = rope_off + s_max * hd  # sin [S_max, R/2] follows cos directly (isa.py)
        nh = nr // D
        slot0 = (row0 + rc0) // D
        for item in cutlass.range(warp, nh * self.NO, self.NW):
            hh = item // self.NO
            nn = item - hh * self.NO
            n = n0 + nn
            if n < self.N:
                slot = slot0 + hh
                # j < G: q head grp*G + j; < G + NG: its gate head; G + NG: k; G + NG + 1: v
                grp, j = qkv_slot(slot, G, self.spec.output_gate)
                b = n // self.T
                t = n - b * self.T
                pos = ld(pI, len_off + b) + t
                x = cute.make_rmem_tensor((E,), Float32)
                for e in cutlass.range_constexpr(E):
                    x[e] = self.mv.acc_value(sAcc, nn, hh * D + lane + LANES * e, ksplit, nrp)
                if cutlass.const_expr(self.spec.qkv_bias):  # q = x W^T + b, before norm / RoPE
                    for e in cutlass.range_constexpr(E):
                        b_e = ld(pW, bias0 + Int64(hh * D + lane + LANES * e)).to(Float32)
                        x[e] = x[e] + b_e
                if cutlass.const_expr(NG == 0):
                    qk = j <= G
                else:
                    qk = (j < G) | (j == G + NG)
                if cutlass.const_expr(self.spec.qk_norm or self.spec.rope):  # q and k only
                    if qk:
                        if cutlass.const_expr(self.spec.qk_norm):
                            ss = Float32(0.0)
                            for e in cutlass.range_constexpr(E):
                                ss = ss + x[e] * x[e]
                            ss = cute.arch.warp_reduction_sum(ss)
                            ms = ss / Float32(D) + Float32(self.eps)
                            rstd = Float32(1.0) / cute.math.sqrt(ms)
                            woff = qkn_off
                            if j == G + NG:
                                woff = qkn_off + D
                            for e in cutlass.range_constexpr(E):
                                w = ld(pW, woff + lane + LANES * e).to(Float32)
                                if cutlass.const_expr(self.spec.norm_one_plus):
                                    w = w + Float32(1.0)
                                x[e] = (x[e] * rstd) * w
                        if cutlass.const_expr(self.spec.rope and half > 0):
                            for e in cutlass.range_constexpr(half):
                                i = lane + LANES * e
                                cs = ld(pF, rope_off + pos * hd + i)
                                sn = ld(pF, sin_off + pos * hd + i)
                                x1 = x[e]
                                x2 = x[e + half]
                                x[e] = x1 * cs + (-x2) * sn
                                x[e + half] = x2 * cs + x1 * sn
                        if cutlass.const_expr(self.spec.rope and half == 0):  # R <= 32
                            self.rope_lanes(x, lane, pos, pF, rope_off, sin_off, hd)
                if j < G:
                    base = q_off + (n * self.Hq + grp * G + j) * D
                    for e in cutlass.range_constexpr(E):
                        st(pB, base + lane + LANES * e, x[e].to(BFloat16))
                else:
                    if cutlass.const_expr(NG > 0):
                        if j < G + NG:  # a gate head: fp32, no norm or RoPE (isa QKV)
                            for e in cutlass.range_constexpr(E):
                                st(pF, self.spec.gate_off + gate_index(
                                    n, grp * G + j - G, lane + LANES * e, self.Hq, D), x[e])
                        else:
                            self.store_kv(x, j, G + NG, layer, n, grp, pos, s_max, pI, pK,
                                          pV, lane)
                    else:
                        self.store_kv(x, j, G, layer, n, grp, pos, s_max, pI, pK, pV, lane)

    @cute.jit
    def store_kv(self, x: cute.Tensor, j: Int32, kslot: int, layer: Int32, n: Int32,
                 grp: Int32, pos: Int32, s_max: Int32, pI: cute.Pointer, pK: cute.Pointer,
                 pV: cute.Pointer, lane: Int32):
        """bf16(x) -> the k (j == kslot) or v entry of activation row n, kv head grp in the
        layer's cache slot: row `pos` of sequence n // T (contiguous), or (paged) the page
        position of slot_mapping[n], nothing for a padding row (slot < 0; paged_index.py)."""
        D = self.D
        cslot = kv_slot(layer, self.spec.attn_layers, cutlass.min, cutlass.max)
        pg = self.spec.paged_shape
        if cutlass.const_expr(pg is not None):
            slot = ld(pI, pg.slot_off + n)
            if slot >= 0:
                blk, o = slot_block(slot, pg.block_size)
                base = page_base(Int64(cslot), Int64(blk), Int64(grp), pg.num_blocks, self.Hkv,
                                 pg.page_elems)
                for e in cutlass.range_constexpr(self.E):
                    d = lane + LANES * e
                    if j == kslot:
                        st(pK, k_elem(base, d, o, pg.block_size), x[e].to(BFloat16))
                    else:
                        st(pV, v_elem(base, o, d, D), x[e].to(BFloat16))
        else:
            b = n // self.T
            row = kv_row(Int64(cslot), b, grp, Int64(s_max), self.B, self.Hkv) + pos
            for e in cutlass.range_constexpr(self.E):
                if j == kslot:
                    st(pK, row * D + lane + LANES * e, x[e].to(BFloat16))
                else:
                    st(pV, row * D + lane + LANES * e, x[e].to(BFloat16))

    @cute.jit
    def rope_lanes(self, x: cute.Tensor, lane: Int32, pos: Int32, pF: cute.Pointer,
                   rope_off: Int32, sin_off: Int32, hd: int):
        """Partial RoPE on R = 2 hd <= 32 dims: all in register 0 of lanes < R; lane d's partner
        is lane d +- hd (spec.rope_pair), fetched with one shuffle; cos/sin column d mod hd."""
        partner, col, upper = rope_pair(lane, hd, cutlass.min, cutlass.max)
        xp = cute.arch.shuffle_sync(x[0], partner)
        if lane < 2 * hd:
            c = ld(pF, rope_off + pos * hd + col)
            s = ld(pF, sin_off + pos * hd + col)
            if upper == 0:
                x[0] = x[0] * c + (-xp) * s
            else:
                x[0] = x[0] * c + xp * s
