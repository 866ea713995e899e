"""MAMBA_CORE: the Mamba2 SSD update of one (sequence, group) on one CTA (layers/mamba2.py).

conv (+ bias) over the fp32 window, dt and e^{dt A} in shared memory -> B . C per token -> the
group's state rows through registers in row tiles (read once, written once, all T tokens applied
in between, no barrier per token) -> gated group RMSNorm -> bf16 ssm_out. The phases, the thread
mapping and every index are in mamba_index.py (plain arithmetic, emulated on the host by the
tests). Shared memory: a span of `MambaShape.smem()["words"]` fp32 from the start of the carve-up
(KernelSpec.recurrent_smem_bytes). All math in fp32, in the executor's order of operations.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.fields import word
from megakernel.kernel.gdn import silu
from megakernel.kernel.gdn_index import SOFTPLUS_LINEAR
from megakernel.kernel.handler import Handler, Step
from megakernel.kernel.mamba_index import LANES
from megakernel.kernel.memory import join64, ld, prefetch_l2, st
from megakernel.kernel.spec import KernelSpec
from megakernel.kernel.sync import cta_sync


class Mamba2(Handler):
    """The MAMBA_CORE handler of a build (its shapes baked in: KernelSpec.mamba_shape)."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.m = spec.mamba_shape
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier (pipeline.py)
        self.NT, self.NW, self.T = spec.num_threads, spec.num_warps, spec.tokens
        self.eps = spec.eps
        self.sm = self.m.smem()  # word offsets in the scratch span

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
        self.conv(b, j, proj, Int64(conv_w), st0, pW, pF, pS, sS, tidx)
        self.gates(b, j, proj, prm, pF, sS, tidx)
        cta_sync(self.named)
        self.bc(sS, warp, lane)
        cta_sync(self.named)
        self.states(b, j, prm, st0, pF, pS, sS, warp, lane)
        cta_sync(self.named)
        self.output(b, j, proj, Int64(norm_w), rec[word(Op.MAMBA_CORE, "OUT_OFF")], pW, pF, pB,
                    sS, warp, lane)

    # ---- phase 1: conv, gates, B . C ---------------------------------------------------------
    @cute.jit
    def conv(self, b: Int32, j: Int32, proj: Int32, conv_w: Int64, st0: Int64,
             pW: cute.Pointer, pF: cute.Pointer, pS: cute.Pointer, sS: cute.Tensor, tidx: Int32):
        """x[t][c] = silu(sum_k taps[chan, k] u[t + k] + bias[chan]), u = [window | T new
        inputs]; the last K - 1 of u become the window. A thread per channel."""
        m, T, W = self.m, self.T, self.m.win
        for c in cutlass.range(tidx, m.ch, self.NT, unroll=1):
            chan = m.channel(c, j, cutlass.min)
            u = cute.make_rmem_tensor((W + T,), Float32)
            for k in cutlass.range_constexpr(W):
                u[k] = ld(pS, st0 + Int64(m.window(b, chan, k)))
            for t in cutlass.range_constexpr(T):
                u[W + t] = ld(pF, proj + m.proj(b, t, m.x_col(chan)))
            taps = conv_w + Int64(chan * m.conv_k)
            bias = ld(pW, conv_w + Int64(m.conv_dim * m.conv_k + chan)).to(Float32)
            for t in cutlass.range_constexpr(T):
                acc = Float32(0.0)
                for k in cutlass.range_constexpr(m.conv_k):
                    acc = acc + u[t + k] * ld(pW, taps + k).to(Float32)
                sS[self.sm["x"] + t * m.ch + c] = silu(acc + bias)
            for k in cutlass.range_constexpr(W):
                st(pS, st0 + Int64(m.window(b, chan, k)), u[T + k])

    @cute.jit
    def gates(self, b: Int32, j: Int32, proj: Int32, prm: Int32, pF: cute.Pointer,
              sS: cute.Tensor, tidx: Int32):
        """dt[t][r] = softplus(dt + dt_bias), da[t][r] = exp(dt A), A = -exp(A_log), of head
        h = j R + r (params row: A_log [H], D [H], dt_bias [H])."""
        m = self.m
        for idx in cutlass.range(tidx, self.T * m.rep, self.NT, unroll=1):
            t = idx // m.rep
            h = j * m.rep + idx - t * m.rep
            aa = ld(pF, proj + m.proj(b, t, m.dt_col(h))) + ld(pF, prm + 2 * m.heads + h)
            sp = aa
            if aa <= Float32(SOFTPLUS_LINEAR):
                sp = cute.math.log1p(cute.math.exp(aa))
            sS[self.sm["dt"] + idx] = sp
            sS[self.sm["da"] + idx] = cute.math.exp(-cute.math.exp(ld(pF, prm + h)) * sp)

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
    def states(self, b: Int32, j: Int32, prm: Int32, st0: Int64, pF: cute.Pointer,
               pS: cute.Pointer, sS: cute.Tensor, warp: Int32, lane: Int32):
        """Per row tile: S [RPT rows of this thread][CPL columns] in registers for the T tokens:
        y = da (S . C) + (dt bc) x + D x (S . C reduced over the row's LPR lanes), S <- da S +
        x (dt B)."""
        m, T, RPT, CPL = self.m, self.T, self.m.rpt, self.m.cpl
        sm = self.sm
        s_reg = cute.make_rmem_tensor((RPT * CPL,), Float32)
        for it in cutlass.range(m.tiles, unroll=1):
            for k in cutlass.range_constexpr(RPT):
                row = m.row(it, warp, lane, k)
                for c in cutlass.range_constexpr(CPL):
                    s_reg[k * CPL + c] = ld(pS, st0 + Int64(m.state(b, j, row, m.col(lane, c))))
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
                    y = y + ld(pF, prm + m.heads + j * m.rep + r) * xv
                    if lane % m.lpr == 0:
                        sS[sm["y"] + t * m.rows + row] = y
                    for c in cutlass.range_constexpr(CPL):
                        s_reg[k * CPL + c] = da * s_reg[k * CPL + c] + xv * (
                            dt * sS[xt + m.rows + m.col(lane, c)])
            for k in cutlass.range_constexpr(RPT):
                row = m.row(it, warp, lane, k)
                for c in cutlass.range_constexpr(CPL):
                    st(pS, st0 + Int64(m.state(b, j, row, m.col(lane, c))), s_reg[k * CPL + c])

    # ---- phase 3: gated group RMSNorm -> bf16 --------------------------------------------------
    @cute.jit
    def output(self, b: Int32, j: Int32, proj: Int32, norm_w: Int64, out: Int32,
               pW: cute.Pointer, pF: cute.Pointer, pB: cute.Pointer, sS: cute.Tensor,
               warp: Int32, lane: Int32):
        """ssm_out[b T + t, j R P + c] = bf16(g rsqrt(mean(g^2) + eps) w[j R P + c]), g = y
        silu(z) over the group's R P columns: one warp per token (g kept in place of y)."""
        m = self.m
        for t in cutlass.range(warp, self.T, self.NW, unroll=1):
            base = self.sm["y"] + t * m.rows
            ss = Float32(0.0)
            for c in cutlass.range(lane, m.rows, LANES, unroll=1):
                g = sS[base + c] * silu(ld(pF, proj + m.proj(b, t, m.z_col(j, c))))
                sS[base + c] = g
                ss = ss + g * g
            ss = cute.arch.warp_reduction_sum(ss)
            rstd = Float32(1.0) / cute.math.sqrt(ss / Float32(m.rows) + Float32(self.eps))
            w0 = norm_w + Int64(j * m.rows)
            for c in cutlass.range(lane, m.rows, LANES, unroll=1):
                y = sS[base + c] * rstd * ld(pW, w0 + c).to(Float32)
                st(pB, out + m.out(b, t, j, c), y.to(BFloat16))

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
