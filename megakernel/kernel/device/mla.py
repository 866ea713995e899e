"""MLA_Q, MLA and MLA_O: multi-head latent attention decoded with weight absorption
(layers/mla.py) on one CTA a record.

MLA_Q absorbs W_UK into one head's query, MLA attends all heads of one (sequence, split) over the
latent cache (keys [c | k_rope], values c) after storing the split's new latents, MLA_O merges
one head's splits and applies W_UV. The thread mappings, the chunking of the keys and every index
are in mla_index.py (plain arithmetic, emulated on the host by the tests). Shared memory: the
handlers' scratch span (KernelSpec.recurrent_smem_bytes, `MLAShape.smem()`), over the consumers'
per-record regions. All math in fp32, as the executor's.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.config.fields import word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.handler import Handler, Step
from megakernel.kernel.device.memory import ld, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.dense_index import attn_keys, attn_scale, kv_row, kv_slot
from megakernel.kernel.host.mla_index import BATCH, LANES, LATENT_NORM_EPS

NEG_INF = -math.inf


class LatentAttention(Handler):
    """MLA_Q, MLA and MLA_O: latent attention with the weights absorbed (layers/mla.py)."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.m = spec.shape("mla")
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier (pipeline.py)
        self.NT, self.NW, self.N, self.T = spec.num_threads, spec.num_warps, spec.rows, spec.tokens
        self.sm = self.m.smem()  # word offsets in the scratch span
        self.scale = attn_scale(self.m.dqk)

    @cute.jit
    def run(self, op: Int32, s: Step):
        if op == Op.MLA_Q:
            self.absorb_q(s.rec, s.weights, s.f32, s.sScratch, s.tidx)
        elif op == Op.MLA:
            self.attend(s.rec, s.layer, s.weights, s.f32, s.i32, s.k_cache, s.v_cache, s.s_max,
                        s.sScratch, s.tidx, s.warp, s.lane)
        else:
            self.project_o(s.rec, s.weights, s.f32, s.bf16, s.sScratch, s.tidx, s.warp, s.lane)

    # ---- MLA_Q ---------------------------------------------------------------------------------
    @cute.jit
    def absorb_q(self, rec: cute.Tensor, pW: cute.Pointer, pF: cute.Pointer, sS: cute.Tensor,
                 tidx: Int32):
        """q_lat[n, h] = W_UK_h^T bf16(q_nope[n, h]) for all N rows: thread = (row part, column),
        the parts summed in shared memory."""
        m, N, sm = self.m, self.N, self.sm
        h, proj = rec[word(Op.MLA_Q, "HEAD")], rec[word(Op.MLA_Q, "PROJ_OFF")]
        kvb, qlat = Int64(rec[word(Op.MLA_Q, "KVB_W")]), rec[word(Op.MLA_Q, "QLAT_OFF")]
        cta_sync(self.named)  # the scratch span is free: the previous record is done with it
        for idx in cutlass.range(tidx, N * m.nope, self.NT, unroll=1):  # sQ [N, dn]
            n = idx // m.nope
            q = ld(pF, proj + m.proj(n, m.q_col(h, idx - n * m.nope)))
            sS[sm["q"] + idx] = q.to(BFloat16).to(Float32)
        p, j = m.q_part(tidx)
        i0, i1 = m.part_rows(p)
        acc = cute.make_rmem_tensor((N,), Float32)
        w = cute.make_rmem_tensor((BATCH,), Float32)
        for jc in cutlass.range(0, m.rank, m.rc, unroll=1):
            cta_sync(self.named)  # sQ staged / the previous pass's sums read
            acc.fill(0.0)
            for ib in cutlass.range(i0, i1, BATCH, unroll=1):  # BATCH rows' loads in flight
                for u in cutlass.range_constexpr(BATCH):
                    w[u] = Float32(0.0)
                    if ib + u < i1:
                        w[u] = ld(pW, kvb + Int64(m.w_uk(h, ib + u, jc + j))).to(Float32)
                for u in cutlass.range_constexpr(BATCH):
                    if ib + u < i1:
                        for n in cutlass.range_constexpr(N):
                            acc[n] = acc[n] + sS[sm["q"] + n * m.nope + ib + u] * w[u]
            for n in cutlass.range_constexpr(N):
                sS[sm["red"] + m.red(p, n, j)] = acc[n]
            cta_sync(self.named)
            for idx in cutlass.range(tidx, N * m.rc, self.NT, unroll=1):
                n = idx // m.rc
                jj = idx - n * m.rc
                tot = Float32(0.0)
                for pp in cutlass.range_constexpr(m.parts):
                    tot = tot + sS[sm["red"] + m.red(pp, n, jj)]
                st(pF, qlat + m.qlat(n, h, jc + jj), tot)

    # ---- MLA -----------------------------------------------------------------------------------
    @cute.jit
    def attend(self, rec: cute.Tensor, layer: Int32, pW: cute.Pointer, pF: cute.Pointer,
               pI: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, s_max: Int32,
               sS: cute.Tensor, tidx: Int32, warp: Int32, lane: Int32):
        """One (sequence, split): the new latents -> cache, then the split-KV partials of all
        heads over the split's keys in chunks staged in shared memory."""
        m, T, sm = self.m, self.T, self.sm
        b, s = rec[word(Op.MLA, "B_IDX")], rec[word(Op.MLA, "SPLIT")]
        n_splits, proj = rec[word(Op.MLA, "N_SPLITS")], rec[word(Op.MLA, "PROJ_OFF")]
        qlat, norm_w = rec[word(Op.MLA, "QLAT_OFF")], Int64(rec[word(Op.MLA, "NORM_W")])
        po, pml = rec[word(Op.MLA, "PO_OFF")], rec[word(Op.MLA, "PML_OFF")]
        length = ld(pI, rec[word(Op.MLA, "LEN_OFF")] + b)
        cslot = kv_slot(layer, self.spec.attn_layers, cutlass.min, cutlass.max)
        row0 = kv_row(Int64(cslot), b, 0, Int64(s_max), self.spec.batch, 1)  # position 0
        # the split's keys [lo, hi): those the last token sees (attention's split rule)
        lo, hi = attn_keys(s, n_splits, length, T - 1, 0, 1, T, cutlass.min, cutlass.max)
        cta_sync(self.named)  # the scratch span is free
        self.store_latents(b, length, lo, hi, proj, norm_w, row0, pW, pF, pK, pV, warp, lane)
        for qi in cutlass.range(tidx, m.queries, self.NT, unroll=1):
            sS[sm["m"] + qi] = Float32(NEG_INF)
            sS[sm["l"] + qi] = Float32(0.0)
        o = cute.make_rmem_tensor((m.owned,), Float32)
        o.fill(0.0)
        for k0 in cutlass.range(lo, hi, m.kc, unroll=1):
            nk = cutlass.min(hi - k0, Int32(m.kc))
            cta_sync(self.named)  # the new latents stored / the previous chunk consumed
            self.stage_chunk(row0, k0, nk, pK, pV, sS, tidx)
            cta_sync(self.named)
            self.scores(b, s, n_splits, length, k0, proj, qlat, pF, sS, warp, lane)
            cta_sync(self.named)
            for u in cutlass.range_constexpr(m.owned):
                qi, j = m.own(tidx, u)
                if qi < m.queries:
                    acc = o[u] * sS[sm["alpha"] + qi]
                    for kk in cutlass.range(nk, unroll=1):
                        acc = acc + sS[sm["p"] + qi * m.kc + kk] * sS[sm["lat"] + m.lat(kk, j)]
                    o[u] = acc
        for u in cutlass.range_constexpr(m.owned):
            qi, j = m.own(tidx, u)
            if qi < m.queries:
                t, h = m.query(qi)
                st(pF, po + m.po(s, b * T + t, h, j), o[u])
        for qi in cutlass.range(tidx, m.queries, self.NT, unroll=1):  # this thread's init'd
            t, h = m.query(qi)
            st(pF, pml + m.pml(s, b * T + t, h), sS[sm["m"] + qi])
            st(pF, pml + m.pml(s, b * T + t, h) + 1, sS[sm["l"] + qi])

    @cute.jit
    def stage_chunk(self, row0: Int64, k0: Int32, nk: Int32, pK: cute.Pointer, pV: cute.Pointer,
                    sS: cute.Tensor, tidx: Int32):
        """The chunk's nk cached latents [c | k_rope | 0] -> fp32 rows of shared memory: thread
        tidx copies elements tidx + NT i, BATCH of them loaded before any is stored."""
        m, nt = self.m, self.NT
        total = nk * m.width32
        v = cute.make_rmem_tensor((BATCH,), Float32)
        for ib in cutlass.range(tidx, total, nt * BATCH, unroll=1):
            for u in cutlass.range_constexpr(BATCH):
                idx = ib + u * nt
                kk = idx // m.width32
                d = idx - kk * m.width32
                v[u] = Float32(0.0)
                if idx < total:
                    if d < m.rank:
                        v[u] = ld(pK, m.c_elem(row0 + Int64(k0 + kk), d)).to(Float32)
                    elif d < m.width:
                        v[u] = ld(pV, m.kr_elem(row0 + Int64(k0 + kk), d - m.rank)).to(Float32)
            for u in cutlass.range_constexpr(BATCH):
                idx = ib + u * nt
                kk = idx // m.width32
                if idx < total:
                    sS[self.sm["lat"] + m.lat(kk, idx - kk * m.width32)] = v[u]

    @cute.jit
    def store_latents(self, b: Int32, length: Int32, lo: Int32, hi: Int32, proj: Int32,
                      norm_w: Int64, row0: Int64, pW: cute.Pointer, pF: cute.Pointer,
                      pK: cute.Pointer, pV: cute.Pointer, warp: Int32, lane: Int32):
        """A warp per new position of the split: c = bf16(RMSNorm(c) NORM_W), k_rope =
        bf16(k_rope) from proj -> the latent cache."""
        m = self.m
        nc, nr = m.rank // LANES, -(-m.rope // LANES)  # a lane's c and k_rope columns
        k_new, k_end = m.new_keys(lo, hi, length, cutlass.max)
        x = cute.make_rmem_tensor((nc,), Float32)
        g = cute.make_rmem_tensor((nc,), Float32)
        kr = cute.make_rmem_tensor((nr,), Float32)
        for pos in cutlass.range(k_new + warp, k_end, self.NW, unroll=1):
            n = b * self.T + pos - length
            for c in cutlass.range_constexpr(nc):  # every load in flight, then the sums
                x[c] = ld(pF, proj + m.proj(n, m.lat_col(c * LANES + lane)))
                g[c] = ld(pW, norm_w + Int64(c * LANES + lane)).to(Float32)
            for c in cutlass.range_constexpr(nr):
                kr[c] = Float32(0.0)
                if c * LANES + lane < m.rope:
                    kr[c] = ld(pF, proj + m.proj(n, m.lat_col(m.rank + c * LANES + lane)))
            ss = Float32(0.0)
            for c in cutlass.range_constexpr(nc):
                ss = ss + x[c] * x[c]
            ss = cute.arch.warp_reduction_sum(ss)
            rstd = Float32(1.0) / cute.math.sqrt(ss / Float32(m.rank) + Float32(LATENT_NORM_EPS))
            row = row0 + Int64(pos)
            for c in cutlass.range_constexpr(nc):
                st(pK, m.c_elem(row, c * LANES + lane), (x[c] * rstd * g[c]).to(BFloat16))
            for c in cutlass.range_constexpr(nr):
                if c * LANES + lane < m.rope:
                    st(pV, m.kr_elem(row, c * LANES + lane), kr[c].to(BFloat16))

    @cute.jit
    def scores(self, b: Int32, s: Int32, n_splits: Int32, length: Int32, k0: Int32, proj: Int32,
               qlat: Int32, pF: cute.Pointer, sS: cute.Tensor, warp: Int32, lane: Int32):
        """A warp per query over the staged chunk: lanes over the query's dims (its W32 / 32
        values loaded at once), one accumulator per key of the chunk, each reduced over the warp
        (lane kk keeps key kk's score); then the online softmax's (m, l), alpha and the chunk's
        e^(score - m) in shared memory."""
        m, T, sm = self.m, self.T, self.sm
        for qi in cutlass.range(warp, m.queries, self.NW, unroll=1):
            t, h = m.query(qi)
            n = b * T + t
            _, ke = attn_keys(s, n_splits, length, t, 0, 1, T, cutlass.min, cutlass.max)
            qv = cute.make_rmem_tensor((m.dim_steps,), Float32)
            for c in cutlass.range_constexpr(m.dim_steps):  # [q_lat | bf16(q_rope) | 0 padding]
                d = c * LANES + lane
                if cutlass.const_expr((c + 1) * LANES <= m.rank):
                    qv[c] = ld(pF, qlat + m.qlat(n, h, d))
                else:
                    qv[c] = Float32(0.0)
                    if d < m.width:
                        qv[c] = ld(pF, proj + m.proj(n, m.q_col(h, m.nope + d - m.rank))).to(
                            BFloat16).to(Float32)
            acc = cute.make_rmem_tensor((m.kc,), Float32)
            acc.fill(0.0)
            for c in cutlass.range_constexpr(m.dim_steps):
                for kk in cutlass.range_constexpr(m.kc):
                    acc[kk] = acc[kk] + qv[c] * sS[sm["lat"] + m.lat(kk, c * LANES + lane)]
            score = Float32(NEG_INF)
            for kk in cutlass.range_constexpr(m.kc):
                dot = cute.arch.warp_reduction_sum(acc[kk])
                if (lane == kk) & (k0 + kk < ke):
                    score = dot * Float32(self.scale)
            m_old = sS[sm["m"] + qi]
            m_new = cute.arch.fmax(m_old, cute.arch.warp_reduction_max(score))
            base = m_new
            if m_new == Float32(NEG_INF):  # no visible key yet: alpha = p = 0
                base = Float32(0.0)
            alpha = cute.math.exp(m_old - base)
            p = cute.math.exp(score - base)
            lsum = cute.arch.warp_reduction_sum(p)
            if lane < m.kc:
                sS[sm["p"] + qi * m.kc + lane] = p
            if lane == 0:
                sS[sm["alpha"] + qi] = alpha
                sS[sm["m"] + qi] = m_new
                sS[sm["l"] + qi] = sS[sm["l"] + qi] * alpha + lsum

    # ---- MLA_O ---------------------------------------------------------------------------------
    @cute.jit
    def project_o(self, rec: cute.Tensor, pW: cute.Pointer, pF: cute.Pointer, pB: cute.Pointer,
                  sS: cute.Tensor, tidx: Int32, warp: Int32, lane: Int32):
        """Merge head h's splits in order into o_lat [N, r] (shared memory), then out[n, h dv +
        i] = bf16(W_UV_h[i] . o_lat[n]): a warp per i, lanes over r."""
        m, N, sm = self.m, self.N, self.sm
        h, n_splits = rec[word(Op.MLA_O, "HEAD")], rec[word(Op.MLA_O, "N_SPLITS")]
        po, pml = rec[word(Op.MLA_O, "PO_OFF")], rec[word(Op.MLA_O, "PML_OFF")]
        kvb, out = Int64(rec[word(Op.MLA_O, "KVB_W")]), rec[word(Op.MLA_O, "OUT_OFF")]
        cta_sync(self.named)  # the scratch span is free
        ms = cute.make_rmem_tensor((BATCH,), Float32)
        ls = cute.make_rmem_tensor((BATCH,), Float32)
        for n in cutlass.range(tidx, N, self.NT, unroll=1):
            mx = Float32(NEG_INF)
            den = Float32(0.0)
            for sb in cutlass.range(0, n_splits, BATCH, unroll=1):  # max over the splits
                for u in cutlass.range_constexpr(BATCH):
                    ms[u] = Float32(NEG_INF)
                    if sb + u < n_splits:
                        ms[u] = ld(pF, pml + m.pml(sb + u, n, h))
                for u in cutlass.range_constexpr(BATCH):
                    mx = cute.arch.fmax(mx, ms[u])
            for sb in cutlass.range(0, n_splits, BATCH, unroll=1):  # then the denominator
                for u in cutlass.range_constexpr(BATCH):
                    ms[u] = Float32(NEG_INF)
                    ls[u] = Float32(0.0)
                    if sb + u < n_splits:
                        ms[u] = ld(pF, pml + m.pml(sb + u, n, h))
                        ls[u] = ld(pF, pml + m.pml(sb + u, n, h) + 1)
                for u in cutlass.range_constexpr(BATCH):
                    if sb + u < n_splits:
                        den = den + ls[u] * cute.math.exp(ms[u] - mx)
            sS[sm["mx"] + n] = mx
            sS[sm["den"] + n] = den
        cta_sync(self.named)
        for idx in cutlass.range(tidx, N * m.rank, self.NT, unroll=1):
            n = idx // m.rank
            j = idx - n * m.rank
            num = Float32(0.0)
            for sb in cutlass.range(0, n_splits, BATCH, unroll=1):
                for u in cutlass.range_constexpr(BATCH):
                    ms[u] = Float32(NEG_INF)
                    ls[u] = Float32(0.0)  # here: the split's o element
                    if sb + u < n_splits:
                        ms[u] = ld(pF, pml + m.pml(sb + u, n, h))
                        ls[u] = ld(pF, po + m.po(sb + u, n, h, j))
                for u in cutlass.range_constexpr(BATCH):
                    if sb + u < n_splits:
                        num = num + ls[u] * cute.math.exp(ms[u] - sS[sm["mx"] + n])
            sS[sm["o"] + idx] = num / sS[sm["den"] + n]
        cta_sync(self.named)
        nc = m.rank // LANES  # a lane's columns of a W_UV row
        acc = cute.make_rmem_tensor((N,), Float32)
        w = cute.make_rmem_tensor((nc,), Float32)
        for i in cutlass.range(warp, m.vdim, self.NW, unroll=1):
            acc.fill(0.0)
            for c in cutlass.range_constexpr(nc):  # the row's loads in flight, then the sums
                w[c] = ld(pW, kvb + Int64(m.w_uv(h, i, c * LANES + lane))).to(Float32)
            for c in cutlass.range_constexpr(nc):
                for n in cutlass.range_constexpr(N):
                    acc[n] = acc[n] + sS[sm["o"] + n * m.rank + c * LANES + lane] * w[c]
            for n in cutlass.range_constexpr(N):
                tot = cute.arch.warp_reduction_sum(acc[n])
                if lane == 0:
                    st(pB, out + m.out(n, h, i), tot.to(BFloat16))
