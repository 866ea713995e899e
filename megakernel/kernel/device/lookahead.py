"""The L2 lookahead of the global-memory build: bulk L2 prefetches of this CTA's coming weight
slabs (device code).

When the CTA reaches a record, before its dependency wait, the consumer threads extend the
lookahead to `window` bytes past the start of that record's slab (megakernel.py); the rest of a
slab larger than the window is left to the demand loads. (The pipelined build's loader warp runs
its own lookahead over its tile sequence: pipeline.py `prefetch_tiles`.) spec.lookahead_plan is
the host mirror.

State: (pf_pc, pf_off, pf_cum) = slab pf_pc is requested up to byte pf_off, and pf_cum is that
point as an offset in the CTA's stream of slabs. Each byte is requested once, in 16 KiB
cp.async.bulk.prefetch.L2 requests shared out over the calling threads.

An FP8 slab (spec.fp8_ops) is NROWS * K bytes from byte 2W, the same stream offsets in bytes;
when the walk enters one it also asks for the slab's scale run (`prefetch_scales`).

An expert record (EXPERT_GATEUP / EXPERT_DOWN) is bound to its slot's expert only once its
dependency wait is met, after the lookahead has run: the lookahead stops at one and leaves its
slab to the demand loads (moe.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.config.fields import OpTable, common, mv, one_of, slab_word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.memory import join64, record_word
from megakernel.kernel.device.moe import Experts
from megakernel.kernel.host.fp8_index import scale_chunks, scale_run
from megakernel.kernel.host.limits import PREFETCH_CHUNK


class Lookahead:
    """The global-memory build's L2 lookahead over this CTA's queue (module docstring)."""

    def __init__(self, spec: KernelSpec):
        self.ops = OpTable.for_spec(spec)
        self.window = spec.prefetch_window
        self.moe = Experts(spec)
        self.fp8_ops, self.fp8_chunk = spec.fp8_ops, spec.fp8_chunk

    @cute.jit
    def slab_bytes(self, rop: Int32, nrows: Int32, k: Int32) -> Int64:
        """Weight bytes of a record: NROWS * K * (2, or 1 for an FP8 slab) for the slab opcodes
        this build handles (the registry's `slab` property), else 0."""
        nbytes = Int64(0)
        if one_of(rop, self.ops.slab):
            # NROWS * K * 2 can pass 2^31 (an LM head on few SMs): 64-bit
            nbytes = Int64(nrows) * Int64(k) * Int64(slab_wbytes(rop, self.fp8_ops))
        return nbytes

    @cute.jit
    def extend(self, weights: cute.Pointer, queue: cute.Pointer, pc: Int32, cum: Int64,
               pf_pc: Int32, pf_off: Int64, pf_cum: Int64, tid: Int32, nthreads: int):
        """Request every not yet requested byte of slabs pc, pc+1, ... below `cum + window`
        (`cum`: stream offset of slab pc's start). Returns the new (pf_pc, pf_off, pf_cum); every
        calling thread runs the same walk and issues its share of the requests (thread `tid` of
        `nthreads`). Returns without waiting."""
        if pf_pc < pc:  # the demand loads of earlier slabs overtook the lookahead
            pf_pc = pc
            pf_off = Int64(0)
            pf_cum = cum
        limit = cum + Int64(self.window)
        more = pf_cum < limit
        while more:
            rop = record_word(queue, pf_pc, common("OPCODE"))
            nbytes = self.slab_bytes(rop, record_word(queue, pf_pc, slab_word("NROWS")),
                                     record_word(queue, pf_pc, slab_word("K")))
            stop = rop == Op.END
            if cutlass.const_expr(self.moe.on):
                if one_of(rop, self.moe.codes):  # not bound yet: stop here
                    stop = one_of(rop, self.moe.codes)
                    limit = pf_cum
                    nbytes = Int64(0)
            take = cutlass.min(nbytes - pf_off, limit - pf_cum)
            if take > Int64(0):
                w_base = join64(record_word(queue, pf_pc, slab_word("W_LO")),
                                record_word(queue, pf_pc, slab_word("W_HI")))
                if cutlass.const_expr(len(self.fp8_ops) > 0):  # entering an FP8 slab
                    if pf_off == Int64(0):
                        prefetch_scales(weights, rop, self.fp8_ops, self.fp8_chunk, w_base,
                                        record_word(queue, pf_pc, mv("ROW0")),
                                        record_word(queue, pf_pc, slab_word("NROWS")),
                                        record_word(queue, pf_pc, slab_word("K")), tid, nthreads)
                addr0 = weights.toint() + w_base * Int64(2) + pf_off  # byte 2W: bf16 and FP8
                n32 = take.to(Int32)  # <= window
                for off in cutlass.range(tid * PREFETCH_CHUNK, n32, nthreads * PREFETCH_CHUNK):
                    size = cutlass.min(Int32(PREFETCH_CHUNK), n32 - off)
                    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                                         read_only_args=[addr0 + Int64(off), size])
                pf_off = pf_off + take
                pf_cum = pf_cum + take
            if pf_off >= nbytes:  # this record's slab is requested (or it has none): next
                if stop:
                    limit = pf_cum  # the queue ends here, or an expert record: stop
                else:
                    pf_pc = pf_pc + 1
                    pf_off = Int64(0)
            more = pf_cum < limit
        return pf_pc, pf_off, pf_cum


@cute.jit
def slab_wbytes(op: Int32, fp8_ops: tuple) -> Int32:
    """Bytes per weight of opcode `op`'s slab: 1 for the build's FP8 opcodes (spec.fp8_ops),
    else 2 (spec.weight_bytes)."""
    wb = Int32(2)
    if cutlass.const_expr(len(fp8_ops) > 0):
        if one_of(op, fp8_ops):
            wb = Int32(1)
    return wb


@cute.jit
def prefetch_scales(weights: cute.Pointer, op: Int32, fp8_ops: tuple, chunk: int, w: Int64,
                    row0: Int32, nrows: Int32, k: Int32, tid: Int32, nthreads: int):
    """Ask L2 for the scales of an FP8 slab's rows (fp8_index.scale_run: one contiguous run, C
    fp32 per row), in PREFETCH_CHUNK requests shared out over the calling threads; nothing for a
    bf16 slab or a run that is not 16-byte aligned (the demand loads fetch it)."""
    if one_of(op, fp8_ops):
        first, nbytes = scale_run(w, Int64(row0), Int64(nrows), Int64(k),
                                  Int64(scale_chunks(k, chunk)))
        addr = weights.toint() + first
        if addr % Int64(16) == Int64(0):
            n32 = nbytes.to(Int32)
            for off in cutlass.range(tid * PREFETCH_CHUNK, n32, nthreads * PREFETCH_CHUNK):
                size = cutlass.min(Int32(PREFETCH_CHUNK), n32 - off)
                cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                                     read_only_args=[addr + Int64(off), size])
