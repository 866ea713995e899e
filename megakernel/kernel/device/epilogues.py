"""The frame's and the feed-forward kinds' matvec epilogues (epilogue.py's interface), named by
their opcodes' declarations (OpSpec.matvec): the residual add of every output projection, a
recurrent or MLA layer's fp32 input projection, SwiGLU's silu(gate) * up, relu^2, and the LM
head's logits with its running argmax. Each reads a row chunk's results through the matvec's
`acc_value` (the K-slices summed in order); rows of activations past N are skipped.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from megakernel.isa import Op
from megakernel.kernel.config.fields import word
from megakernel.kernel.device.epilogue import Chunk, Epilogue
from megakernel.kernel.device.memory import ld, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.dense_index import lm_row_live, row_major
from megakernel.kernel.host.limits import LANES

F32_NEG_INF = -math.inf


class Residual(Epilogue):
    """OPROJ, DOWN: h[n, row0 + rc0 + r] += acc (fp32)."""

    @cute.jit
    def run(self, op: Int32, c: Chunk):
        for idx in cutlass.range(c.tidx, self.mv.NO * c.nr, self.mv.NT):
            nn = idx // c.nr
            r = idx - nn * c.nr
            if c.n0 + nn < self.mv.N:
                a = c.out_off + (c.n0 + nn) * self.mv.H + c.row0 + c.rc0 + r
                st(c.f32, a, ld(c.f32, a) + self.mv.acc_value(c.sAcc, nn, r, c.ksplit, c.nrp))


class Proj(Epilogue):
    """PROJ: proj[n, row0 + rc0 + r] = acc (fp32, not rounded), rows OUT_W apart: the fused input
    projection the recurrent core and MLA records read."""

    @cute.jit
    def run(self, op: Int32, c: Chunk):
        rec = c.rec
        width = rec[word(Op.PROJ, "OUT_W")]
        for idx in cutlass.range(c.tidx, self.mv.NO * c.nr, self.mv.NT):
            nn = idx // c.nr
            r = idx - nn * c.nr
            if c.n0 + nn < self.mv.N:
                st(c.f32, c.out_off + row_major(c.n0 + nn, c.row0 + c.rc0 + r, width),
                   self.mv.acc_value(c.sAcc, nn, r, c.ksplit, c.nrp))


class GateUp(Epilogue):
    """GATEUP: act[n, (row0 + rc0) / 2 + c] = bf16(silu(gate) * up); rows alternate
    GATEUP_BLOCK gate rows and GATEUP_BLOCK up rows (Matvec.swiglu)."""

    @cute.jit
    def run(self, op: Int32, c: Chunk):
        cols = c.nr // 2
        for idx in cutlass.range(c.tidx, self.mv.NO * cols, self.mv.NT):
            nn = idx // cols
            col = idx - nn * cols
            if c.n0 + nn < self.mv.N:
                a = c.out_off + (c.n0 + nn) * self.mv.I + (c.row0 + c.rc0) // 2 + col
                st(c.bf16, a, self.mv.swiglu(c.sAcc, nn, col, c.ksplit, c.nrp).to(BFloat16))


class Relu2(Epilogue):
    """UP_RELU2: act[n, row0 + rc0 + r] = bf16(relu(acc)^2) (the slab's rows are the
    activation's columns), relu and the square in fp32."""

    @cute.jit
    def run(self, op: Int32, c: Chunk):
        for idx in cutlass.range(c.tidx, self.mv.NO * c.nr, self.mv.NT):
            nn = idx // c.nr
            r = idx - nn * c.nr
            if c.n0 + nn < self.mv.N:
                y = cutlass.max(self.mv.acc_value(c.sAcc, nn, r, c.ksplit, c.nrp), Float32(0.0))
                st(c.bf16, c.out_off + row_major(c.n0 + nn, c.row0 + c.rc0 + r, self.mv.I),
                   (y * y).to(BFloat16))


class LMHead(Epilogue):
    """LMHEAD: logits[n, row0 + rc0 + r] = acc and a running (max, lowest index) per activation
    row in sBest over the pass's chunks, stored as this slab's partial argmax (slot TILE) at the
    end of the pass. Only rows < V (lm_row_live): the head's padding rows store nothing (the
    logits are [N, V]) and never take part in the argmax."""

    @cute.jit
    def begin_pass(self, op: Int32, c: Chunk):
        sBest = c.sBest  # stored through a local: the tracer rebinds what a region assigns
        for nn in cutlass.range(c.tidx, self.mv.NO, self.mv.NT):
            sBest[2 * nn] = Float32(F32_NEG_INF)
            sBest[2 * nn + 1] = c.row0.to(Float32)

    @cute.jit
    def run(self, op: Int32, c: Chunk):
        sBest = c.sBest  # stored through a local: the tracer rebinds what a region assigns
        for idx in cutlass.range(c.tidx, self.mv.NO * c.nr, self.mv.NT):
            nn = idx // c.nr
            r = idx - nn * c.nr
            row = c.row0 + c.rc0 + r
            if (c.n0 + nn < self.mv.N) & lm_row_live(row, self.mv.V):
                st(c.f32, c.out_off + (c.n0 + nn) * self.mv.V + row,
                   self.mv.acc_value(c.sAcc, nn, r, c.ksplit, c.nrp))
        for nn in cutlass.range(c.warp, self.mv.NO, self.mv.NW):
            if c.n0 + nn < self.mv.N:
                best = Float32(F32_NEG_INF)
                bidx = Int32(c.row0 + c.rc0)
                for r in cutlass.range(c.lane, c.nr, LANES):
                    if lm_row_live(c.row0 + c.rc0 + r, self.mv.V):
                        v = self.mv.acc_value(c.sAcc, nn, r, c.ksplit, c.nrp)
                        if v > best:  # rows ascend per lane: strict > keeps the lowest index
                            best = v
                            bidx = c.row0 + c.rc0 + r
                best, bidx = warp_argmax(best, bidx)
                if c.lane == 0:
                    prev = sBest[2 * nn]
                    if best > prev:  # earlier chunks hold lower indices: ties keep them
                        sBest[2 * nn] = best
                        sBest[2 * nn + 1] = bidx.to(Float32)

    @cute.jit
    def end_pass(self, op: Int32, c: Chunk):
        """This CTA's (max logit, index) per row into the partial-argmax buffer."""
        tile, parg = c.rec[word(Op.LMHEAD, "TILE")], c.rec[word(Op.LMHEAD, "PARG_OFF")]
        cta_sync(self.mv.named)
        for nn in cutlass.range(c.tidx, self.mv.NO, self.mv.NT):
            if c.n0 + nn < self.mv.N:
                slot = (tile * self.mv.N + c.n0 + nn) * 2
                st(c.f32, parg + slot, c.sBest[2 * nn])
                st(c.f32, parg + slot + 1, c.sBest[2 * nn + 1])


@cute.jit
def warp_argmax(v: Float32, i: Int32):
    """(max value, lowest index holding it) across the warp; every lane gets the result."""
    for m in cutlass.range_constexpr(5):
        ov = cute.arch.shuffle_sync_bfly(v, offset=1 << m)
        oi = cute.arch.shuffle_sync_bfly(i, offset=1 << m)
        take = (ov > v) | ((ov == v) & (oi < i))
        if take:
            v = ov
            i = oi
    return v, i
