"""Split-KV decode attention: partials of one (sequence, kv head, split) and their merge.

ATTN_PARTIAL serves the T * G queries that read kv head g of sequence b. Query qi = t * G + j
(token t, q head g * G + j) sees keys [lo, min(hi, lengths[b] + t + 1)) of the split's range
[s * ctx / S, (s + 1) * ctx / S), ctx = lengths[b] + T. With fewer queries than warps, WQ warps
share a query's keys and their (m, l, o) are merged in shared memory in a fixed order.

A warp takes the queries it owns (T * G / NW of them with a speculative step's T = 1 + k) QB
at a time (dense_index.attn_query_batch): one walk of the split's keys serves the pass's QB
queries, each chunk of keys and values loaded once for all of them, each query with its own
(m, l, o) and its own causal limit inside a chunk (attn_chunk_keys); QB = all the warp owns up
to a register cap. Their q rows [NW][QB][D] sit at the start of the consumers' shared-memory
span (free during the record) when QB > 1, in sQ otherwise.

Inside a warp, keys go 32 at a time: lane = key for the scores (q from shared memory, 16-byte
loads of the key row, each 8 dims dotted with every query of the pass), a warp max/sum per query
for the online softmax, then lane = E head dims for the weighted sum of the value rows (each
query's probability of key j broadcast with a shuffle), their loads issued a batch at a time
(dense_index.attn_value_batch) so that a chunk costs one or two memory round trips, not one per
key. Where the queries fit one tensor-core tile (dense_index.attn_tensor_cores) the partial runs
on tensor cores instead (attention_mma.py). D = 64, 128 or 256: E = D / 32 = 2, 4 or 8 contiguous
dims per lane; sO holds one D-row
per warp. The cached keys/values reach L2 through a prefetch that
runs a bounded lead ahead of each warp (dense_index.attn_kv_lead), not the whole split at once:
at 32K keys a layer's splits would be ~64 MiB, more than L2, and evict the weights' lookahead.

A paged build (KernelSpec.paged) reads the keys and values through the block table, page by page
(kernel/host/paged_index.py); a padding row (slot_mapping < 0) sees no keys and its output is 0.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel import isa
from megakernel.isa import Op
from megakernel.kernel.config.fields import common, word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.attention_mma import TensorCorePartial
from megakernel.kernel.device.handler import Handler, Step
from megakernel.kernel.device.memory import (
    ld,
    load_bf16_into,
    load_bf16x8,
    load_f32_into,
    prefetch_l2_at,
    prefetch_span,
    st,
    store_f32_vec,
)
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.dense_index import (
    attn_chunk_keys,
    attn_group_queries,
    attn_keys,
    attn_kv_lead,
    attn_merge_batch,
    attn_merge_split,
    attn_q_rows,
    attn_query,
    attn_query_batch,
    attn_scale,
    attn_value_batch,
    attn_warp,
    gate_index,
    kv_row,
    kv_slot,
)
from megakernel.kernel.host.limits import LANES, VEC
from megakernel.kernel.host.paged_index import k_elem, page_base, slot_block, table_entry, v_elem

NEG_INF = -math.inf


class Attention(Handler):
    """ATTN_PARTIAL: one (sequence, kv head, split) of split-KV attention; the CTA that
    completes a (sequence, kv head)'s splits merges them (a ticket)."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier (pipeline.py)
        self.D, self.G, self.T, self.B = spec.head_dim, spec.group, spec.tokens, spec.batch
        self.N, self.Hq, self.Hkv = spec.rows, spec.heads, spec.kv_heads
        self.NT, self.NW = spec.num_threads, spec.num_warps
        self.QG = spec.attn_queries
        self.WQ = max(1, self.NW // self.QG)  # warps per query
        self.E = self.D // LANES  # head dims per lane (contiguous)
        self.scale = attn_scale(self.D)
        self.pg = spec.paged_shape  # None: the contiguous cache
        # fewer value rows in flight where registers are scarce (attn_value_batch)
        self.VB = attn_value_batch(self.D, tight=self.pg is not None or not spec.pipelined)
        # a warp's queries QB at a time, each chunk of keys loaded once for all QB; their q rows
        # [NW][QB][D] fp32 from the start of the consumers' span (free during the record, as for
        # the recurrent handlers) when QB > 1, else sQ
        self.q_base = spec.smem_regions()["q"][0] // 4
        self.QB = attn_query_batch(self.D, self.G, self.T, self.NW,
                                   smem_queries=self.query_rows(spec))
        assert self.WQ == 1 or self.QB == 1  # WQ > 1: a warp owns one query
        # the queries of a (sequence, kv head) on tensor cores where it applies (attention_mma)
        self.MA = spec.attn_tensor_cores
        self.tc = TensorCorePartial(spec, self.named) if self.MA else None
        self.shares = self.NW if self.MA else self.WQ  # warp shares of a split's keys

    @staticmethod
    def query_rows(spec: KernelSpec) -> int:
        """q rows [D] fp32 per warp that fit the consumers' span below the flag word."""
        return attn_q_rows(spec.smem_regions()["flag"][0], spec.head_dim, spec.num_warps)

    @cute.jit
    def prefetch(self, op: Int32, s: Step):
        self.prefetch_kv(s.rec, s.layer, s.i32, s.k_cache, s.v_cache, s.s_max, s.tidx)

    @cute.jit
    def run(self, op: Int32, s: Step):
        self.partial(s.rec, s.layer, s.f32, s.bf16, s.i32, s.k_cache, s.v_cache, s.s_max, s.sQ,
                     s.sO, s.sML, s.warp, s.lane)
        self.ticket(s.rec, s.epoch, s.counters, s.sFlag, s.f32, s.bf16, s.tidx, s.warp, s.lane)

    # ---- ATTN_PARTIAL -------------------------------------------------------------------------
    @cute.jit
    def partial(self, rec: cute.Tensor, layer: Int32, pF: cute.Pointer, pB: cute.Pointer,
                pI: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, s_max: Int32,
                sQ: cute.Tensor, sO: cute.Tensor, sML: cute.Tensor, warp: Int32, lane: Int32):
        b, g = rec[word(Op.ATTN_PARTIAL, "B_IDX")], rec[word(Op.ATTN_PARTIAL, "KV_HEAD")]
        s, n_splits = rec[word(Op.ATTN_PARTIAL, "SPLIT")], rec[word(Op.ATTN_PARTIAL, "N_SPLITS")]
        q_off, po_off = rec[word(Op.ATTN_PARTIAL, "Q_OFF")], rec[word(Op.ATTN_PARTIAL, "PO_OFF")]
        pml_off = rec[word(Op.ATTN_PARTIAL, "PML_OFF")]
        len_off = rec[word(Op.ATTN_PARTIAL, "LEN_OFF")]
        length = ld(pI, len_off + b)
        cslot = kv_slot(layer, self.spec.attn_layers, cutlass.min, cutlass.max)  # cache slot
        kv_row0 = kv_row(Int64(cslot), b, g, Int64(s_max), self.B, self.Hkv)
        live = Int32(1)  # 0: a padding row of a paged step (no keys)
        if cutlass.const_expr(self.pg is not None):
            if ld(pI, self.pg.slot_off + b * self.T) < 0:
                live = Int32(0)
        WQ = self.WQ
        if cutlass.const_expr(self.MA):  # every warp all the queries, a share of the keys
            self.tc.partial(b, g, s, n_splits, length, kv_row0, q_off, po_off, pml_off, pF, pB,
                            pK, pV, sQ, warp, lane)
        elif cutlass.const_expr(self.QB == 1):  # a query at a time (the plain step's path)
            q0, part = attn_warp(warp, WQ)
            for qi in cutlass.range(q0, self.QG, self.NW // WQ):
                t, head, n = attn_query(qi, g, b, self.G, self.T)
                # this query's keys in the split, then this warp's share of them
                kb, ke = attn_keys(s, n_splits, length, t, part, WQ, self.T, cutlass.min,
                                   cutlass.max)
                if cutlass.const_expr(self.pg is not None):
                    ke = kb + (ke - kb) * live
                # q -> shared (fp32), one warp-private row
                for d in cutlass.range(lane, self.D, LANES):
                    sQ[warp * self.D + d] = ld(
                        pB, q_off + (n * self.Hq + head) * self.D + d).to(Float32)
                cute.arch.sync_warp()
                m, lsum, o = self.attend_one(kv_row0, b, cslot, g, kb, ke, pI, pK, pV, sQ,
                                             warp, lane)
                if cutlass.const_expr(WQ == 1):
                    self.store_partial(m, lsum, o, s, n, head, po_off, pml_off, pF, lane)
                else:
                    for e in cutlass.range_constexpr(self.E):
                        sO[warp * self.D + lane * self.E + e] = o[e]
                    if lane == 0:
                        sML[2 * warp] = m
                        sML[2 * warp + 1] = lsum
                cute.arch.sync_warp()
        else:  # passes of QB queries (WQ = 1), one walk of the split's keys each
            QB, D = self.QB, self.D
            # [NW][QB][D] fp32 q rows from the start of the consumers' span
            sq = cute.make_tensor(sQ.iterator + (-self.q_base),
                                  cute.make_layout(self.NW * QB * D))
            step = self.NW
            for g0 in cutlass.range(warp, self.QG, step * QB, unroll=1):
                keq = cute.make_rmem_tensor((QB,), Int32)  # each query's end of keys
                kb = Int32(0)
                for j in cutlass.range_constexpr(QB):
                    qi, ql = attn_group_queries(g0, j, step, self.QG, cutlass.min, cutlass.max)
                    t, head, n = attn_query(qi, g, b, self.G, self.T)
                    # the split's keys below this query's causal limit: [kb, keq[j]), the
                    # same kb for every query of the pass (WQ = 1: one share)
                    kb, ke = attn_keys(s, n_splits, length, t, 0, 1, self.T, cutlass.min,
                                       cutlass.max)
                    keq[j] = kb + (ke - kb) * (ql * live)
                    for d in cutlass.range(lane, D, LANES):  # q -> shared (fp32), row j
                        sq[(warp * QB + j) * D + d] = ld(
                            pB, q_off + (n * self.Hq + head) * D + d).to(Float32)
                cute.arch.sync_warp()
                m, lsum, o = self.attend(kv_row0, b, cslot, g, kb, keq, pI, pK, pV, sq, warp,
                                         lane)
                for j in cutlass.range_constexpr(QB):
                    qi, ql = attn_group_queries(g0, j, step, self.QG, cutlass.min, cutlass.max)
                    _, head, n = attn_query(qi, g, b, self.G, self.T)
                    if ql > 0:
                        self.store_partial(m[j], lsum[j], o[None, j], s, n, head, po_off,
                                           pml_off, pF, lane)
                cute.arch.sync_warp()  # the pass's q rows read before the next pass's
        if cutlass.const_expr(WQ > 1 and not self.MA):
            cta_sync(self.named)
            for qi in cutlass.range(warp, self.QG, self.NW):
                _, head, n = attn_query(qi, g, b, self.G, self.T)
                mm = Float32(NEG_INF)
                for p in cutlass.range_constexpr(WQ):
                    mm = cute.arch.fmax(mm, sML[2 * (qi * WQ + p)])
                lsum = Float32(0.0)
                o = cute.make_rmem_tensor((self.E,), Float32)
                o.fill(0.0)
                if mm > Float32(NEG_INF):
                    for p in cutlass.range_constexpr(WQ):
                        w = cute.math.exp(sML[2 * (qi * WQ + p)] - mm)
                        lsum = lsum + sML[2 * (qi * WQ + p) + 1] * w
                        for e in cutlass.range_constexpr(self.E):
                            o[e] = o[e] + sO[(qi * WQ + p) * self.D + lane * self.E + e] * w
                self.store_partial(mm, lsum, o, s, n, head, po_off, pml_off, pF, lane)

    @cute.jit
    def chunk_start(self, kv_row0: Int64, b: Int32, k0: Int32, ke: Int32, pI: cute.Pointer,
                    pK: cute.Pointer, pV: cute.Pointer, lane: Int32):
        """A chunk of 32 keys from k0 (of keys < ke) begins: (paged) this lane's key slot
        (block * block_size + offset), block and offset, from b's block table; (contiguous) lane
        0 requests the chunk attn_kv_lead keys on into L2 and (0, 0, 0) is returned."""
        D, pg = self.D, self.pg
        key = k0 + lane
        kslot, blk, ko = Int32(0), Int32(0), Int32(0)
        if cutlass.const_expr(pg is not None):
            if key < ke:
                col, ko = table_entry(b, key, pg.block_size, pg.max_blocks)
                blk = ld(pI, pg.table_off + col)
                kslot = blk * pg.block_size + ko
        else:
            if lane == 0:  # the sliding L2 prefetch, `lead` keys ahead of this chunk
                ahead = k0 + attn_kv_lead(D)
                if ahead < ke:
                    n = cutlass.min(ke - ahead, Int32(LANES)) * (D * 2)
                    off = (kv_row0 + ahead) * Int64(D * 2)
                    prefetch_l2_at(pK.toint() + off, n)
                    prefetch_l2_at(pV.toint() + off, n)
        return kslot, blk, ko

    @cute.jit
    def attend_one(self, kv_row0: Int64, b: Int32, cslot: Int32, g: Int32, kb: Int32, ke: Int32,
               pI: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, sQ: cute.Tensor,
               warp: Int32, lane: Int32):
        """Online softmax over keys [kb, ke) of one query (QB = 1): (m, l, o[E] of this lane).
        Keys of (sequence b, kv head g) at rows kv_row0 + key of the contiguous cache, or (paged) in
        the pages of b's block table in cache slot `cslot`.

        Per chunk of 32 keys the value rows are loaded VB at a time (attn_value_batch), all VB
        loads issued before the first is used, the first batch with the keys' loads; they are
        summed key by key in order, so o is bit-identical to one load per key. The contiguous
        build's lane 0 requests the chunk attn_kv_lead keys on into L2 (prefetch_kv requested
        the first ones before the wait)."""
        D, E, pg = self.D, self.E, self.pg
        VB = self.VB
        m = Float32(NEG_INF)
        lsum = Float32(0.0)
        o = cute.make_rmem_tensor((E,), Float32)
        o.fill(0.0)
        vb = cute.make_rmem_tensor((E, VB), BFloat16)  # a batch of value rows, this lane's dims
        for k0 in cutlass.range(kb, ke, LANES):
            key = k0 + lane
            nvalid = cutlass.min(ke - k0, Int32(LANES))
            score = Float32(NEG_INF)
            kslot, blk, ko = self.chunk_start(kv_row0, b, k0, ke, pI, pK, pV, lane)
            self.load_values(vb, kv_row0, cslot, g, k0, Int32(0), nvalid, kslot, pV, lane)
            if key < ke:
                dot = Float32(0.0)
                if cutlass.const_expr(pg is not None):
                    kbase = page_base(Int64(cslot), Int64(blk), Int64(g), pg.num_blocks,
                                      self.Hkv, pg.page_elems)
                    for c in cutlass.range_constexpr(D // VEC):  # the contiguous path's order
                        kv8 = self.load_key8(pK, kbase, c * VEC, ko)
                        q8 = load_smem_bf16x8_f32(sQ, warp * D + c * VEC)
                        dot = (kv8 * q8).reduce(cute.ReductionOp.ADD, dot, 0)
                else:
                    krow = (kv_row0 + key) * D
                    for c in cutlass.range_constexpr(D // VEC):
                        kv8 = load_bf16x8(pK, krow + c * VEC)
                        q8 = load_smem_bf16x8_f32(sQ, warp * D + c * VEC)
                        dot = (kv8 * q8).reduce(cute.ReductionOp.ADD, dot, 0)
                score = dot * Float32(self.scale)
            m_blk = cute.arch.warp_reduction_max(score)
            m_new = cute.arch.fmax(m, m_blk)
            alpha = cute.math.exp(m - m_new)
            p = cute.math.exp(score - m_new)
            lsum = lsum * alpha + cute.arch.warp_reduction_sum(p)
            for e in cutlass.range_constexpr(E):
                o[e] = o[e] * alpha
            self.add_values_one(o, vb, p, Int32(0), nvalid)
            if cutlass.const_expr(VB < LANES):
                for j0 in cutlass.range(VB, nvalid, VB, unroll=1):
                    self.load_values(vb, kv_row0, cslot, g, k0, j0, nvalid, kslot, pV, lane)
                    self.add_values_one(o, vb, p, j0, nvalid)
            m = m_new
        return m, lsum, o

    @cute.jit
    def attend(self, kv_row0: Int64, b: Int32, cslot: Int32, g: Int32, kb: Int32,
               keq: cute.Tensor, pI: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer,
               sq: cute.Tensor, warp: Int32, lane: Int32):
        """Online softmax of a pass's QB queries (q rows warp * QB + j of sq): query j over keys
        [kb, keq[j]). Returns (m [QB], l [QB], o [E, QB] of this lane). Keys of (sequence b, kv
        head g) at rows kv_row0 + key of the contiguous cache, or (paged) in the pages of b's
        block table in cache slot `cslot`.

        The chunks of 32 keys run from kb to the pass's largest keq, each loaded once for all
        QB queries: a lane's key row is read 8 dims at a time and dotted with each query's q
        (per query the same order as alone); a query sees the chunk's first attn_chunk_keys
        keys (its causal limit within the chunk) and sits out a chunk past its keys. Per chunk
        the value rows are loaded VB at a time (attn_value_batch), all VB loads issued before
        the first is used, the first batch with the keys' loads; they are summed key by key in
        order, so each query's (m, l, o) is bit-identical to attending it alone with one load
        per key. The contiguous build's lane 0 requests the chunk attn_kv_lead keys on into L2
        (prefetch_kv requested the first ones before the wait)."""
        D, E, pg, QB = self.D, self.E, self.pg, self.QB
        VB = self.VB
        m = cute.make_rmem_tensor((QB,), Float32)
        m.fill(NEG_INF)
        lsum = cute.make_rmem_tensor((QB,), Float32)
        lsum.fill(0.0)
        o = cute.make_rmem_tensor((E, QB), Float32)
        o.fill(0.0)
        score = cute.make_rmem_tensor((QB,), Float32)
        p = cute.make_rmem_tensor((QB,), Float32)  # this lane's key's probability, per query
        nq = cute.make_rmem_tensor((QB,), Int32)  # keys of the chunk each query sees
        dot = cute.make_rmem_tensor((QB,), Float32)
        ke = keq[0]
        for j in cutlass.range_constexpr(1, QB):
            ke = cutlass.max(ke, keq[j])
        vb = cute.make_rmem_tensor((E, VB), BFloat16)  # a batch of value rows, this lane's dims
        for k0 in cutlass.range(kb, ke, LANES):
            key = k0 + lane
            nvalid = cutlass.min(ke - k0, Int32(LANES))
            kslot, blk, ko = self.chunk_start(kv_row0, b, k0, ke, pI, pK, pV, lane)
            self.load_values(vb, kv_row0, cslot, g, k0, Int32(0), nvalid, kslot, pV, lane)
            for j in cutlass.range_constexpr(QB):
                nq[j] = attn_chunk_keys(k0, keq[j], cutlass.min, cutlass.max)
                score[j] = Float32(NEG_INF)
                p[j] = Float32(0.0)
            if key < ke:
                dot.fill(0.0)
                if cutlass.const_expr(pg is not None):
                    kbase = page_base(Int64(cslot), Int64(blk), Int64(g), pg.num_blocks,
                                      self.Hkv, pg.page_elems)
                    for c in cutlass.range_constexpr(D // VEC):  # the contiguous path's order
                        kv8 = self.load_key8(pK, kbase, c * VEC, ko)
                        for j in cutlass.range_constexpr(QB):
                            q8 = load_smem_bf16x8_f32(sq, (warp * QB + j) * D + c * VEC)
                            dot[j] = (kv8 * q8).reduce(cute.ReductionOp.ADD, dot[j], 0)
                else:
                    krow = (kv_row0 + key) * D
                    for c in cutlass.range_constexpr(D // VEC):
                        kv8 = load_bf16x8(pK, krow + c * VEC)
                        for j in cutlass.range_constexpr(QB):
                            q8 = load_smem_bf16x8_f32(sq, (warp * QB + j) * D + c * VEC)
                            dot[j] = (kv8 * q8).reduce(cute.ReductionOp.ADD, dot[j], 0)
                for j in cutlass.range_constexpr(QB):
                    if lane < nq[j]:  # within query j's causal limit
                        score[j] = dot[j] * Float32(self.scale)
            for j in cutlass.range_constexpr(QB):
                if nq[j] > 0:  # warp-uniform: query j has keys in this chunk
                    m_blk = cute.arch.warp_reduction_max(score[j])
                    m_new = cute.arch.fmax(m[j], m_blk)
                    alpha = cute.math.exp(m[j] - m_new)
                    pj = cute.math.exp(score[j] - m_new)
                    lsum[j] = lsum[j] * alpha + cute.arch.warp_reduction_sum(pj)
                    for e in cutlass.range_constexpr(E):
                        o[e, j] = o[e, j] * alpha
                    m[j] = m_new
                    p[j] = pj
            self.add_values(o, vb, p, nq, Int32(0))
            if cutlass.const_expr(VB < LANES):
                for j0 in cutlass.range(VB, nvalid, VB, unroll=1):
                    self.load_values(vb, kv_row0, cslot, g, k0, j0, nvalid, kslot, pV, lane)
                    self.add_values(o, vb, p, nq, j0)
        return m, lsum, o

    @cute.jit
    def load_values(self, vb: cute.Tensor, kv_row0: Int64, cslot: Int32, g: Int32, k0: Int32,
                    j0: Int32, nvalid: Int32, kslot: Int32, pV: cute.Pointer, lane: Int32):
        """This lane's E dims of the value rows of keys k0 + j0 .. k0 + j0 + VB - 1 into vb
        [E, VB], every load issued before any is used; a key past the chunk's nvalid loads
        the last valid row instead (in range; add_values skips it)."""
        D, E, pg = self.D, self.E, self.pg
        for j in cutlass.range_constexpr(self.VB):
            jj = cutlass.min(j0 + j, nvalid - 1)
            vrow = (kv_row0 + k0 + jj) * D
            if cutlass.const_expr(pg is not None):  # key k0 + jj's slot, from its lane
                vblk, vo = slot_block(cute.arch.shuffle_sync(kslot, jj), pg.block_size)
                vrow = v_elem(page_base(Int64(cslot), Int64(vblk), Int64(g), pg.num_blocks,
                                        self.Hkv, pg.page_elems), vo, 0, D)
            load_bf16_into(vb[None, j], pV, vrow + lane * E, E)

    @cute.jit
    def add_values(self, o: cute.Tensor, vb: cute.Tensor, p: cute.Tensor, nq: cute.Tensor,
                   j0: Int32):
        """o[:, q] += p_j v_j for keys j0 .. j0 + VB - 1 of the chunk that query q sees (below
        nq[q]), in key order (the probability of key j broadcast from its lane)."""
        for j in cutlass.range_constexpr(self.VB):
            for q in cutlass.range_constexpr(self.QB):
                pj = cute.arch.shuffle_sync(p[q], j0 + j)
                if nq[q] > j0 + j:
                    for e in cutlass.range_constexpr(self.E):
                        o[e, q] = o[e, q] + pj * vb[e, j].to(Float32)

    @cute.jit
    def add_values_one(self, o: cute.Tensor, vb: cute.Tensor, p: Float32, j0: Int32,
                   nvalid: Int32):
        """o += p_j v_j for keys j0 .. j0 + VB - 1 of the chunk below nvalid, in key order (the
        probability of key j broadcast from its lane)."""
        for j in cutlass.range_constexpr(self.VB):
            pj = cute.arch.shuffle_sync(p, j0 + j)
            if nvalid > j0 + j:
                for e in cutlass.range_constexpr(self.E):
                    o[e] = o[e] + pj * vb[e, j].to(Float32)

    @cute.jit
    def load_key8(self, pK: cute.Pointer, base: Int64, d0: int, o: Int32) -> cute.TensorSSA:
        """fp32 [8] of head dims d0 .. d0 + 7 of the key at offset o of a K page [D, block_size]
        (one scalar per dim: across the warp's lanes, consecutive keys of a page row)."""
        r = cute.make_rmem_tensor((VEC,), Float32)
        for v in cutlass.range_constexpr(VEC):
            r[v] = ld(pK, k_elem(base, d0 + v, o, self.pg.block_size)).to(Float32)
        return r.load()

    @cute.jit
    def store_partial(self, m: Float32, lsum: Float32, o: cute.Tensor, s: Int32, n: Int32,
                      head: Int32, po_off: Int32, pml_off: Int32, pF: cute.Pointer, lane: Int32):
        slot = (s * self.N + n) * self.Hq + head
        store_f32_vec(pF, po_off + slot * self.D + lane * self.E, o.load(), self.E)
        if lane == 0:
            st(pF, pml_off + slot * 2, m)
            st(pF, pml_off + slot * 2 + 1, lsum)

    # ---- split-KV merge (the last ATTN_PARTIAL of a (sequence, kv head)) ---------------------
    @cute.jit
    def ticket(self, rec: cute.Tensor, epoch: Int32, counters: cute.Pointer, sFlag: cute.Tensor,
               pF: cute.Pointer, pB: cute.Pointer, tidx: Int32, warp: Int32, lane: Int32):
        """Count this split in; the CTA that completes the S splits merges them and signals."""
        b, g = rec[word(Op.ATTN_PARTIAL, "B_IDX")], rec[word(Op.ATTN_PARTIAL, "KV_HEAD")]
        n_splits = rec[word(Op.ATTN_PARTIAL, "N_SPLITS")]
        po_off = rec[word(Op.ATTN_PARTIAL, "PO_OFF")]
        pml_off = rec[word(Op.ATTN_PARTIAL, "PML_OFF")]
        out_off = rec[word(Op.ATTN_PARTIAL, "OUT_OFF")]
        done_cid = rec[word(Op.ATTN_PARTIAL, "DONE_CID")]
        cta_sync(self.named)  # every thread's partial stores happen-before the ticket
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            ticket = rec[common("SIGNAL_CID")]  # the (b, g) ticket counter
            old = cute.arch.atomic_add(counters + (ticket + isa.COUNTER_BASE), Int32(1),
                                       sem="acq_rel", scope="gpu")
            sFlag[0] = Int32(0)
            if old - (epoch * n_splits + n_splits - 1) == 0:
                sFlag[0] = Int32(1)
        cta_sync(self.named)  # publishes the acquire (and the flag) to the CTA
        if sFlag[0] != 0:
            self.merge(b, g, n_splits, po_off, pml_off, out_off, pF, pB, warp, lane)
            cta_sync(self.named)
            if tidx == 0:
                cute.arch.fence_acq_rel_gpu()
                cute.arch.red(counters + (done_cid + isa.COUNTER_BASE), Int32(1), op="add",
                              dtype="s32", sem="release", scope="gpu")

    @cute.jit
    def merge(self, b: Int32, g: Int32, n_splits: Int32, po_off: Int32, pml_off: Int32,
              out_off: Int32, pF: cute.Pointer, pB: cute.Pointer, warp: Int32, lane: Int32):
        """out[n, head] = bf16(sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M)), splits in order;
        (output gate) times sigmoid(gate[n, head]) in fp32 before the rounding.

        The partials are read a batch of splits at a time (attn_merge_batch), every load of a
        batch issued before the first is used: the m of MB splits for M, then the m, l and o of
        SB splits for the sums. The max and the sums still go split by split in order, so the
        result is bit-identical to one load at a time. A split past n_splits loads the last
        one's (attn_merge_split) and is skipped in the sums."""
        E, (MB, SB) = self.E, attn_merge_batch(self.D)
        mv = cute.make_rmem_tensor((max(MB, SB),), Float32)
        lv = cute.make_rmem_tensor((SB,), Float32)
        ov = cute.make_rmem_tensor((E, SB), Float32)
        for qi in cutlass.range(warp, self.QG, self.NW):
            _, head, n = attn_query(qi, g, b, self.G, self.T)
            ml0 = pml_off + (n * self.Hq + head) * 2  # split s's (m, l) at ml0 + s * stride
            o0 = po_off + (n * self.Hq + head) * self.D + lane * E
            stride = self.N * self.Hq
            mm = Float32(NEG_INF)
            for s0 in cutlass.range(0, n_splits, MB, unroll=1):
                for j in cutlass.range_constexpr(MB):
                    sl = attn_merge_split(s0, j, n_splits, cutlass.min) * stride
                    mv[j] = ld(pF, ml0 + sl * 2)
                for j in cutlass.range_constexpr(MB):
                    mm = cute.arch.fmax(mm, mv[j])
            den = Float32(0.0)
            o = cute.make_rmem_tensor((E,), Float32)
            o.fill(0.0)
            for s0 in cutlass.range(0, n_splits, SB, unroll=1):
                for j in cutlass.range_constexpr(SB):
                    sl = attn_merge_split(s0, j, n_splits, cutlass.min) * stride
                    mv[j] = ld(pF, ml0 + sl * 2)
                    lv[j] = ld(pF, ml0 + sl * 2 + 1)
                    load_f32_into(ov[None, j], pF, o0 + sl * self.D, E)
                for j in cutlass.range_constexpr(SB):
                    if n_splits > s0 + j:
                        w = cute.math.exp(mv[j] - mm)
                        den = den + lv[j] * w
                        for e in cutlass.range_constexpr(E):
                            o[e] = o[e] + ov[e, j] * w
            base = out_off + n * (self.Hq * self.D) + head * self.D + lane * self.E
            for e in cutlass.range_constexpr(self.E):
                a = base + e
                y = o[e] / den
                if cutlass.const_expr(self.pg is not None):  # a padding row: no keys, 0
                    y = Float32(0.0)
                    if den > Float32(0.0):
                        y = o[e] / den
                if cutlass.const_expr(self.spec.output_gate):  # times sigmoid(gate), fp32
                    gt = ld(pF, self.spec.gate_off + gate_index(n, head, lane * self.E + e,
                                                               self.Hq, self.D))
                    y = y * (Float32(1.0) / (Float32(1.0) + cute.math.exp(-gt)))
                st(pB, a, y.to(BFloat16))

    # ---- prefetch of the cached keys/values (before the wait) --------------------------------
    @cute.jit
    def prefetch_kv(self, rec: cute.Tensor, layer: Int32, pI: cute.Pointer, pK: cute.Pointer,
                    pV: cute.Pointer, s_max: Int32, tidx: Int32):
        """L2 prefetch of the keys/values below lengths[b] (they predate this step) that each
        warp share of the split reads first: its first attn_kv_lead keys, so that a record's
        requests stay within shares x 2 x ATTN_KV_LEAD_BYTES at any context (attend's lane 0 slides
        on from there). Thread 2 p + 0 / 1: the keys / values of share p."""
        b, g = rec[word(Op.ATTN_PARTIAL, "B_IDX")], rec[word(Op.ATTN_PARTIAL, "KV_HEAD")]
        s, n_splits = rec[word(Op.ATTN_PARTIAL, "SPLIT")], rec[word(Op.ATTN_PARTIAL, "N_SPLITS")]
        len_off = rec[word(Op.ATTN_PARTIAL, "LEN_OFF")]
        if tidx < 2 * self.shares:
            length = ld(pI, len_off + b)
            part = tidx // 2
            lo, ke = attn_keys(s, n_splits, length, self.T - 1, part, self.shares, self.T,
                               cutlass.min, cutlass.max)
            hi = cutlass.min(cutlass.min(ke, lo + attn_kv_lead(self.D)), length)
            if hi > lo:
                cslot = kv_slot(layer, self.spec.attn_layers, cutlass.min, cutlass.max)
                base = pK.toint()
                if tidx % 2 == 1:
                    base = pV.toint()
                if cutlass.const_expr(self.pg is not None):  # the pages holding keys [lo, hi)
                    pg = self.pg
                    for key in cutlass.range(lo - lo % pg.block_size, hi, pg.block_size,
                                             unroll=1):
                        col, _ = table_entry(b, key, pg.block_size, pg.max_blocks)
                        page = page_base(Int64(cslot), Int64(ld(pI, pg.table_off + col)),
                                         Int64(g), pg.num_blocks, self.Hkv, pg.page_elems)
                        prefetch_span(base + page * Int64(2), Int32(pg.page_elems * 2))
                else:
                    row0 = kv_row(Int64(cslot), b, g, Int64(s_max), self.B, self.Hkv) + lo
                    prefetch_span(base + row0 * Int64(self.D * 2), (hi - lo) * self.D * 2)


def load_smem_bf16x8_f32(s: cute.Tensor, offset):
    """8 fp32 from a shared fp32 tensor (offset a multiple of 8)."""
    r = cute.make_rmem_tensor((VEC,), Float32)
    cute.autovec_copy(cute.flat_divide(s, (VEC,))[None, offset // VEC], r)
    return r.load()

