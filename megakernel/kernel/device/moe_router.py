"""ROUTER_SCORE and ROUTER: the MoE router's device handlers (layers/moe.py).

ROUTER_SCORE: the fp32 router logits of a block of experts for all rows (its router rows are
prefetched into L2 when the CTA reaches the record); ROUTER: sigmoid + bias, group-limited top-k,
the weights and the work list, on one CTA. The phases, the thread mapping and the order rules
are in moe_router_index.py (plain arithmetic, emulated on the host by the tests). Loads are
issued in batches into registers and consumed from there (a warp issues in order: a load used in
the iteration that issues it costs an L2 round trip each), in the unbatched order of the sums.
Shared memory: the consumers' `rstd` region (one fp32 per row: spec.smem_regions sizes it for
the build's N rows when it handles ROUTER_SCORE). All math in fp32.
"""

from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.config.fields import word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.epilogues import warp_argmax
from megakernel.kernel.device.handler import Handler, Step
from megakernel.kernel.device.memory import ld, prefetch_span, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.moe_router_index import (
    BATCH,
    LANES,
    NO_EXPERT,
    after,
    batch_col,
    better,
    expert_at,
    group_of,
    holds_group,
    kept,
    lane_experts,
    load_col,
    score_task,
    slot_of,
    work_at,
)


class MoERouter(Handler):
    """The ROUTER_SCORE and ROUTER handlers of a build (KernelSpec.moe baked in)."""

    def __init__(self, spec: KernelSpec):
        (self.E, self.K, _, self.G, self.KG, _, norm, scale_bits) = spec.constants("moe")
        if self.G > LANES:
            raise ValueError(f"the router keeps a group score per lane: n_group {self.G} > "
                             f"{LANES}")
        if lane_experts(self.E) > LANES:
            raise ValueError(f"the router keeps a lane's experts in a bit mask: E {self.E} > "
                             f"{LANES * LANES}")
        self.per_group = self.E // self.G
        self.EJ = lane_experts(self.E)  # a lane's registers of a row's choices
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
        """logits[n, E0 + e] = W_r[E0 + e] . bf16(RMSNorm(h[n])) (index module: s1, s2): each
        lane's columns in batches of BATCH loads, then summed in increasing column: the
        unbatched loop's sums, fused multiply-adds included (`load_col`)."""
        norm, inp = rec[word(Op.ROUTER_SCORE, "NORM_OFF")], rec[word(Op.ROUTER_SCORE, "IN_OFF")]
        k, ro = rec[word(Op.ROUTER_SCORE, "K")], rec[word(Op.ROUTER_SCORE, "ROUTER_OFF")]
        e0, ne = rec[word(Op.ROUTER_SCORE, "E0")], rec[word(Op.ROUTER_SCORE, "NE")]
        out = rec[word(Op.ROUTER_SCORE, "OUT_OFF")]
        hv = cute.make_rmem_tensor((BATCH,), Float32)  # h[n, c]
        wv = cute.make_rmem_tensor((BATCH,), Float32)  # the norm weight w[c]
        rv = cute.make_rmem_tensor((BATCH,), Float32)  # the router row W_r[E0 + e, c]
        cta_sync(self.named)  # rstd is free: the previous record is done with it
        for n in cutlass.range(warp, self.N, self.NW, unroll=1):
            ss = Float32(0.0)
            for c0 in cutlass.range(lane, k, LANES * BATCH, unroll=1):
                for u in cutlass.range_constexpr(BATCH):  # every load in flight
                    hv[u] = ld(pF, inp + n * k + load_col(batch_col(c0, u), k, cutlass.min))
                for u in cutlass.range_constexpr(BATCH):  # then the sum, in column order
                    if batch_col(c0, u) < k:
                        ss = ss + hv[u] * hv[u]
            ss = cute.arch.warp_reduction_sum(ss)
            if lane == 0:
                # 1 / sqrt as every other norm (and the executor's rounding), not rsqrt.approx
                sRstd[n] = Float32(1.0) / cute.math.sqrt(ss / k.to(Float32) + Float32(self.eps))
        cta_sync(self.named)
        for t in cutlass.range(warp, ne * self.N, self.NW, unroll=1):
            e, n = score_task(t, self.N)
            r = sRstd[n]
            acc = Float32(0.0)
            for c0 in cutlass.range(lane, k, LANES * BATCH, unroll=1):
                for u in cutlass.range_constexpr(BATCH):
                    c = load_col(batch_col(c0, u), k, cutlass.min)
                    hv[u] = ld(pF, inp + n * k + c)
                    wv[u] = ld(pW, Int64(norm) + Int64(c)).to(Float32)
                    rv[u] = ld(pF, ro + (e0 + e) * k + c)
                for u in cutlass.range_constexpr(BATCH):
                    if batch_col(c0, u) < k:
                        x = hv[u] * r * wv[u]
                        acc = acc + rv[u] * x.to(BFloat16).to(Float32)
            acc = cute.arch.warp_reduction_sum(acc)
            if lane == 0:
                st(pF, out + n * self.E + e0 + e, acc)

    # ---- ROUTER -----------------------------------------------------------------------------
    @cute.jit
    def route(self, rec: cute.Tensor, pF: cute.Pointer, pI: cute.Pointer, warp: Int32,
              lane: Int32):
        """Ids, weights (per row: r0-r3 on the row's choices in registers) and the work list
        (r4) of the index module."""
        sc, bias = rec[word(Op.ROUTER, "SCORES_OFF")], rec[word(Op.ROUTER, "BIAS_OFF")]
        ids, wts = rec[word(Op.ROUTER, "IDS_OFF")], rec[word(Op.ROUTER, "WTS_OFF")]
        work, slots = rec[word(Op.ROUTER, "WORK_OFF")], rec[word(Op.ROUTER, "SLOTS")]
        ninf, pg, nj = Float32(-float("inf")), self.per_group, self.EJ
        ch = cute.make_rmem_tensor((nj,), Float32)  # choice(n, expert_at(lane, j))
        sg = cute.make_rmem_tensor((nj,), Float32)  # its sigmoid(logit): the pick's weight
        w = cute.make_rmem_tensor((self.K,), Float32)
        for n in cutlass.range(warp, self.N, self.NW, unroll=1):
            for j in cutlass.range_constexpr(nj):  # r0: every load in flight
                e = expert_at(lane, j)
                sg[j], ch[j] = Float32(0.0), ninf  # padding: -inf (and never a candidate)
                if e < self.E:
                    sg[j] = ld(pF, sc + n * self.E + e)
                    ch[j] = ld(pF, bias + e)
            for j in cutlass.range_constexpr(nj):
                sg[j] = sigmoid(sg[j])
                ch[j] = sg[j] + ch[j]
            gs = ninf  # lane g: group g's score
            for g in cutlass.range_constexpr(self.G):
                v1, i1 = ninf, Int32(NO_EXPERT)
                for j in cutlass.range_constexpr(nj):
                    if cutlass.const_expr(holds_group(g, j, pg)):
                        e = expert_at(lane, j)
                        if (group_of(e, pg) == g) & better(ch[j], e, v1, i1):
                            v1, i1 = ch[j], e
                v1, i1 = warp_argmax(v1, i1)
                v2, i2 = ninf, Int32(NO_EXPERT)
                for j in cutlass.range_constexpr(nj):
                    if cutlass.const_expr(holds_group(g, j, pg)):
                        e = expert_at(lane, j)
                        if (group_of(e, pg) == g) & (e != i1) & better(ch[j], e, v2, i2):
                            v2, i2 = ch[j], e
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
            live = Int32(0)  # bit j: expert_at(lane, j) is an expert of a kept group
            for j in cutlass.range_constexpr(nj):
                e = expert_at(lane, j)  # (a padding lane's group clamped: kept() shifts by it)
                if (e < self.E) & kept(mask, group_of(cutlass.min(e, Int32(self.E - 1)), pg)):
                    live = live | (Int32(1) << j)
            total = Float32(0.0)
            pv, pe = Float32(float("inf")), Int32(-1)
            for s in cutlass.range_constexpr(self.K):
                bv, be = ninf, Int32(NO_EXPERT)
                for j in cutlass.range_constexpr(nj):
                    e = expert_at(lane, j)
                    if ((((live >> j) & 1) != 0) & after(ch[j], e, pv, pe)
                            & better(ch[j], e, bv, be)):
                        bv, be = ch[j], e
                bv, be = warp_argmax(bv, be)
                pv, pe = bv, be
                ws = Float32(0.0)  # the pick's sigmoid, from the lane that holds it
                for j in cutlass.range_constexpr(nj):
                    if expert_at(lane, j) == be:
                        ws = sg[j]
                w[s] = cute.arch.shuffle_sync(ws, be % LANES)
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
        [-1, 0, -1 ...] (one warp; lane l counts experts expert_at(l, c) in registers, the ids
        read 32 at a time and shuffled to every lane)."""
        n, pairs, nj = self.N, self.N * self.K, self.EJ
        m = cute.make_rmem_tensor((nj,), Int32)  # pairs of expert_at(lane, c) (then: written)
        at = cute.make_rmem_tensor((nj,), Int32)  # its work-list slot
        m.fill(0)
        for p0 in cutlass.range(0, pairs, LANES, unroll=1):
            x = self.pair_ids(pI, ids, p0, pairs, lane)
            for j in cutlass.range(cutlass.min(Int32(LANES), pairs - p0), unroll=1):
                xj = cute.arch.shuffle_sync(x, j)
                for c in cutlass.range_constexpr(nj):
                    if xj == expert_at(lane, c):
                        m[c] = m[c] + 1
        base = Int32(0)
        for c in cutlass.range_constexpr(nj):
            ballot = cute.arch.vote_ballot_sync(m[c] > 0)
            at[c] = slot_of(base, ballot, lane, cute.arch.popc)
            if m[c] > 0:
                st(pI, work + work_at(at[c], 0, n), expert_at(lane, c))
                st(pI, work + work_at(at[c], 1, n), m[c])
                for r in cutlass.range(m[c], n, unroll=1):
                    st(pI, work + work_at(at[c], 2 + r, n), Int32(-1))
            base = base + cute.arch.popc(ballot)
            m[c] = Int32(0)
        for p0 in cutlass.range(0, pairs, LANES, unroll=1):  # the pairs, p ascending
            x = self.pair_ids(pI, ids, p0, pairs, lane)
            for j in cutlass.range(cutlass.min(Int32(LANES), pairs - p0), unroll=1):
                xj = cute.arch.shuffle_sync(x, j)
                for c in cutlass.range_constexpr(nj):
                    if xj == expert_at(lane, c):
                        st(pI, work + work_at(at[c], 2 + m[c], n), p0 + j)
                        m[c] = m[c] + 1
        for idx in cutlass.range(lane, (slots - base) * (2 + n), LANES, unroll=1):
            row = idx // (2 + n)
            c = idx - row * (2 + n)
            v = Int32(-1)
            if c == 1:
                v = Int32(0)
            st(pI, work + work_at(base + row, c, n), v)

    @cute.jit
    def pair_ids(self, pI: cute.Pointer, ids: Int32, p0: Int32, pairs: int,
                 lane: Int32) -> Int32:
        """Lane l: the expert id of pair p0 + l (NO_EXPERT past the N top_k pairs)."""
        x = Int32(NO_EXPERT)
        if p0 + lane < pairs:
            x = ld(pI, ids + p0 + lane)
        return x


@cute.jit
def sigmoid(x: Float32) -> Float32:
    """1 / (1 + e^-x) in fp32."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))
