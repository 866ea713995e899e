"""ROUTER_SCORE and ROUTER: the MoE router's device handlers (layers/moe.py).

ROUTER_SCORE: the fp32 router logits of a block of experts for all rows (its router rows are
prefetched into L2 when the CTA reaches the record); ROUTER: sigmoid + bias, group-limited top-k,
the weights and the work list, on one CTA. The phases, the thread mapping and the order rules
are in moe_router_index.py (plain arithmetic, emulated on the host by the tests). Shared memory:
the consumers' `rstd` region (one fp32 per row). All math in fp32.
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.attention import prefetch_span
from megakernel.kernel.fields import word
from megakernel.kernel.handler import Handler, Step
from megakernel.kernel.matvec import warp_argmax
from megakernel.kernel.memory import ld, st
from megakernel.kernel.moe_router_index import (
    LANES,
    NO_EXPERT,
    after,
    better,
    group_of,
    kept,
    score_task,
    slot_of,
    work_at,
)
from megakernel.kernel.spec import KernelSpec
from megakernel.kernel.sync import cta_sync


class MoERouter(Handler):
    """The ROUTER_SCORE and ROUTER handlers of a build (KernelSpec.moe baked in)."""

    def __init__(self, spec: KernelSpec):
        (self.E, self.K, _, self.G, self.KG, _, norm, scale_bits) = spec.moe
        if self.G > LANES:
            raise ValueError(f"the router keeps a group score per lane: n_group {self.G} > "
                             f"{LANES}")
        self.per_group = self.E // self.G
        self.norm = bool(norm)
        self.scale = struct.unpack("<f", struct.pack("<i", scale_bits))[0]
        self.N, self.NT, self.NW = spec.rows, spec.num_threads, spec.num_warps
        self.eps = spec.eps
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier

    @cute.jit
    def prefetch(self, op: Int32, s: Step):
        if op == Op.ROUTER_SCORE:
            self.prefetch_rows(s.rec, s.f32, s.tidx)

    @cute.jit
    def run(self, op: Int32, s: Step):
        if op == Op.ROUTER_SCORE:
            self.score(s.rec, s.weights, s.f32, s.sRstd, s.warp, s.lane)
        else:
            self.route(s.rec, s.f32, s.i32, s.warp, s.lane)

    # ---- ROUTER_SCORE -----------------------------------------------------------------------
    @cute.jit
    def prefetch_rows(self, rec: cute.Tensor, pF: cute.Pointer, tidx: Int32):
        """L2 prefetch of the block's NE fp32 router rows (they predate the step)."""
        k, ro = rec[word(Op.ROUTER_SCORE, "K")], rec[word(Op.ROUTER_SCORE, "ROUTER_OFF")]
        e0, ne = rec[word(Op.ROUTER_SCORE, "E0")], rec[word(Op.ROUTER_SCORE, "NE")]
        if tidx == 0:
            addr = pF.toint() + (Int64(ro) + Int64(e0) * Int64(k)) * Int64(4)
            if addr % Int64(16) == Int64(0):
                prefetch_span(addr, ne * k * 4)

    @cute.jit
    def score(self, rec: cute.Tensor, pW: cute.Pointer, pF: cute.Pointer, sRstd: cute.Tensor,
              warp: Int32, lane: Int32):
        """logits[n, E0 + e] = W_r[E0 + e] . bf16(RMSNorm(h[n])) (index module: s1, s2)."""
        norm, inp = rec[word(Op.ROUTER_SCORE, "NORM_OFF")], rec[word(Op.ROUTER_SCORE, "IN_OFF")]
        k, ro = rec[word(Op.ROUTER_SCORE, "K")], rec[word(Op.ROUTER_SCORE, "ROUTER_OFF")]
        e0, ne = rec[word(Op.ROUTER_SCORE, "E0")], rec[word(Op.ROUTER_SCORE, "NE")]
        out = rec[word(Op.ROUTER_SCORE, "OUT_OFF")]
        cta_sync(self.named)  # rstd is free: the previous record is done with it
        for n in cutlass.range(warp, self.N, self.NW, unroll=1):
            ss = Float32(0.0)
            for c in cutlass.range(lane, k, LANES, unroll=1):
                v = ld(pF, inp + n * k + c)
                ss = ss + v * v
            ss = cute.arch.warp_reduction_sum(ss)
            if lane == 0:
                sRstd[n] = cute.math.rsqrt(ss / k.to(Float32) + Float32(self.eps))
        cta_sync(self.named)
        for t in cutlass.range(warp, ne * self.N, self.NW, unroll=1):
            e, n = score_task(t, self.N)
            r = sRstd[n]
            acc = Float32(0.0)
            for c in cutlass.range(lane, k, LANES, unroll=1):
                x = ld(pF, inp + n * k + c) * r * ld(pW, Int64(norm) + Int64(c)).to(Float32)
                acc = acc + ld(pF, ro + (e0 + e) * k + c) * x.to(BFloat16).to(Float32)
            acc = cute.arch.warp_reduction_sum(acc)
            if lane == 0:
                st(pF, out + n * self.E + e0 + e, acc)

    # ---- ROUTER -----------------------------------------------------------------------------
    @cute.jit
    def choice(self, pF: cute.Pointer, sc: Int32, bias: Int32, n: Int32, e: Int32) -> Float32:
        return sigmoid(ld(pF, sc + n * self.E + e)) + ld(pF, bias + e)

    @cute.jit
    def route(self, rec: cute.Tensor, pF: cute.Pointer, pI: cute.Pointer, warp: Int32,
              lane: Int32):
        """Ids, weights (per row: r1-r3) and the work list (r4) of the index module."""
        sc, bias = rec[word(Op.ROUTER, "SCORES_OFF")], rec[word(Op.ROUTER, "BIAS_OFF")]
        ids, wts = rec[word(Op.ROUTER, "IDS_OFF")], rec[word(Op.ROUTER, "WTS_OFF")]
        work, slots = rec[word(Op.ROUTER, "WORK_OFF")], rec[word(Op.ROUTER, "SLOTS")]
        ninf, pg = Float32(-float("inf")), self.per_group
        for n in cutlass.range(warp, self.N, self.NW, unroll=1):
            gs = ninf  # lane g: group g's score
            for g in cutlass.range_constexpr(self.G):
                v1, i1 = ninf, Int32(NO_EXPERT)
                for j in cutlass.range(lane, pg, LANES, unroll=1):
                    e = g * pg + j
                    c = self.choice(pF, sc, bias, n, e)
                    if better(c, e, v1, i1):
                        v1, i1 = c, e
                v1, i1 = warp_argmax(v1, i1)
                v2, i2 = ninf, Int32(NO_EXPERT)
                for j in cutlass.range(lane, pg, LANES, unroll=1):
                    e = g * pg + j
                    c = self.choice(pF, sc, bias, n, e)
                    if (e != i1) & better(c, e, v2, i2):
                        v2, i2 = c, e
                v2, i2 = warp_argmax(v2, i2)
                if lane == g:
                    gs = v1 + v2
            mask = Int32(0)
            for _ in cutlass.range_constexpr(self.KG):
                v = gs
                if kept(mask, lane):
                    v = ninf
                _, bg = warp_argmax(v, lane)
                mask = mask | (Int32(1) << bg)
            w = cute.make_rmem_tensor((self.K,), Float32)
            total = Float32(0.0)
            pv, pe = Float32(float("inf")), Int32(-1)
            for s in cutlass.range_constexpr(self.K):
                bv, be = ninf, Int32(NO_EXPERT)
                for e in cutlass.range(lane, self.E, LANES, unroll=1):
                    if kept(mask, group_of(e, pg)):
                        c = self.choice(pF, sc, bias, n, e)
                        if after(c, e, pv, pe) & better(c, e, bv, be):
                            bv, be = c, e
                bv, be = warp_argmax(bv, be)
                pv, pe = bv, be
                w[s] = sigmoid(ld(pF, sc + n * self.E + be))
                total = total + w[s]
                if lane == 0:
                    st(pI, ids + n * self.K + s, be)
            for s in cutlass.range_constexpr(self.K):
                ws = w[s]
                if cutlass.const_expr(self.norm):
                    ws = ws / (total + Float32(1e-20))
                if lane == 0:
                    st(pF, wts + n * self.K + s, ws * Float32(self.scale))
        cta_sync(self.named)  # every row's ids are stored
        if warp == 0:
            self.work_list(pI, ids, work, slots, lane)

    @cute.jit
    def work_list(self, pI: cute.Pointer, ids: Int32, work: Int32, slots: Int32, lane: Int32):
        """r4: rows [x, m, pairs ascending, -1 ...] of the routed experts in increasing id, then
        [-1, 0, -1 ...] (one warp)."""
        n, pairs = self.N, self.N * self.K
        base = Int32(0)
        for c0 in cutlass.range(0, self.E, LANES, unroll=1):
            x = c0 + lane
            m = Int32(0)
            if x < self.E:
                for p in cutlass.range(pairs, unroll=1):
                    if ld(pI, ids + p) == x:
                        m = m + 1
            ballot = cute.arch.vote_ballot_sync(m > 0)
            if m > 0:
                w = slot_of(base, ballot, lane, cute.arch.popc)
                st(pI, work + work_at(w, 0, n), x)
                st(pI, work + work_at(w, 1, n), m)
                q = Int32(0)
                for p in cutlass.range(pairs, unroll=1):
                    if ld(pI, ids + p) == x:
                        st(pI, work + work_at(w, 2 + q, n), p)
                        q = q + 1
                for r in cutlass.range(m, n, unroll=1):
                    st(pI, work + work_at(w, 2 + r, n), Int32(-1))
            base = base + cute.arch.popc(ballot)
        for idx in cutlass.range(lane, (slots - base) * (2 + n), LANES, unroll=1):
            row = idx // (2 + n)
            c = idx - row * (2 + n)
            v = Int32(-1)
            if c == 1:
                v = Int32(0)
            st(pI, work + work_at(base + row, c, n), v)


@cute.jit
def sigmoid(x: Float32) -> Float32:
    """1 / (1 + e^-x) in fp32."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))
