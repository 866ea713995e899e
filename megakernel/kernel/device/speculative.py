"""NGRAM: the device n-gram drafter (layers/speculative.py; reference/speculative.ngram_propose).

One record proposes the next step's k drafts of sequences [B0, B1), one sequence at a time on
the CTA: every thread scans its candidate positions of the sequence's history (the suffix it
is compared with held in registers), keeps the largest key (match length, position), the warps'
maxima meet in shared memory and every thread takes the CTA's; threads i < k write the drafts.
Thread mapping and keys: speculative_index.py (NgramShape), emulated on the host by
tests/kernel/test_kernel_speculative.py. ACCEPT, which this record waits on, runs in the
persistent loop (megakernel.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from megakernel.isa import Op
from megakernel.kernel.config.fields import word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.handler import Handler, Step
from megakernel.kernel.device.memory import ld, st
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.speculative_index import NgramShape


@cute.jit
def warp_max(key: Int32) -> Int32:
    """The warp's largest key (every lane gets it)."""
    for m in cutlass.range_constexpr(5):
        other = cute.arch.shuffle_sync_bfly(key, offset=1 << m)
        if other > key:
            key = other
    return key


class NgramDrafter(Handler):
    """The NGRAM handler of a speculative build with the device drafter (KernelSpec.ngram)."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.g = NgramShape.for_spec(spec)
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier (pipeline.py)
        self.NT, self.NW, self.T = spec.num_threads, spec.num_warps, spec.tokens

    @cute.jit
    def run(self, op: Int32, s: Step):
        g = self.g
        rec = s.rec
        b0, b1 = rec[word(Op.NGRAM, "B0")], rec[word(Op.NGRAM, "B1")]
        n_max = rec[word(Op.NGRAM, "N_MAX")]
        tok, lens, hist = (rec[word(Op.NGRAM, "TOK_OFF")], rec[word(Op.NGRAM, "LEN_OFF")],
                           rec[word(Op.NGRAM, "HIST_OFF")])
        # the warps' maxima, two buffers [2][NW] (sML's words, free during this record)
        sPart = cute.make_tensor(cute.recast_ptr(s.sML.iterator, dtype=Int32),
                                 cute.make_layout(2 * self.NW))
        for b in cutlass.range(b0, b1, unroll=1):
            buf = (b - b0) % 2
            m = ld(s.i32, lens + b) + 1  # history tokens, the bonus last
            row = hist + b * s.s_max
            key = self.scan(s.i32, row, m, n_max, s.tidx)
            key = warp_max(key)
            if s.lane == 0:
                sPart[g.part(buf, s.warp)] = key
            cta_sync(self.named)  # every warp's maximum (the other buffer is the next one's)
            best = Int32(0)
            for w in cutlass.range_constexpr(self.NW):
                v = sPart[g.part(buf, w)]
                if v > best:
                    best = v
            matched, p = g.source(best, m)
            if not matched:
                p = m - 1
            for i in cutlass.range(s.tidx, g.drafts, self.NT, unroll=1):
                st(s.i32, tok + g.tokens_row(b, self.T, i), ld(s.i32, row + g.draft(p, m, i)))

    @cute.jit
    def scan(self, pI: cute.Pointer, row: Int32, m: Int32, n_max: Int32, tidx: Int32) -> Int32:
        """This thread's largest key over its candidate positions p (0: none matched)."""
        g, N = self.g, self.g.n_max
        suffix = cute.make_rmem_tensor((N,), Int32)  # h[m - 1 - i], i < N
        for i in cutlass.range_constexpr(N):
            _, at = g.compare(Int32(0), m, i)
            suffix[i] = ld(pI, row + cutlass.max(at, Int32(0)))
        key = Int32(0)
        first, stop, step = g.candidates(tidx, m)
        for p in cutlass.range(first, stop, step, unroll=1):
            limit = g.limit(p, n_max, cutlass.min)
            length = Int32(0)
            alive = Int32(1)
            for i in cutlass.range_constexpr(N):
                if i < limit:
                    at, _ = g.compare(p, m, i)
                    if ld(pI, row + at) != suffix[i]:
                        alive = Int32(0)
                    length = length + alive
            k = g.key(length, p, m)
            if k > key:
                key = k
        return key

