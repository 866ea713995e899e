"""GDN_COMMIT, KDA_COMMIT, MAMBA_COMMIT: a speculative step's ReplaySSM commit of one (sequence,
unit) after ACCEPT (layers/recurrent.py COMMIT_NOTES; executor/ops/recurrent.py `commit`).

The step's REPLAY records appended their T ring entries at n .. n + T - 1 and left the T conv
inputs in `pending` [B, C, T], count, window and state untouched. With e = emitted[b] (ACCEPT's):

1. window: each of the unit's conv channels (a thread each) becomes the last K - 1 of [window |
   pending[:e]]: value j from position e + j of that sequence (commit_index.shift_source), every
   load before the first store.
2. count n + e; when n + e >= L the n + e committed entries are folded into the state by the
   REPLAY handler's own fold (the same shared-memory vectors, made from the ring by the same
   code, and the same per-tile loop: fold_tile), the state written once, and the count is 0.

A record with e = 0 (a sequence at the end of its cache) leaves everything but the count as it
was. Shared memory: the REPLAY handler's span (the commit uses a part of it).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from megakernel import isa
from megakernel.isa import Op
from megakernel.kernel.config.fields import FieldError, word
from megakernel.kernel.device.gdn import GatedDeltaRule
from megakernel.kernel.device.handler import Step
from megakernel.kernel.device.kda import KimiDeltaAttention
from megakernel.kernel.device.mamba_replay import Mamba2Replay
from megakernel.kernel.device.memory import join64, ld, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.commit_index import shift_source


@cute.jit
def shift_window(shape, b: Int32, unit: Int32, e: Int32, st0: Int64, pS: cute.Pointer,  # noqa: ANN001
                 tidx: Int32, threads: int):
    """Step 1 for the unit's channels (shape: the kind's index shape: ch, win, channel, window,
    pending), a thread per channel."""
    W = shape.win
    for c in cutlass.range(tidx, shape.ch, threads, unroll=1):
        chan = shape.channel(c, unit, cutlass.min)
        v = cute.make_rmem_tensor((W,), Float32)
        for j in cutlass.range_constexpr(W):
            at_p, at_w = shift_source(e, j, W)
            x = Float32(0.0)  # a scalar under the `if` (an rmem tensor there costs registers)
            if at_p >= 0:
                x = ld(pS, st0 + Int64(shape.pending(b, chan, at_p)))
            else:
                x = ld(pS, st0 + Int64(shape.window(b, chan, at_w)))
            v[j] = x
        for j in cutlass.range_constexpr(W):
            st(pS, st0 + Int64(shape.window(b, chan, j)), v[j])


class GatedDeltaCommit(GatedDeltaRule):
    """GDN_COMMIT (a subclass with CHANNEL: KDA_COMMIT). The record is read by GDN_COMMIT's
    words; KDA_COMMIT's operands are at the same words (the unit's name differs)."""

    COMMIT = Op.GDN_COMMIT

    def __init__(self, spec):  # noqa: ANN001 (KernelSpec)
        super().__init__(spec)
        for name in isa.spec(self.COMMIT).names:  # the unit at GDN's word, every other operand
            mine = word(self.COMMIT, name)
            if mine != word(Op.GDN_COMMIT, {self.UNIT: "K_HEAD"}.get(name, name)):
                raise FieldError(f"{isa.spec(self.COMMIT).name} operand {name} is not at "
                                 f"GDN_COMMIT's word")

    @cute.jit
    def prefetch(self, op: Int32, s: Step):
        """Nothing: the window and pending are in L2 (written this step), a fold is rare."""

    @cute.jit
    def run(self, op: Int32, s: Step):
        self.commit(s.rec, s.i32, s.state, s.sScratch, s.tidx, s.warp, s.lane)

    @cute.jit
    def commit(self, rec: cute.Tensor, pI: cute.Pointer, pS: cute.Pointer, sS: cute.Tensor,
               tidx: Int32, warp: Int32, lane: Int32):
        g = self.g  # (KDA_COMMIT's operands are at these words: __init__)
        b, kh = rec[word(Op.GDN_COMMIT, "B_IDX")], rec[word(Op.GDN_COMMIT, "K_HEAD")]
        st0 = join64(rec[word(Op.GDN_COMMIT, "STATE_LO")], rec[word(Op.GDN_COMMIT, "STATE_HI")])
        cnt = rec[word(Op.GDN_COMMIT, "COUNT_OFF")] + g.count(b, kh)
        e = ld(pI, rec[word(Op.GDN_COMMIT, "EMIT_OFF")] + b)
        ne = ld(pI, cnt) + e
        cta_sync(self.named)  # the scratch span is free: the previous record is done with it
        shift_window(g, b, kh, e, st0, pS, tidx, self.NT)
        if ne >= g.replay_window:
            self.ring(b, kh, ne, ne, st0, pS, sS, tidx)  # keys, gs of the committed entries
            cta_sync(self.named)
            if cutlass.const_expr(self.CHANNEL):
                self.fold_vectors(ne, sS, tidx)
                cta_sync(self.named)
            self.fold_states(b, kh, ne, st0, pS, sS, warp, lane)
            ne = Int32(0)
        if tidx == 0:
            st(pI, cnt, ne)

    @cute.jit
    def fold_states(self, b: Int32, kh: Int32, ne: Int32, st0: Int64, pS: cute.Pointer,
                    sS: cute.Tensor, warp: Int32, lane: Int32):
        """Per column tile (the REPLAY handler's r3 tiles): S_c and the entries' u of the tile's
        column (ut, a warp per entry) from the ring, then fold_tile, stored once."""
        g, RPW, sm = self.g, self.g.rpw, self.sm
        live = lane < g.cw  # lanes past a narrow head (dv < 32) run on lane CW - 1's column
        col = cutlass.min(lane, Int32(g.cw - 1))
        s_reg = cute.make_rmem_tensor((RPW,), Float32)
        for it in cutlass.range(g.rep * g.tiles, unroll=1):
            r, j = g.tile_column(it, col)
            h = kh * g.rep + r
            for rr in cutlass.range_constexpr(RPW):
                s_reg[rr] = ld(pS, st0 + Int64(g.state(b, h, warp * RPW + rr, j)))
            for e in cutlass.range(warp, ne, self.NW, unroll=1):
                sS[sm["ut"] + g.ut(e, col)] = ld(pS, st0 + Int64(g.ring_u(b, e, h, j)))
            cta_sync(self.named)  # ut complete
            self.fold_tile(r, col, ne, sS, warp, s_reg)
            if live:
                for rr in cutlass.range_constexpr(RPW):
                    st(pS, st0 + Int64(g.state(b, h, warp * RPW + rr, j)), s_reg[rr])
            cta_sync(self.named)  # the next tile's ut may overwrite this one's


class KimiDeltaCommit(GatedDeltaCommit, KimiDeltaAttention):
    """KDA_COMMIT: GDN_COMMIT with KDA's ring gates and fold vectors (CHANNEL)."""

    COMMIT = Op.KDA_COMMIT


class Mamba2Commit(Mamba2Replay):
    """MAMBA_COMMIT."""

    @cute.jit
    def prefetch(self, op: Int32, s: Step):
        """Nothing: the window and pending are in L2 (written this step), a fold is rare."""

    @cute.jit
    def run(self, op: Int32, s: Step):
        self.commit(s.rec, s.f32, s.i32, s.state, s.sScratch, s.tidx)

    @cute.jit
    def commit(self, rec: cute.Tensor, pF: cute.Pointer, pI: cute.Pointer, pS: cute.Pointer,
               sS: cute.Tensor, tidx: Int32):
        m = self.m
        b, j = rec[word(Op.MAMBA_COMMIT, "B_IDX")], rec[word(Op.MAMBA_COMMIT, "GROUP")]
        st0 = join64(rec[word(Op.MAMBA_COMMIT, "STATE_LO")],
                     rec[word(Op.MAMBA_COMMIT, "STATE_HI")])
        cnt = rec[word(Op.MAMBA_COMMIT, "COUNT_OFF")] + m.count(b, j)
        e = ld(pI, rec[word(Op.MAMBA_COMMIT, "EMIT_OFF")] + b)
        ne = ld(pI, cnt) + e
        cta_sync(self.named)  # the scratch span is free: the previous record is done with it
        tidx, warp, lane = self.pinned(tidx, j)
        shift_window(m, b, j, e, st0, pS, tidx, self.NT)
        if ne >= self.L:
            self.commit_ring(b, j, ne, rec[word(Op.MAMBA_COMMIT, "PARAM_OFF")], st0, pF, pS, sS,
                             tidx)
            cta_sync(self.named)
            self.fold_weights(ne, sS, tidx)
            cta_sync(self.named)
            self.fold_states(b, j, ne, st0, pS, sS, warp, lane)
            ne = Int32(0)
        if tidx == 0:
            st(pI, cnt, ne)

    @cute.jit
    def commit_ring(self, b: Int32, j: Int32, ne: Int32, prm: Int32, st0: Int64,
                    pF: cute.Pointer, pS: cute.Pointer, sS: cute.Tensor, tidx: Int32):
        """The REPLAY handler's r1 and r3 vectors for the ne committed entries, from the ring:
        bs [e] = B_e, dtr[e][r] = dt_e, lam[e][r] = A dt_e (A = -exp(A_log), as the gates form
        it), and the fold's decay[T-1][r] = e^{Lam(ne-1, c)}."""
        m, sm, N, R = self.m, self.sm, self.m.state_size, self.m.rep
        for idx in cutlass.range(tidx, ne * N, self.NT, unroll=1):
            e = idx // N
            sS[sm["bs"] + idx] = ld(pS, st0 + Int64(m.ring_b(b, e, j, idx - e * N)))
        for idx in cutlass.range(tidx, ne * R, self.NT, unroll=1):
            e = idx // R
            r = idx - e * R
            a = -cute.math.exp(ld(pF, prm + j * R + r))
            v = ld(pS, st0 + Int64(m.ring_dt(b, e, j, r)))
            sS[sm["dtr"] + idx] = v
            sS[sm["lam"] + idx] = a * v
        cta_sync(self.named)  # lam complete
        for r in cutlass.range(tidx, R, self.NT, unroll=1):
            sS[sm["decay"] + (self.T - 1) * R + r] = cute.math.exp(
                self.lam_sum(Int32(0), ne - 1, r, sS))

    @cute.jit
    def fold_states(self, b: Int32, j: Int32, ne: Int32, st0: Int64, pS: cute.Pointer,
                    sS: cute.Tensor, warp: Int32, lane: Int32):
        """Per row tile (the REPLAY handler's r4 tiles): S_c and the lane's entries' x from the
        ring, then fold_tile, stored once."""
        m = self.m
        s_reg = cute.make_rmem_tensor((m.rpt * m.cpl,), Float32)
        xe = cute.make_rmem_tensor((m.rpt * m.entries,), Float32)
        bv = cute.make_rmem_tensor((m.cpl,), Float32)
        for it in cutlass.range(m.tiles, unroll=1):
            self.load_tile(b, j, it, st0, pS, warp, lane, s_reg)
            self.load_entries(b, j, ne, it, st0, pS, sS, warp, lane, xe)
            self.fold_tile(it, ne, s_reg, xe, bv, sS, warp, lane)
            self.store_tile(b, j, it, st0, pS, warp, lane, s_reg)
