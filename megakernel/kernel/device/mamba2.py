"""MAMBA_CORE: the Mamba2 SSD update of one (sequence, group) on one CTA (layers/mamba2.py).

conv (+ bias) over the fp32 window, dt and e^{dt A} (and the heads' D, A) in shared memory ->
B . C per token -> the group's state rows through registers in row tiles (read once, written
once, all T tokens applied in between, no barrier per token; the next tile's loads in flight
during this one's arithmetic) -> gated group RMSNorm over all consumer threads (one barrier for
the sum of squares) -> bf16 ssm_out. Each phase issues its global loads together before their
first use: a warp issues in order, so a load consumed in the loop trip that issues it costs a
memory round trip per trip. The phases, the thread mapping and every index are in mamba_index.py
(plain arithmetic, emulated on the host by the tests). Shared memory: a span of
`MambaShape.smem()["words"]` fp32 from the start of the carve-up (KernelSpec.recurrent_smem_bytes).
All math in fp32, in the executor's order of operations but the norm's sum of squares (by thread,
warp, then the warps in order).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.config.fields import word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.gdn import silu
from megakernel.kernel.device.handler import Handler, Step
from megakernel.kernel.device.memory import join64, ld, prefetch_l2, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.gdn_index import SOFTPLUS_LINEAR
from megakernel.kernel.host.mamba_index import LANES


class Mamba2(Handler):
    """The MAMBA_CORE handler of a build (its shapes baked in: spec.shape("mamba2"))."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.m = spec.shape("mamba2")
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier (pipeline.py)
        self.NT, self.NW, self.T = spec.num_threads, spec.num_warps, spec.tokens
        self.eps = spec.eps
        self.sm = self.m.smem()  # word offsets in the scratch span
        # a speculative step (MAMBA_REPLAY only): the conv inputs go to `pending`, the window
        # stays until the COMMIT record (kernel/device/commit.py)
        self.drafts = spec.drafts > 0

    @cute.jit
    def prefetch(self, op: Int32, s: Step):
        self.prefetch_state(s.rec, s.state, s.tidx)

    @cute.jit
    def run(self, op: Int32, s: Step):
        self.core(s.rec, s.weights, s.f32, s.bf16, s.state, s.sScratch, s.tidx, s.warp, s.lane)

    @cute.jit
    def core(self, rec: cute.Tensor, pW: cute.Pointer, pF: cute.Pointer, pB: cute.Pointer,
             pS: cute.Pointer, sS: cute.Tensor, tidx: Int32, warp: Int32, lane: Int32):
        b, j = rec[word(Op.MAMBA_CORE, "B_IDX")], rec[word(Op.MAMBA_CORE, "GROUP")]
        proj, prm = rec[word(Op.MAMBA_CORE, "PROJ_OFF")], rec[word(Op.MAMBA_CORE, "PARAM_OFF")]
        # the layer's block
        st0 = join64(rec[word(Op.MAMBA_CORE, "STATE_LO")], rec[word(Op.MAMBA_CORE, "STATE_HI")])
        cta_sync(self.named)  # the scratch span is free: the previous record is done with it
        conv_w, norm_w = rec[word(Op.MAMBA_CORE, "CONV_W")], rec[word(Op.MAMBA_CORE, "NORM_W")]
        tidx, warp, lane = self.pinned(tidx, j)
        self.conv_gates(b, j, proj, prm, Int64(conv_w), st0, pW, pF, pS, sS, tidx)
        cta_sync(self.named)
        self.bc(sS, warp, lane)
        cta_sync(self.named)
        self.states(b, j, st0, pS, sS, warp, lane)
        cta_sync(self.named)
        self.output(b, j, proj, Int64(norm_w), rec[word(Op.MAMBA_CORE, "OUT_OFF")], pW, pF, pB,
                    sS, tidx, warp, lane)

    def pinned(self, tidx: Int32, j: Int32):
        """(tidx, warp, lane) recomputed from a record word: j >= 0, so min(tidx, j + NT) is
        tidx, but the compiler cannot tell, and so keeps the handler's per-thread index
        arithmetic (the batched loads' offsets) in the handler; as functions of tidx alone it
        would be hoisted out of the kernel's instruction loop and held in registers across
        every handler (+10 to +30 registers kernel-wide)."""
        tid = cutlass.min(tidx, j + self.NT)
        warp = tid // LANES
        return tid, warp, tid - warp * LANES

    # ---- phase 1: conv, gates, B . C ---------------------------------------------------------
    @cute.jit
    def conv_gates(self, b: Int32, j: Int32, proj: Int32, prm: Int32, conv_w: Int64,
                   st0: Int64, pW: cute.Pointer, pF: cute.Pointer, pS: cute.Pointer,
                   sS: cute.Tensor, tidx: Int32):
        """The conv (conv_loads, conv_sums: a chunk of conv_batch channels per thread at a
        time) and the gates, whose loads go out with the first chunk's and whose arithmetic
        runs before that chunk's: one round trip for both."""
        m = self.m
        per = m.win + self.T + 1 + m.conv_k  # a channel's inputs: u, bias, taps
        v = cute.make_rmem_tensor((m.conv_batch * per,), Float32)
        gv = cute.make_rmem_tensor((4 * m.gate_items,), Float32)
        self.gate_loads(b, j, proj, prm, pF, tidx, gv)
        self.conv_loads(b, j, Int32(0), proj, conv_w, st0, pW, pF, pS, tidx, v)
        self.gates(sS, tidx, gv)
        self.conv_sums(b, j, Int32(0), st0, pS, sS, tidx, v)
        for chunk in cutlass.range(1, m.conv_chunks, unroll=1):
            self.conv_loads(b, j, chunk, proj, conv_w, st0, pW, pF, pS, tidx, v)
            self.conv_sums(b, j, chunk, st0, pS, sS, tidx, v)

    @cute.jit
    def conv_loads(self, b: Int32, j: Int32, chunk: Int32, proj: Int32, conv_w: Int64,
                   st0: Int64, pW: cute.Pointer, pF: cute.Pointer, pS: cute.Pointer,
                   tidx: Int32, v: cute.Tensor):
        """v [conv_batch][u (window, T inputs), bias, taps] <- the inputs of the thread's
        channels conv_channel(chunk, tidx, i) (a channel past ch loads the last one's)."""
        m, T, W, K = self.m, self.T, self.m.win, self.m.conv_k
        per = W + T + 1 + K
        for i in cutlass.range_constexpr(m.conv_batch):
            chan = m.channel(cutlass.min(m.conv_channel(chunk, tidx, i), m.ch - 1), j,
                             cutlass.min)
            for k in cutlass.range_constexpr(W):
                v[i * per + k] = ld(pS, st0 + Int64(m.window(b, chan, k)))
            for t in cutlass.range_constexpr(T):
                v[i * per + W + t] = ld(pF, proj + m.proj(b, t, m.x_col(chan)))
            v[i * per + W + T] = ld(pW, conv_w + Int64(m.conv_dim * K + chan)).to(Float32)
            taps = conv_w + Int64(chan * K)
            for k in cutlass.range_constexpr(K):
                v[i * per + W + T + 1 + k] = ld(pW, taps + k).to(Float32)

    @cute.jit
    def conv_sums(self, b: Int32, j: Int32, chunk: Int32, st0: Int64, pS: cute.Pointer,
                  sS: cute.Tensor, tidx: Int32, v: cute.Tensor):
        """x[t][c] = silu(sum_k taps[chan, k] u[t + k] + bias[chan]), u = [window | T new
        inputs], of conv_loads' channels; the last K - 1 of u become the window (a speculative
        step: the T inputs go to `pending`, the window stays). Every sum and
        window store before the first silu (its division may call a slow path: fewer values
        live across it)."""
        m, T, W, K, CB = self.m, self.T, self.m.win, self.m.conv_k, self.m.conv_batch
        per = W + T + 1 + K
        acc = cute.make_rmem_tensor((CB * T,), Float32)
        for i in cutlass.range_constexpr(CB):
            c = m.conv_channel(chunk, tidx, i)
            for t in cutlass.range_constexpr(T):
                a = Float32(0.0)
                for k in cutlass.range_constexpr(K):
                    a = a + v[i * per + t + k] * v[i * per + W + T + 1 + k]
                acc[i * T + t] = a + v[i * per + W + T]
            if c < m.ch:
                chan = m.channel(c, j, cutlass.min)
                if cutlass.const_expr(self.drafts):
                    for t in cutlass.range_constexpr(T):
                        st(pS, st0 + Int64(m.pending(b, chan, t)), v[i * per + W + t])
                else:
                    for k in cutlass.range_constexpr(W):
                        st(pS, st0 + Int64(m.window(b, chan, k)), v[i * per + T + k])
        for i in cutlass.range_constexpr(CB):
            c = m.conv_channel(chunk, tidx, i)
            if c < m.ch:
                for t in cutlass.range_constexpr(T):
                    sS[self.sm["x"] + t * m.ch + c] = silu(acc[i * T + t])

    @cute.jit
    def gate_loads(self, b: Int32, j: Int32, proj: Int32, prm: Int32, pF: cute.Pointer,
                   tidx: Int32, gv: cute.Tensor):
        """The gates' inputs of the thread's (token, head) items idx = tidx + NT i, into gv
        [i][dt, dt_bias, A_log, D] (params row: A_log [H], D [H], dt_bias [H]; an item past
        T R loads the last one's)."""
        m = self.m
        for i in cutlass.range_constexpr(m.gate_items):
            idx = cutlass.min(tidx + i * self.NT, self.T * m.rep - 1)
            t = idx // m.rep
            h = j * m.rep + idx - t * m.rep
            gv[4 * i] = ld(pF, proj + m.proj(b, t, m.dt_col(h)))
            gv[4 * i + 1] = ld(pF, prm + 2 * m.heads + h)
            gv[4 * i + 2] = ld(pF, prm + h)
            gv[4 * i + 3] = ld(pF, prm + m.heads + h)

    @cute.jit
    def gates(self, sS: cute.Tensor, tidx: Int32, gv: cute.Tensor):
        """dt[t][r] = softplus(dt + dt_bias), da[t][r] = exp(dt A), A = -exp(A_log), of head
        h = j R + r from gate_loads; the items of token 0 also put d[r] = D and a[r] = A in
        shared memory (the state tiles and the ring read them there)."""
        m, sm = self.m, self.sm
        for i in cutlass.range_constexpr(m.gate_items):
            idx = tidx + i * self.NT
            aa = gv[4 * i] + gv[4 * i + 1]
            sp = aa
            if aa <= Float32(SOFTPLUS_LINEAR):
                sp = cute.math.log1p(cute.math.exp(aa))
            a = -cute.math.exp(gv[4 * i + 2])
            if idx < self.T * m.rep:
                sS[sm["dt"] + idx] = sp
                sS[sm["da"] + idx] = cute.math.exp(a * sp)
            if idx < m.rep:
                sS[sm["a"] + idx] = a
                sS[sm["d"] + idx] = gv[4 * i + 3]

    @cute.jit
    def bc(self, sS: cute.Tensor, warp: Int32, lane: Int32):
        """bc[t] = B . C of token t: one warp per token."""
        m = self.m
        for t in cutlass.range(warp, self.T, self.NW, unroll=1):
            base = self.sm["x"] + t * m.ch + m.rows
            d = Float32(0.0)
            for n in cutlass.range(lane, m.state_size, LANES, unroll=1):
                d = d + sS[base + n] * sS[base + m.state_size + n]
            d = cute.arch.warp_reduction_sum(d)
            if lane == 0:
                sS[self.sm["bc"] + t] = d

    # ---- phase 2: the states through registers -----------------------------------------------
    @cute.jit
    def load_tile(self, b: Int32, j: Int32, it: Int32, st0: Int64, pS: cute.Pointer,
                  warp: Int32, lane: Int32, regs: cute.Tensor):
        """regs [RPT rows][CPL columns] <- the thread's values of state row tile `it`."""
        m, CPL = self.m, self.m.cpl
        for k in cutlass.range_constexpr(m.rpt):
            row = m.row(it, warp, lane, k)
            for c in cutlass.range_constexpr(CPL):
                regs[k * CPL + c] = ld(pS, st0 + Int64(m.state(b, j, row, m.col(lane, c))))

    @cute.jit
    def store_tile(self, b: Int32, j: Int32, it: Int32, st0: Int64, pS: cute.Pointer,
                   warp: Int32, lane: Int32, regs: cute.Tensor):
        """The thread's values of state row tile `it` <- regs."""
        m, CPL = self.m, self.m.cpl
        for k in cutlass.range_constexpr(m.rpt):
            row = m.row(it, warp, lane, k)
            for c in cutlass.range_constexpr(CPL):
                st(pS, st0 + Int64(m.state(b, j, row, m.col(lane, c))), regs[k * CPL + c])

    @cute.jit
    def states(self, b: Int32, j: Int32, st0: Int64, pS: cute.Pointer, sS: cute.Tensor,
               warp: Int32, lane: Int32):
        """Per row tile: S [RPT rows of this thread][CPL columns] in registers for the T tokens:
        y = da (S . C) + (dt bc) x + D x (S . C reduced over the row's LPR lanes, D from shared
        memory), S <- da S + x (dt B). The next tile's loads are issued first (nxt), so its
        round trip overlaps this tile's arithmetic and stores (its index clamped, not branched
        on: an rmem tensor written under a run-time `if` costs ~30 registers kernel-wide)."""
        m, T, RPT, CPL = self.m, self.T, self.m.rpt, self.m.cpl
        sm = self.sm
        s_reg = cute.make_rmem_tensor((RPT * CPL,), Float32)
        nxt = cute.make_rmem_tensor((RPT * CPL,), Float32)
        self.load_tile(b, j, Int32(0), st0, pS, warp, lane, nxt)
        for it in cutlass.range(m.tiles, unroll=1):
            for q in cutlass.range_constexpr(RPT * CPL):
                s_reg[q] = nxt[q]
            if cutlass.const_expr(m.tiles > 1):  # the last trip reloads its own tile (L1 hit)
                self.load_tile(b, j, cutlass.min(it + 1, m.tiles - 1), st0, pS, warp, lane, nxt)
            for t in cutlass.range_constexpr(T):
                xt = sm["x"] + t * m.ch
                for k in cutlass.range_constexpr(RPT):
                    row = m.row(it, warp, lane, k)
                    r = row // m.head_dim
                    sc = Float32(0.0)
                    for c in cutlass.range_constexpr(CPL):
                        sc = sc + s_reg[k * CPL + c] * sS[xt + m.rows + m.state_size
                                                          + m.col(lane, c)]
                    sc = cute.arch.warp_reduction_sum(sc, threads_in_group=m.lpr)
                    xv = sS[xt + row]
                    dt = sS[sm["dt"] + t * m.rep + r]
                    da = sS[sm["da"] + t * m.rep + r]
                    y = da * sc + dt * sS[sm["bc"] + t] * xv
                    y = y + sS[sm["d"] + r] * xv
                    if lane % m.lpr == 0:
                        sS[sm["y"] + t * m.rows + row] = y
                    for c in cutlass.range_constexpr(CPL):
                        s_reg[k * CPL + c] = da * s_reg[k * CPL + c] + xv * (
                            dt * sS[xt + m.rows + m.col(lane, c)])
            self.store_tile(b, j, it, st0, pS, warp, lane, s_reg)

    # ---- phase 3: gated group RMSNorm -> bf16 --------------------------------------------------
    @cute.jit
    def output(self, b: Int32, j: Int32, proj: Int32, norm_w: Int64, out: Int32,
               pW: cute.Pointer, pF: cute.Pointer, pB: cute.Pointer, sS: cute.Tensor,
               tidx: Int32, warp: Int32, lane: Int32):
        """ssm_out[b T + t, j R P + c] = bf16(g rsqrt(mean(g^2) + eps) w[j R P + c]), g = y
        silu(z) over the group's R P columns: every consumer thread takes the columns out_col
        (their z and w loaded first, g kept in registers); per token the sum of g^2 over the
        thread's columns, the warp (butterfly), then the warps' partials in warp order through
        ss in shared memory (one barrier)."""
        m, T, OC, sm = self.m, self.T, self.m.out_cols, self.sm
        g = cute.make_rmem_tensor((T * OC,), Float32)
        w = cute.make_rmem_tensor((OC,), Float32)
        w0 = norm_w + Int64(j * m.rows)
        for i in cutlass.range_constexpr(OC):
            c = cutlass.min(m.out_col(tidx, i), m.rows - 1)  # past R P: the last column's
            w[i] = ld(pW, w0 + c).to(Float32)
            for t in cutlass.range_constexpr(T):
                g[t * OC + i] = ld(pF, proj + m.proj(b, t, m.z_col(j, c)))
        for t in cutlass.range_constexpr(T):
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(OC):
                c = m.out_col(tidx, i)
                gi = sS[sm["y"] + t * m.rows + cutlass.min(c, m.rows - 1)] * silu(g[t * OC + i])
                g[t * OC + i] = gi
                if c < m.rows:
                    ss = ss + gi * gi
            ss = cute.arch.warp_reduction_sum(ss)
            if lane == 0:
                sS[sm["ss"] + t * self.NW + warp] = ss
        cta_sync(self.named)
        for t in cutlass.range_constexpr(T):
            ss = Float32(0.0)
            for q in cutlass.range_constexpr(self.NW):
                ss = ss + sS[sm["ss"] + t * self.NW + q]
            rstd = Float32(1.0) / cute.math.sqrt(ss / Float32(m.rows) + Float32(self.eps))
            for i in cutlass.range_constexpr(OC):
                c = m.out_col(tidx, i)
                if c < m.rows:
                    st(pB, out + m.out(b, t, j, c), (g[t * OC + i] * rstd * w[i]).to(BFloat16))

    # ---- L2 prefetch of the states (before the dependency wait) ------------------------------
    @cute.jit
    def prefetch_state(self, rec: cute.Tensor, pS: cute.Pointer, tidx: Int32):
        """The record's R heads' states are contiguous and predate this step: ask L2 for them
        while the CTA waits for the projection."""
        m = self.m
        st0 = join64(rec[word(Op.MAMBA_CORE, "STATE_LO")], rec[word(Op.MAMBA_CORE, "STATE_HI")])
        b, j = rec[word(Op.MAMBA_CORE, "B_IDX")], rec[word(Op.MAMBA_CORE, "GROUP")]
        first = st0 + Int64(m.state(b, j, 0, 0))
        prefetch_l2(pS, first, m.rows * m.state_size * 4, tidx)
