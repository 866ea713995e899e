"""MAMBA_REPLAY: Mamba2 by ReplaySSM for one (sequence, group) on one CTA (layers/mamba2.py).

MAMBA_CORE's conv, gates and gated RMSNorm (kernel/mamba2.py, inherited), and in place of its
state update: the committed entries' B and dt to shared memory (their loads batched) and the T
new entries appended to the ring (r1), B . C of every (token, entry) pair (r2), the decays and
weights per (token, entry, head) (r3), then the committed state S_c through registers in
MAMBA_CORE's row tiles, each lane's entries' x of the tile's rows loaded with the tile (the next
tile's loads in flight during this one's arithmetic): the T outputs from S_c plus the ring, and
at a fold (n + T >= L) the state with every entry folded in, x_e shuffled from the lane that
holds it (r4). Phases, traffic and indices: kernel/host/mamba_index.py; all math in fp32 in the
executor's order of operations (reference/layers/replay.py ssd_replay, ssd_fold).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.config.fields import word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.handler import Step
from megakernel.kernel.device.mamba2 import Mamba2
from megakernel.kernel.device.memory import join64, ld, prefetch_l2, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.mamba_index import LANES


class Mamba2Replay(Mamba2):
    """The MAMBA_REPLAY handler of a build (KernelSpec.replay_window L, ring of L - 1 + T)."""

    def __init__(self, spec: KernelSpec):
        super().__init__(spec)
        self.L, self.cap = spec.replay_window, spec.ring_cap

    @cute.jit
    def prefetch(self, op: Int32, s: Step):
        self.prefetch_replay(s.rec, s.i32, s.state, s.tidx)

    @cute.jit
    def run(self, op: Int32, s: Step):
        self.replay(s.rec, s.weights, s.f32, s.bf16, s.i32, s.state, s.sScratch, s.tidx, s.warp,
                    s.lane)

    @cute.jit
    def replay(self, rec: cute.Tensor, pW: cute.Pointer, pF: cute.Pointer, pB: cute.Pointer,
               pI: cute.Pointer, pS: cute.Pointer, sS: cute.Tensor, tidx: Int32, warp: Int32,
               lane: Int32):
        b, j = rec[word(Op.MAMBA_REPLAY, "B_IDX")], rec[word(Op.MAMBA_REPLAY, "GROUP")]
        proj, prm = rec[word(Op.MAMBA_REPLAY, "PROJ_OFF")], rec[word(Op.MAMBA_REPLAY, "PARAM_OFF")]
        st0 = join64(rec[word(Op.MAMBA_REPLAY, "STATE_LO")],
                     rec[word(Op.MAMBA_REPLAY, "STATE_HI")])
        cnt = rec[word(Op.MAMBA_REPLAY, "COUNT_OFF")] + self.m.count(b, j)
        n = ld(pI, cnt)  # committed entries (< L: the last step folded at L)
        cta_sync(self.named)  # the scratch span is free: the previous record is done with it
        conv_w, norm_w = rec[word(Op.MAMBA_REPLAY, "CONV_W")], rec[word(Op.MAMBA_REPLAY, "NORM_W")]
        tidx, warp, lane = self.pinned(tidx, j)
        self.conv_gates(b, j, proj, prm, Int64(conv_w), st0, pW, pF, pS, sS, tidx)
        cta_sync(self.named)
        self.ring_in(b, j, n, st0, pS, sS, tidx)
        cta_sync(self.named)
        self.dots(n, sS, warp, lane)
        cta_sync(self.named)
        self.weights(n, sS, tidx)
        cta_sync(self.named)
        fold = n + self.T >= self.L
        self.replay_states(b, j, n, fold, st0, pS, sS, warp, lane)
        if cutlass.const_expr(not self.drafts):  # (speculative: COMMIT counts and folds)
            if tidx == 0:
                count = n + self.T
                if fold:
                    count = Int32(0)
                st(pI, cnt, count)
        cta_sync(self.named)
        self.output(b, j, proj, Int64(norm_w), rec[word(Op.MAMBA_REPLAY, "OUT_OFF")], pW, pF,
                    pB, sS, tidx, warp, lane)

    # ---- r1-r3: the ring's B and dt, B . C, decays and weights in shared memory ---------------
    @cute.jit
    def ring_in(self, b: Int32, j: Int32, n: Int32, st0: Int64, pS: cute.Pointer,
                sS: cute.Tensor, tidx: Int32):
        """bs[e] = B_e, dtr[e][r] = dt_e, lam[e][r] = A dt_e (A from shared memory) for the n
        committed entries (from the ring) and the T new ones (from the conv and gates, appended
        to the ring with x). A thread's committed dt loads and its first ring_batch B loads are
        issued together, each batch's before its first use."""
        m, T, sm, N, R = self.m, self.T, self.sm, self.m.state_size, self.m.rep
        RB = m.ring_batch
        ne = n + T
        dv = cute.make_rmem_tensor((m.dt_items,), Float32)
        for i in cutlass.range_constexpr(m.dt_items):
            idx = tidx + i * self.NT
            e = idx // R
            v = Float32(0.0)  # a scalar under the `if` (an rmem tensor there costs registers)
            if e < n:
                v = ld(pS, st0 + Int64(m.ring_dt(b, e, j, idx - e * R)))
            dv[i] = v
        bv = cute.make_rmem_tensor((RB,), Float32)
        for i0 in cutlass.range(0, ne * N, self.NT * RB, unroll=1):
            for i in cutlass.range_constexpr(RB):
                idx = i0 + tidx + i * self.NT
                e = idx // N
                v = Float32(0.0)
                if e < n:
                    v = ld(pS, st0 + Int64(m.ring_b(b, e, j, idx - e * N)))
                bv[i] = v
            for i in cutlass.range_constexpr(RB):
                idx = i0 + tidx + i * self.NT
                e = idx // N
                if idx < ne * N:
                    v = bv[i]
                    if e >= n:
                        v = sS[sm["x"] + (e - n) * m.ch + m.rows + idx - e * N]
                        st(pS, st0 + Int64(m.ring_b(b, e, j, idx - e * N)), v)
                    sS[sm["bs"] + idx] = v
        for i in cutlass.range_constexpr(m.dt_items):
            idx = tidx + i * self.NT
            e = idx // R
            r = idx - e * R
            if idx < ne * R:
                v = dv[i]
                if e >= n:
                    v = sS[sm["dt"] + idx - n * R]
                    st(pS, st0 + Int64(m.ring_dt(b, e, j, r)), v)
                sS[sm["dtr"] + idx] = v
                sS[sm["lam"] + idx] = sS[sm["a"] + r] * v
        for idx in cutlass.range(tidx, T * m.rows, self.NT, unroll=1):
            t = idx // m.rows
            row = idx - t * m.rows
            st(pS, st0 + Int64(m.ring_x(b, n + t, j, row)), sS[sm["x"] + t * m.ch + row])

    @cute.jit
    def dots(self, n: Int32, sS: cute.Tensor, warp: Int32, lane: Int32):
        """dots[t][e] = B_e . C_t for every entry e < n + T: one warp per (t, e)."""
        m, sm, N, ne = self.m, self.sm, self.m.state_size, n + self.T
        for idx in cutlass.range(warp, self.T * ne, self.NW, unroll=1):
            t = idx // ne
            e = idx - t * ne
            cc = sm["x"] + t * m.ch + m.rows + N
            d = Float32(0.0)
            for c in cutlass.range(lane, N, LANES, unroll=1):
                d = d + sS[sm["bs"] + e * N + c] * sS[cc + c]
            d = cute.arch.warp_reduction_sum(d)
            if lane == 0:
                sS[sm["dots"] + t * self.cap + e] = d

    @cute.jit
    def weights(self, n: Int32, sS: cute.Tensor, tidx: Int32):
        """coef[t][e][r] = dt_e e^{Lam(n+t, e)} dots[t][e] (0 for e > n + t), decay[t][r] =
        e^{Lam(n+t, c)}, wf[e][r] = dt_e e^{Lam(n+T-1, e)}; Lam(t, e) summed over entries
        (e, t] in order (segsum's order), a thread each."""
        sm, R, T, cap, ne = self.sm, self.m.rep, self.T, self.cap, n + self.T
        for idx in cutlass.range(tidx, T * ne * R, self.NT, unroll=1):
            t = idx // (ne * R)
            e = (idx - t * ne * R) // R
            r = idx - (t * ne + e) * R
            cf = Float32(0.0)
            if e <= n + t:
                cf = sS[sm["dtr"] + e * R + r] * cute.math.exp(self.lam_sum(e + 1, n + t, r, sS))
                cf = cf * sS[sm["dots"] + t * cap + e]
            sS[sm["coef"] + (t * cap + e) * R + r] = cf
        for idx in cutlass.range(tidx, T * R, self.NT, unroll=1):
            t = idx // R
            r = idx - t * R
            sS[sm["decay"] + idx] = cute.math.exp(self.lam_sum(Int32(0), n + t, r, sS))
        if cutlass.const_expr(not self.drafts):  # (speculative: COMMIT folds)
            self.fold_weights(ne, sS, tidx)

    @cute.jit
    def fold_weights(self, ne: Int32, sS: cute.Tensor, tidx: Int32):
        """wf[e][r] = dt_e e^{Lam(ne-1, e)}: the fold's weights of the ne entries, a thread
        each (MAMBA_REPLAY's r3 and MAMBA_COMMIT's fold, kernel/device/commit.py)."""
        sm, R = self.sm, self.m.rep
        for idx in cutlass.range(tidx, ne * R, self.NT, unroll=1):
            e = idx // R
            r = idx - e * R
            sS[sm["wf"] + idx] = sS[sm["dtr"] + idx] * cute.math.exp(
                self.lam_sum(e + 1, ne - 1, r, sS))

    @cute.jit
    def lam_sum(self, first: Int32, last: Int32, r: Int32, sS: cute.Tensor) -> Float32:
        """sum of lam[q][r] for q in [first, last] (0 when empty)."""
        s = Float32(0.0)
        for q in cutlass.range(first, last + 1, unroll=1):
            s = s + sS[self.sm["lam"] + q * self.m.rep + r]
        return s

    # ---- r4: the committed state through registers ----------------------------------------------
    @cute.jit
    def load_entries(self, b: Int32, j: Int32, n: Int32, it: Int32, st0: Int64,
                     pS: cute.Pointer, sS: cute.Tensor, warp: Int32, lane: Int32,
                     xe: cute.Tensor):
        """xe [RPT rows][ENTRIES] <- x_e[row] of the lane's entries e = entry(lane, i) in row
        tile `it`: a committed entry from the ring, a new one from the conv outputs (0 past
        the n + T entries)."""
        m, E = self.m, self.m.entries
        for k in cutlass.range_constexpr(m.rpt):
            row = m.row(it, warp, lane, k)
            for i in cutlass.range_constexpr(E):
                e = m.entry(lane, i)
                xv = Float32(0.0)  # a scalar under the `if` (an rmem tensor there: registers)
                if e < n:
                    xv = ld(pS, st0 + Int64(m.ring_x(b, e, j, row)))
                else:
                    if e < n + self.T:
                        xv = sS[self.sm["x"] + (e - n) * m.ch + row]
                xe[k * E + i] = xv

    @cute.jit
    def replay_states(self, b: Int32, j: Int32, n: Int32, fold, st0: Int64, pS: cute.Pointer,
                      sS: cute.Tensor, warp: Int32, lane: Int32):
        """Per row tile: S_c [RPT rows][CPL columns] and the lane's entries' x [RPT][ENTRIES] in
        registers (the next tile's loads issued first, so their round trip overlaps this tile's
        arithmetic); y_t[row] = the row's lanes' sum of decay[t] S_c . C_t and coef[t][e]
        x_e[row] over the lane's entries, + D x_t (D from shared memory); at a fold S <-
        decay[T-1] S_c + sum_e x_e (wf[e] B_e), entries in order, x_e[row] shuffled from the
        lane of the row that holds it, stored once."""
        m, T, RPT, CPL, sm, R = self.m, self.T, self.m.rpt, self.m.cpl, self.sm, self.m.rep
        E, ne = m.entries, n + T
        s_reg = cute.make_rmem_tensor((RPT * CPL,), Float32)
        nxt = cute.make_rmem_tensor((RPT * CPL,), Float32)
        xe = cute.make_rmem_tensor((RPT * E,), Float32)
        xn = cute.make_rmem_tensor((RPT * E,), Float32)
        part = cute.make_rmem_tensor((T,), Float32)
        bv = cute.make_rmem_tensor((CPL,), Float32)
        self.load_tile(b, j, Int32(0), st0, pS, warp, lane, nxt)
        self.load_entries(b, j, n, Int32(0), st0, pS, sS, warp, lane, xn)
        for it in cutlass.range(m.tiles, unroll=1):
            for q in cutlass.range_constexpr(RPT * CPL):
                s_reg[q] = nxt[q]
            for q in cutlass.range_constexpr(RPT * E):
                xe[q] = xn[q]
            if cutlass.const_expr(m.tiles > 1):  # the last trip reloads its own tile (L1 hit)
                nt = cutlass.min(it + 1, m.tiles - 1)
                self.load_tile(b, j, nt, st0, pS, warp, lane, nxt)
                self.load_entries(b, j, n, nt, st0, pS, sS, warp, lane, xn)
            for k in cutlass.range_constexpr(RPT):
                row = m.row(it, warp, lane, k)
                r = row // m.head_dim
                for t in cutlass.range_constexpr(T):
                    sc = Float32(0.0)
                    for c in cutlass.range_constexpr(CPL):
                        sc = sc + s_reg[k * CPL + c] * sS[sm["x"] + t * m.ch + m.rows
                                                          + m.state_size + m.col(lane, c)]
                    part[t] = sS[sm["decay"] + t * R + r] * sc
                for i in cutlass.range_constexpr(E):
                    e = m.entry(lane, i)
                    if e < ne:
                        for t in cutlass.range_constexpr(T):
                            part[t] = part[t] + sS[sm["coef"] + (t * self.cap + e) * R + r] * xe[
                                k * E + i]
                for t in cutlass.range_constexpr(T):
                    y = cute.arch.warp_reduction_sum(part[t], threads_in_group=m.lpr)
                    y = y + sS[sm["d"] + r] * sS[sm["x"] + t * m.ch + row]
                    if lane % m.lpr == 0:
                        sS[sm["y"] + t * m.rows + row] = y
            if cutlass.const_expr(not self.drafts):  # (speculative: COMMIT folds)
                if fold:
                    self.fold_tile(it, ne, s_reg, xe, bv, sS, warp, lane)
                    self.store_tile(b, j, it, st0, pS, warp, lane, s_reg)

    @cute.jit
    def fold_tile(self, it: Int32, ne: Int32, s_reg: cute.Tensor, xe: cute.Tensor,
                  bv: cute.Tensor, sS: cute.Tensor, warp: Int32, lane: Int32):
        """The fold of row tile `it` (S_c in s_reg, the lane's entries' x in xe) over the ne
        entries: S <- decay[T-1] S_c + sum_e x_e (wf[e] B_e), entries in order, x_e[row]
        shuffled from the lane that holds it (MAMBA_REPLAY's r4 and MAMBA_COMMIT's fold,
        kernel/device/commit.py)."""
        m, T, RPT, CPL, sm, R = self.m, self.T, self.m.rpt, self.m.cpl, self.sm, self.m.rep
        E = m.entries
        for k in cutlass.range_constexpr(RPT):
            r = m.row(it, warp, lane, k) // m.head_dim
            dec = sS[sm["decay"] + (T - 1) * R + r]
            for c in cutlass.range_constexpr(CPL):
                s_reg[k * CPL + c] = dec * s_reg[k * CPL + c]
        for i in cutlass.range_constexpr(E):
            for e in cutlass.range(i * m.lpr, cutlass.min(ne, (i + 1) * m.lpr), unroll=1):
                src = m.entry_lane(lane, e)
                for c in cutlass.range_constexpr(CPL):
                    bv[c] = sS[sm["bs"] + e * m.state_size + m.col(lane, c)]
                for k in cutlass.range_constexpr(RPT):
                    r = m.row(it, warp, lane, k) // m.head_dim
                    xv = cute.arch.shuffle_sync(xe[k * E + i], src)
                    w = sS[sm["wf"] + e * R + r]
                    for c in cutlass.range_constexpr(CPL):
                        s_reg[k * CPL + c] = s_reg[k * CPL + c] + xv * (w * bv[c])

    # ---- L2 prefetch of S_c and the committed x entries (before the dependency wait) ---------
    @cute.jit
    def prefetch_replay(self, rec: cute.Tensor, pI: cute.Pointer, pS: cute.Pointer,
                        tidx: Int32):
        """The record's committed state and the x of its n committed entries predate this step:
        ask L2 for them while the CTA waits for the projection."""
        m = self.m
        st0 = join64(rec[word(Op.MAMBA_REPLAY, "STATE_LO")],
                     rec[word(Op.MAMBA_REPLAY, "STATE_HI")])
        b, j = rec[word(Op.MAMBA_REPLAY, "B_IDX")], rec[word(Op.MAMBA_REPLAY, "GROUP")]
        prefetch_l2(pS, st0 + Int64(m.state(b, j, 0, 0)), m.rows * m.state_size * 4, tidx)
        if tidx == 0:
            n = ld(pI, rec[word(Op.MAMBA_REPLAY, "COUNT_OFF")] + m.count(b, j))
            for e in cutlass.range(n, unroll=1):
                prefetch_l2(pS, st0 + Int64(m.ring_x(b, e, j, 0)), m.rows * 4, tidx)
