"""ATTN_PARTIAL on tensor cores: the G * T queries of a (sequence, kv head) as the rows of one
mma.sync m16n8k16 tile (dense_index.attn_tensor_cores).

Every warp takes a 1 / NW share of the split's keys for all the queries (attn_keys of the last
token; each query row then cut at its causal limit), so a key row is read once per split, not
once per query. Per chunk of KC keys (attn_mma_chunk) a lane issues its K and V words together,
then:
- S = Q K^T: A = the q rows (registers, loaded once), B = key rows, 16 bytes a lane per 32-dim
  step (the GEMV's k permutation, matvec.mma_tile: the same inputs sit in the same k slots of A
  and B, so each score is the plain dot product); tile j's column n is key k0 + 8 j + n.
- the online softmax per row in fp32 (C layout: lane (g, t) holds rows g and g + 8, columns
  2t, 2t + 1 of each tile; the 4 lanes of a row reduce with two butterflies), keys past a row's
  limit at -inf; l is summed per lane and reduced at the end.
- O += P V with P as hi + lo bf16 words (memory.split_bf16x2): two mmas keep fp32's 16 bits
  of each probability. P's A words come straight from S's C fragments (tiles 2kk and 2kk + 1
  are the k halves of key step kk); V's B words are pairs of consecutive keys at one dim, two
  32-bit loads (two dims of two keys) giving the words of two n-tiles: n-tile 2p + h's column
  g is dim 16p + 2g + h, so a lane's O holds dims 16p + 4t .. 16p + 4t + 3 of its rows.
The warps' (m, l, o) are then merged in warp order through shared memory (NW rounds, at the
start of the consumers' span) and every warp stores some rows' partials, which the split-KV
merge reads as before (attention.py).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.matvec import mma_bf16_16816
from megakernel.kernel.device.memory import (
    ld_word,
    load_words4,
    prefetch_l2_at,
    split_bf16x2,
    st,
    store_f32_vec,
)
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.dense_index import (
    attn_keys,
    attn_kv_lead,
    attn_mma_chunk,
    attn_query,
    attn_scale,
)
from megakernel.kernel.host.limits import LANES, MMA_M, MMA_N

NEG_INF = -math.inf
STEP = 32  # head dims per pair of k16 mmas (16 bytes of a row a lane)


def merge_buffer_bytes(head_dim: int) -> int:
    """Shared memory of the warps' merge: fp32 o [MMA_M][D], then (m, l) [MMA_M][2]."""
    return 4 * MMA_M * (head_dim + 2)


class TensorCorePartial:
    """One (sequence, kv head, split) of ATTN_PARTIAL, its queries on tensor cores."""

    def __init__(self, spec: KernelSpec, named: int):
        self.named = named  # the consumer barrier (pipeline.py)
        self.D, self.G, self.T, self.B = spec.head_dim, spec.group, spec.tokens, spec.batch
        self.N, self.Hq, self.NW = spec.rows, spec.heads, spec.num_warps
        self.QG = spec.attn_queries
        assert self.QG <= MMA_M and self.NW == MMA_N and self.D % STEP == 0
        self.KC = attn_mma_chunk(self.D)  # keys per chunk
        self.KN = self.KC // MMA_N  # S tiles per chunk
        self.KS = self.KC // 16  # PV k-steps per chunk
        self.DS = self.D // STEP  # 32-dim steps of a row
        self.PS = self.D // 16  # 16-dim blocks (two O tiles each)
        self.R2 = self.QG > 8  # rows g + 8 hold queries
        self.scale = attn_scale(self.D)
        self.lead = attn_kv_lead(self.D)
        # the warps' merge buffer at the start of the consumers' span (free during the record,
        # as for the recurrent handlers and Attention's q rows): fp32 o [MMA_M][D], (m, l)
        regions = spec.smem_regions()
        assert merge_buffer_bytes(self.D) <= regions["flag"][0], "the merge buffer does not fit"
        self.m_base = -(regions["q"][0] // 4)  # fp32 words from sQ

    @cute.jit
    def partial(self, b: Int32, g: Int32, s: Int32, n_splits: Int32, length: Int32,
                kv_row0: Int64, q_off: Int32, po_off: Int32, pml_off: Int32, pF: cute.Pointer,
                pB: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, sQ: cute.Tensor,
                warp: Int32, lane: Int32):
        D, G, T, DS, PS = self.D, self.G, self.T, self.DS, self.PS
        gq = lane // 4
        tq = lane - gq * 4
        # this warp's share [kb, kw) of the split (the last token's range: no causal cut)
        kb, kw = attn_keys(s, n_splits, length, Int32(T - 1), warp, self.NW, T, cutlass.min,
                           cutlass.max)
        # rows gq, gq + 8: each query's end of keys (kb: a row without a query sees none) and
        # its q words, 16 bytes per 32-dim step
        ke = cute.make_rmem_tensor((2,), Int32)
        qa = cute.make_rmem_tensor((4, 2 * DS), Int32)
        qa.fill(0)
        for h in cutlass.range_constexpr(2 if self.R2 else 1):
            r = gq + 8 * h
            ke[h] = kb
            if r < self.QG:
                t, head, n = attn_query(r, g, b, G, T)
                ke[h] = cutlass.max(kb, cutlass.min(kw, length + t + 1))
                qrow = pB.toint() + Int64(q_off + (n * self.Hq + head) * D + 8 * tq) * 2
                for c in cutlass.range_constexpr(DS):
                    load_words4(qrow + Int64(c * STEP * 2), qa[None, h * DS + c])
        m = cute.make_rmem_tensor((2,), Float32)
        m.fill(NEG_INF)
        lsum = cute.make_rmem_tensor((2,), Float32)
        lsum.fill(0.0)
        o = cute.make_rmem_tensor((4, 2 * PS), Float32)  # C fragments of the O tiles
        o.fill(0.0)
        kwd = cute.make_rmem_tensor((4, self.KN * DS), Int32)
        vwd = cute.make_rmem_tensor((4, self.KS * PS), Int32)
        sc = cute.make_rmem_tensor((4, self.KN), Float32)
        for k0 in cutlass.range(kb, kw, self.KC, unroll=1):
            self.load_chunk(kwd, vwd, kv_row0, k0, kw, pK, pV, gq, tq, lane)
            self.scores(sc, qa, kwd, ke, k0, tq)
            self.softmax(sc, m, lsum, o)
            self.add_values(o, sc, vwd)
        for h in cutlass.range_constexpr(2):
            lsum[h] = lsum[h] + cute.arch.shuffle_sync_bfly(lsum[h], offset=1)
            lsum[h] = lsum[h] + cute.arch.shuffle_sync_bfly(lsum[h], offset=2)
        self.merge_warps(m, lsum, o, b, g, s, po_off, pml_off, pF, sQ, warp, gq, tq)

    @cute.jit
    def load_chunk(self, kwd: cute.Tensor, vwd: cute.Tensor, kv_row0: Int64, k0: Int32,
                   kw: Int32, pK: cute.Pointer, pV: cute.Pointer, gq: Int32, tq: Int32,
                   lane: Int32):
        """Issue the chunk's K words (key k0 + 8 j + gq of tile j, dims 32 c + 8 tq ..) and V
        words (keys k0 + 16 kk + 2 tq + {0, 1, 8, 9}, dims 16 p + 2 gq, + 1), every load before
        any use; keys past kw read the last one (in range; their probabilities are 0). Lane 0
        requests the chunk attn_kv_lead keys on into L2."""
        D = self.D
        if lane == 0:
            ahead = k0 + self.lead
            if ahead < kw:
                nb = cutlass.min(kw - ahead, Int32(self.KC)) * (D * 2)
                off = (kv_row0 + Int64(ahead)) * Int64(D * 2)
                prefetch_l2_at(pK.toint() + off, nb)
                prefetch_l2_at(pV.toint() + off, nb)
        for j in cutlass.range_constexpr(self.KN):
            key = cutlass.min(k0 + MMA_N * j + gq, kw - 1)
            krow = pK.toint() + ((kv_row0 + Int64(key)) * D + Int64(8 * tq)) * 2
            for c in cutlass.range_constexpr(self.DS):
                load_words4(krow + Int64(c * STEP * 2), kwd[None, j * self.DS + c])
        for kk in cutlass.range_constexpr(self.KS):
            for e in cutlass.range_constexpr(4):
                key = cutlass.min(k0 + 16 * kk + 2 * tq + e % 2 + 8 * (e // 2), kw - 1)
                vrow = pV.toint() + ((kv_row0 + Int64(key)) * D + Int64(2 * gq)) * 2
                for p in cutlass.range_constexpr(self.PS):
                    vwd[e, kk * self.PS + p] = ld_word(vrow + Int64(p * 32))

    @cute.jit
    def scores(self, sc: cute.Tensor, qa: cute.Tensor, kwd: cute.Tensor, ke: cute.Tensor,
               k0: Int32, tq: Int32):
        """sc[e, j] = scale * q . k of C slot e of tile j (row gq + 8 (e // 2), key k0 + 8 j +
        2 tq + e % 2); -inf past the row's limit."""
        DS = self.DS
        for j in cutlass.range_constexpr(self.KN):
            d = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
            for c in cutlass.range_constexpr(DS):
                for h in cutlass.range_constexpr(2):  # words 2h, 2h + 1 of the step
                    a1 = Int32(0)
                    a3 = Int32(0)
                    if cutlass.const_expr(self.R2):
                        a1 = qa[2 * h, DS + c]
                        a3 = qa[2 * h + 1, DS + c]
                    d = mma_bf16_16816(qa[2 * h, c], a1, qa[2 * h + 1, c], a3,
                                       kwd[2 * h, j * DS + c], kwd[2 * h + 1, j * DS + c],
                                       d[0], d[1], d[2], d[3])
            for e in cutlass.range_constexpr(4):
                v = d[e] * Float32(self.scale)
                if k0 + MMA_N * j + 2 * tq + e % 2 >= ke[e // 2]:
                    v = Float32(NEG_INF)
                sc[e, j] = v

    @cute.jit
    def softmax(self, sc: cute.Tensor, m: cute.Tensor, lsum: cute.Tensor, o: cute.Tensor):
        """The online softmax of the chunk per row: the row max over the 4 lanes of the row,
        o and this lane's l rescaled, sc turned into probabilities (0 past a row's limit; a
        row that has seen no key keeps m = -inf and o = l = 0)."""
        for h in cutlass.range_constexpr(2 if self.R2 else 1):
            mx = Float32(NEG_INF)
            for j in cutlass.range_constexpr(self.KN):
                mx = cute.arch.fmax(mx, cute.arch.fmax(sc[2 * h, j], sc[2 * h + 1, j]))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            m_new = cute.arch.fmax(m[h], mx)
            m_use = m_new
            if m_new == Float32(NEG_INF):
                m_use = Float32(0.0)
            alpha = cute.math.exp(m[h] - m_use)
            acc = lsum[h] * alpha
            for j in cutlass.range_constexpr(2 * self.PS):
                o[2 * h, j] = o[2 * h, j] * alpha
                o[2 * h + 1, j] = o[2 * h + 1, j] * alpha
            for j in cutlass.range_constexpr(self.KN):
                for e in cutlass.range_constexpr(2):
                    p = cute.math.exp(sc[2 * h + e, j] - m_use)
                    sc[2 * h + e, j] = p
                    acc = acc + p
            lsum[h] = acc
            m[h] = m_new

    @cute.jit
    def add_values(self, o: cute.Tensor, sc: cute.Tensor, vwd: cute.Tensor):
        """O += P V over the chunk: per key step kk the hi and lo words of P (A: tiles 2 kk, 2 kk
        + 1 of sc) against the value words of each 16-dim block p transposed into the B words
        of O tiles 2p (the words' low dims) and 2p + 1 (high)."""
        PS = self.PS
        lo16 = Int32(0xFFFF)
        hi16 = Int32(-65536)  # 0xFFFF0000
        for kk in cutlass.range_constexpr(self.KS):
            ph = cute.make_rmem_tensor((4,), Int32)
            pl = cute.make_rmem_tensor((4,), Int32)
            for a in cutlass.range_constexpr(4):  # A word a: row half a % 2, tile 2 kk + a // 2
                j = 2 * kk + a // 2
                e = 2 * (a % 2)
                if cutlass.const_expr(self.R2 or a % 2 == 0):
                    wh, wl = split_bf16x2(sc[e, j], sc[e + 1, j])
                    ph[a] = wh
                    pl[a] = wl
                else:
                    ph[a] = Int32(0)
                    pl[a] = Int32(0)
            for p in cutlass.range_constexpr(PS):
                w = [vwd[e, kk * PS + p] for e in range(4)]
                for h in cutlass.range_constexpr(2):  # O tile 2p + h: dims 16p + 2g + h
                    if cutlass.const_expr(h == 0):
                        b0 = (w[0] & lo16) | (w[1] << 16)
                        b1 = (w[2] & lo16) | (w[3] << 16)
                    else:
                        b0 = ((w[0] >> 16) & lo16) | (w[1] & hi16)
                        b1 = ((w[2] >> 16) & lo16) | (w[3] & hi16)
                    jt = 2 * p + h
                    d = mma_bf16_16816(ph[0], ph[1], ph[2], ph[3], b0, b1,
                                       o[0, jt], o[1, jt], o[2, jt], o[3, jt])
                    d = mma_bf16_16816(pl[0], pl[1], pl[2], pl[3], b0, b1,
                                       d[0], d[1], d[2], d[3])
                    for c in cutlass.range_constexpr(4):
                        o[c, jt] = d[c]

    @cute.jit
    def merge_warps(self, m: cute.Tensor, lsum: cute.Tensor, o: cute.Tensor, b: Int32, g: Int32,
                    s: Int32, po_off: Int32, pml_off: Int32, pF: cute.Pointer, sQ: cute.Tensor,
                    warp: Int32, gq: Int32, tq: Int32):
        """Fold the warps' (m, l, o) in warp order through shared memory ([MMA_M][D] o, then
        [MMA_M][2] (m, l)): warp w merges what warps 0 .. w - 1 left and writes it back; then
        every warp stores the split's partials of rows warp, warp + NW (those holding queries),
        lane = E dims as Attention.store_partial."""
        D, PS, E = self.D, self.PS, self.D // LANES
        sA = cute.make_tensor(sQ.iterator + self.m_base, cute.make_layout(MMA_M * (D + 2)))
        sml = MMA_M * D
        for w in cutlass.range_constexpr(self.NW):
            if warp == w:
                for h in cutlass.range_constexpr(2 if self.R2 else 1):
                    r = gq + 8 * h
                    if cutlass.const_expr(w > 0):  # merge with the earlier warps'
                        mb = sA[sml + 2 * r]
                        mm = cute.arch.fmax(m[h], mb)
                        m_use = mm
                        if mm == Float32(NEG_INF):
                            m_use = Float32(0.0)
                        wa = cute.math.exp(m[h] - m_use)
                        wb = cute.math.exp(mb - m_use)
                        lsum[h] = lsum[h] * wa + sA[sml + 2 * r + 1] * wb
                        for p in cutlass.range_constexpr(PS):
                            for i in cutlass.range_constexpr(4):
                                c, jt = 2 * h + i // 2, 2 * p + i % 2
                                o[c, jt] = o[c, jt] * wa + sA[r * D + 16 * p + 4 * tq + i] * wb
                        m[h] = mm
                    for p in cutlass.range_constexpr(PS):
                        for i in cutlass.range_constexpr(4):
                            sA[r * D + 16 * p + 4 * tq + i] = o[2 * h + i // 2, 2 * p + i % 2]
                    if tq == 0:
                        sA[sml + 2 * r] = m[h]
                        sA[sml + 2 * r + 1] = lsum[h]
            cta_sync(self.named)
        lane = gq * 4 + tq
        for r in cutlass.range(warp, self.QG, self.NW, unroll=1):
            _, head, n = attn_query(r, g, b, self.G, self.T)
            slot = (s * self.N + n) * self.Hq + head
            v = cute.make_rmem_tensor((E,), Float32)
            for e in cutlass.range_constexpr(E):
                v[e] = sA[r * D + lane * E + e]
            store_f32_vec(pF, po_off + slot * D + lane * E, v.load(), E)
            if lane == 0:
                st(pF, pml_off + slot * 2, sA[sml + 2 * r])
                st(pF, pml_off + slot * 2 + 1, sA[sml + 2 * r + 1])
