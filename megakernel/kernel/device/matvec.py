"""The matvec handler: one parametrised GEMV (FMA or mma.sync) with fused prologues and epilogues.

One instruction = a slab of NROWS weight rows [K] streamed once per pass over the activation rows.
Loop nest (per CTA):

    for n0 in 0..N step NO                      activation rows staged at a time
        prologue: RMSNorm statistics of h[n0:n0+NO] (norm opcodes)
        for rc0 in 0..NROWS step RC               row chunk: results of RC rows in smem
            for kc0 in 0..K step KC               input chunk: x[NO, KC] bf16 in smem
                stage x (RMSNorm(h) * w -> bf16, or a copy of a bf16 input)
                GEMV: warp = R rows (x K-slice), lane = 8 consecutive inputs (16-byte loads),
                      fp32 FMA, warp-shuffle sum, += into sAcc[ks][n][row]
            epilogue (the class the opcode's declaration names, OpSpec.matvec; epilogue.py):
                  residual add | silu(gate) * up | (+ bias) qk-norm + RoPE + q / KV cache |
                  logits of rows < V + running argmax | ...

When a chunk has fewer row groups than warps, warps also split K (ks) and the epilogue sums the
K-slices in a fixed order, so results do not depend on timing. Rows of activations beyond N are
staged as zeros and skipped by the epilogues.

`run` reads the weights from global memory (16-byte loads); `run_piped` (spec.smem_stages >= 2)
reads them from the loader warp's shared-memory ring (pipeline.py) in tiles of whole rows of one
K-chunk, with the same loop nest, staging and epilogues. With spec.mma (B*T >= 8) `run_piped`
computes each tile on tensor cores (mma_tile: mma.sync m16n8k16, the staged activations as A, the
tile's 8 weight rows as B, K split over the warps) and sums the warps' partials in warp order
(mma_reduce); below that, the FMA GEMV (gemv_tile).

FP8 slabs (spec.fp8_ops, docs/FP8.md "Kernel"; index arithmetic in fp8_index.py): a lane's 8
inputs are 8 e4m3 codes (one 8-byte load, from the ring stage or global memory) converted in
registers by the hardware (cvt.rn.f16x2.e4m3x2, memory.e4m3x8_f32) to fp32 for the FMA form, or
repacked as the mma's bf16 B pairs (memory.e4m3x4_bf16x2; exact). Scales come from global memory
(L1; the lookahead put them in L2): channel granularity multiplies a row's finished fp32 partial
(after the warp sum, or the mma's warp-order sum) by its scale; block granularity multiplies each
lane's 8-input partial by its chunk's scale (FMA), or accumulates each warp's mma K-slice per
128-input chunk and adds chunk * scale (a warp's slice starts on a chunk boundary,
fp8_index.mma_warp_steps). In a build whose LM head stays bf16 both forms are compiled in and the
opcode picks one.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from megakernel import isa
from megakernel.isa import Op
from megakernel.kernel.config.fields import OpTable, mv, one_of, word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.epilogue import Chunk, epilogues_for
from megakernel.kernel.device.memory import (
    e4m3x4_bf16x2,
    e4m3x8_f32,
    fp8_atom,
    join64,
    ld_f32_at,
    load_bf16x8,
    load_f32x8,
    load_fp8_words,
    load_smem_bf16x8,
    load_smem_words2,
    load_smem_words4,
    load_weights8,
    smem_words,
    store_smem_bf16x8,
    weight_atom,
)
from megakernel.kernel.device.moe import Experts
from megakernel.kernel.device.pipeline import Pipeline
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.dense_index import (
    acc_index,
    chunk_ksplit,
    k_slice,
    mma_c_coord,
    mma_operand_word,
    mma_red_index,
    ring_slot,
    row_major,
    tile_warp,
)
from megakernel.kernel.host.fp8_index import (
    CHUNK_STEPS,
    SCALE_BYTES,
    fp8_operand_byte,
    mma_warp_steps,
    scale_byte,
    scale_chunk_of,
    scale_chunks,
    slab_byte,
)
from megakernel.kernel.host.limits import LANES, MMA_K_ALIGN, MMA_M, MMA_N, SMEM_STAGE_BYTES, VEC


class Matvec:
    """The matvec opcodes (QKV, OPROJ, GATEUP, UP_RELU2, DOWN, PROJ, LMHEAD, the experts'): one
    GEMV, then the epilogue class the opcode's declaration names (OpSpec.matvec; only those of
    opcodes the build handles are compiled in)."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.ops = OpTable.for_spec(spec)
        self.N, self.T, self.B = spec.rows, spec.tokens, spec.batch
        self.NO, self.NB, self.R = spec.no, spec.nb, spec.rows_per_group
        self.KC, self.RC = spec.k_chunk, spec.row_chunk
        self.XS = spec.x_stride  # elements between staged activation rows in sX
        self.NT, self.NW = spec.num_threads, spec.num_warps
        self.H, self.I, self.V, self.D = spec.hidden, spec.inter, spec.vocab, spec.head_dim
        self.Hq, self.Hkv, self.G = spec.heads, spec.kv_heads, spec.group
        self.eps = spec.eps
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier (pipeline.py)
        self.pipe = Pipeline(spec) if spec.pipelined else None
        self.moe = Experts(spec)  # the expert records' run-time binding (moe.py)
        # the handled opcodes' epilogue classes (OpSpec.matvec), one instance each
        self.epilogues = epilogues_for(self, self.ops.handled)
        # FP8 slabs (fp8_index.py): the opcodes that read them, whether every matvec of the
        # build does (one GEMV form compiled in) or some (both, picked by opcode)
        self.fp8_ops, self.fp8_chunk = spec.fp8_ops, spec.fp8_chunk
        self.fp8_any = bool(self.fp8_ops)
        self.fp8_all = self.fp8_any and all(op in self.fp8_ops for op in self.ops.slab)

    # ---- entry --------------------------------------------------------------------------------
    @cute.jit
    def run(self, op: Int32, rec: cute.Tensor, layer: Int32, pW: cute.Pointer, pF: cute.Pointer,
            pB: cute.Pointer, pI: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, s_max: Int32,
            len_off: Int32, sX: cute.Tensor, sAcc: cute.Tensor, sRstd: cute.Tensor,
            sBest: cute.Tensor, tidx: Int32, warp: Int32, lane: Int32):
        w_base = join64(rec[mv("W_LO")], rec[mv("W_HI")])  # slab's first element in the arena
        row0, nrows, k = rec[mv("ROW0")], rec[mv("NROWS")], rec[mv("K")]
        norm_off, in_off, out_off = rec[mv("NORM_OFF")], rec[mv("IN_OFF")], rec[mv("OUT_OFF")]
        w_base, slot, work_off, live = self.bind(op, rec, w_base, pI)
        for n0 in cutlass.range(0, live, self.NO):
            self.pass_prologue(op, norm_off, in_off, k, n0, pF, pI, slot, work_off, live, sRstd,
                               warp, lane)
            self.begin_pass(op, self.chunk(rec, layer, row0, n0, out_off, pW, pF, pB, pI, pK, pV,
                                           s_max, len_off, slot, work_off, live, sAcc, sBest,
                                           tidx, warp, lane))
            for rc0 in cutlass.range(0, nrows, self.RC):
                nr = cutlass.min(Int32(self.RC), nrows - rc0)
                ng = nr // self.R
                ksplit = chunk_ksplit(ng, self.NW, cutlass.max)
                nrp = ng * self.R
                cta_sync(self.named)  # previous epilogue done with sAcc
                for i in cutlass.range(tidx, ksplit * self.NO * nrp, self.NT):
                    sAcc[i] = Float32(0.0)
                for kc0 in cutlass.range(0, k, self.KC):
                    kc = cutlass.min(Int32(self.KC), k - kc0)
                    cta_sync(self.named)  # sX free, sAcc zeroed
                    self.stage_x(op, pW, pF, pB, pI, slot, work_off, live, norm_off, in_off,
                                 k, n0, kc0, kc, sX, sRstd, tidx)
                    cta_sync(self.named)
                    self.gemv_any(op, pW, w_base, row0, k, rc0, kc0, kc, ng, ksplit, nrp, sX,
                                  sAcc, warp, lane)
                cta_sync(self.named)
                self.epilogue(op, self.chunk(rec, layer, row0, n0, out_off, pW, pF, pB, pI, pK,
                                             pV, s_max, len_off, slot, work_off, live, sAcc,
                                             sBest, tidx, warp, lane, rc0, nr, ksplit, nrp))
            self.end_pass(op, self.chunk(rec, layer, row0, n0, out_off, pW, pF, pB, pI, pK, pV,
                                         s_max, len_off, slot, work_off, live, sAcc, sBest,
                                         tidx, warp, lane))
            cta_sync(self.named)

    @cute.jit
    def run_piped(self, op: Int32, rec: cute.Tensor, layer: Int32, pW: cute.Pointer,
                  pF: cute.Pointer, pB: cute.Pointer, pI: cute.Pointer, pK: cute.Pointer,
                  pV: cute.Pointer, s_max: Int32, len_off: Int32, sX: cute.Tensor,
                  sAcc: cute.Tensor, sRstd: cute.Tensor, sBest: cute.Tensor, sRing: cute.Tensor,
                  sRed: cute.Tensor, mbar: cute.Pointer, j: Int32, tidx: Int32, warp: Int32,
                  lane: Int32) -> Int32:
        """`run` with the weights from the shared-memory ring (spec.smem_stages >= 2).

        Same loop nest, prologue, x staging and epilogues; inside a (row chunk, K-chunk) the
        rows come as the loader's tiles of `tr` rows (spec.matvec_tiles); j counts the tiles this
        CTA consumed and is returned advanced. Accumulation order per output row: per K-chunk,
        the chunk is cut into NW / tr contiguous K-slices (one warp each), a lane sums its
        strided 16-byte vectors in order, the warp sums lanes by butterfly and adds the result
        to sAcc[slice] (K-chunks in order); the epilogue adds the slices in order. The
        global-memory path has the same structure with NW / (row groups of the chunk) slices
        (one for full chunks), so the two differ in where K is cut, not in rounding points.

        With spec.mma the tile (8 rows) is one mma N block: the warps split the tile's K, each
        accumulates its slice on tensor cores (mma_tile), and the slices are summed in warp order
        into sAcc (mma_reduce); fp32 accumulation, bf16 operands, as the FMA path."""
        row0, nrows, k = rec[mv("ROW0")], rec[mv("NROWS")], rec[mv("K")]
        norm_off, in_off, out_off = rec[mv("NORM_OFF")], rec[mv("IN_OFF")], rec[mv("OUT_OFF")]
        wb = self.pipe.weight_bytes(op)
        tr = self.pipe.tile_rows(cutlass.min(Int32(self.KC), k), wb)
        ksplit = self.NW // tr
        # the loader binds the same record to the same slab and passes (moe.py); the consumers
        # read the bound W only for an FP8 slab's scales
        w_base = Int64(0)
        if cutlass.const_expr(self.fp8_any):
            w_base = join64(rec[mv("W_LO")], rec[mv("W_HI")])
        w_base, slot, work_off, live = self.bind(op, rec, w_base, pI)
        for n0 in cutlass.range(0, live, self.NO):
            self.pass_prologue(op, norm_off, in_off, k, n0, pF, pI, slot, work_off, live, sRstd,
                               warp, lane)
            self.begin_pass(op, self.chunk(rec, layer, row0, n0, out_off, pW, pF, pB, pI, pK, pV,
                                           s_max, len_off, slot, work_off, live, sAcc, sBest,
                                           tidx, warp, lane))
            for rc0 in cutlass.range(0, nrows, self.RC):
                nr = cutlass.min(Int32(self.RC), nrows - rc0)
                cta_sync(self.named)  # previous epilogue done with sAcc
                for i in cutlass.range(tidx, ksplit * self.NO * nr, self.NT):
                    sAcc[i] = Float32(0.0)
                for kc0 in cutlass.range(0, k, self.KC):
                    kc = cutlass.min(Int32(self.KC), k - kc0)
                    cta_sync(self.named)  # sX free, sAcc zeroed
                    self.stage_x(op, pW, pF, pB, pI, slot, work_off, live, norm_off, in_off,
                                 k, n0, kc0, kc, sX, sRstd, tidx)
                    cta_sync(self.named)
                    for t0 in cutlass.range(0, nr, tr):
                        self.pipe.wait_full(mbar, j)
                        s, _, _ = ring_slot(j, self.pipe.S)
                        rows = cutlass.min(tr, nr - t0)
                        buf = j & 1  # mma: consecutive tiles alternate partial buffers
                        sc = self.scale_addr(pW, w_base, row0, k, rc0 + t0)  # FP8: row t0's
                        self.tile_any(op, sRing, s, kc, kc0, rows, t0, ksplit, nr, sX, sAcc, sRed,
                                      buf, sc, k, warp, lane)
                        self.pipe.release(mbar, j, lane)
                        if cutlass.const_expr(self.spec.mma):
                            cta_sync(self.named)  # every warp's partials of this tile
                            self.reduce_any(op, sRed, buf, rows, t0, nr, sAcc, sc, k, tidx)
                        j += 1
                cta_sync(self.named)
                self.epilogue(op, self.chunk(rec, layer, row0, n0, out_off, pW, pF, pB, pI, pK,
                                             pV, s_max, len_off, slot, work_off, live, sAcc,
                                             sBest, tidx, warp, lane, rc0, nr, ksplit, nr))
            self.end_pass(op, self.chunk(rec, layer, row0, n0, out_off, pW, pF, pB, pI, pK, pV,
                                         s_max, len_off, slot, work_off, live, sAcc, sBest,
                                         tidx, warp, lane))
            cta_sync(self.named)
        return j

    @cute.jit
    def pass_prologue(self, op: Int32, norm_off: Int32, in_off: Int32, k: Int32, n0: Int32,
                      pF: cute.Pointer, pI: cute.Pointer, slot: Int32, work_off: Int32,
                      live: Int32, sRstd: cute.Tensor, warp: Int32, lane: Int32):
        """Start of a pass over activation rows n0 .. n0 + NO (both weight paths): the RMSNorm
        statistics (norm opcodes)."""
        if norm_off >= 0:
            self.row_rstd(op, pF, pI, slot, work_off, live, in_off, k, n0, sRstd, warp, lane)

    # ---- the epilogues (epilogue.py; by the opcode's declaration) -----------------------------
    def chunk(self, rec, layer, row0, n0, out_off, pW, pF, pB, pI, pK, pV, s_max,  # noqa: ANN001, ANN201
              len_off, slot, work_off, live, sAcc, sBest, tidx, warp, lane,  # noqa: ANN001
              rc0=None, nr=None, ksplit=None, nrp=None):  # noqa: ANN001
        """The Chunk an epilogue gets (the chunk fields 0 at a pass hook)."""
        z = Int32(0)
        return Chunk(rec, layer, row0, z if rc0 is None else rc0, z if nr is None else nr, n0,
                     z if ksplit is None else ksplit, z if nrp is None else nrp, out_off, pW, pF,
                     pB, pI, pK, pV, s_max, len_off, slot, work_off, live, sAcc, sBest, tidx,
                     warp, lane)

    @cute.jit
    def epilogue(self, op: Int32, c: Chunk):
        """The chunk's epilogue: the one of `op`'s class (only the handled ones are compiled in;
        exactly one matches a matvec opcode)."""
        for e in self.epilogues:
            if one_of(op, e.ops):
                e.run(op, c)

    @cute.jit
    def begin_pass(self, op: Int32, c: Chunk):
        self.pass_hook(op, c, "begin_pass")

    @cute.jit
    def end_pass(self, op: Int32, c: Chunk):
        self.pass_hook(op, c, "end_pass")

    @cute.jit
    def pass_hook(self, op: Int32, c: Chunk, hook: str):
        """The epilogues' pass hook `hook` (only those that have one are compiled in)."""
        for e in self.epilogues:
            if cutlass.const_expr(e.has(hook)):
                if one_of(op, e.ops):
                    getattr(e, hook)(op, c)

    # ---- the weight format's dispatch (fp8_index.py) -----------------------------------------
    @cute.jit
    def scale_addr(self, pW: cute.Pointer, w_base: Int64, row0: Int32, k: Int32,
                   row: Int32) -> Int64:
        """Global byte address of slab row `row`'s first scale (fp8_index.scale_byte; row
        row + r's is `scale_stride` bytes lower per r); 0 in a build without FP8 slabs."""
        a = Int64(0)
        if cutlass.const_expr(self.fp8_any):
            c = Int64(scale_chunks(k, self.fp8_chunk))
            a = pW.toint() + scale_byte(w_base, Int64(row0), Int64(k), c, Int64(row), Int64(0))
        return a

    @cute.jit
    def scale_stride(self, k: Int32) -> Int64:
        """Bytes between the scales of consecutive matrix rows: 4 C (rows are reversed)."""
        return Int64(SCALE_BYTES) * Int64(scale_chunks(k, self.fp8_chunk))

    @cute.jit
    def tile_any(self, op: Int32, sRing: cute.Tensor, s: Int32, kc: Int32, kc0: Int32,
                 rows: Int32, t0: Int32, ksplit: Int32, nr: Int32, sX: cute.Tensor,
                 sAcc: cute.Tensor, sRed: cute.Tensor, buf: Int32, sc: Int64, k: Int32,
                 warp: Int32, lane: Int32):
        """One ring tile (stage s) on the build's GEMV form, in the opcode's weight format."""
        if cutlass.const_expr(self.fp8_any and not self.fp8_all):
            if one_of(op, self.fp8_ops):
                self.tile_form(sRing, s, kc, kc0, rows, t0, ksplit, nr, sX, sAcc, sRed, buf, sc,
                               k, warp, lane, True)
            else:
                self.tile_form(sRing, s, kc, kc0, rows, t0, ksplit, nr, sX, sAcc, sRed, buf, sc,
                               k, warp, lane, False)
        else:
            self.tile_form(sRing, s, kc, kc0, rows, t0, ksplit, nr, sX, sAcc, sRed, buf, sc, k,
                           warp, lane, self.fp8_all)

    @cute.jit
    def tile_form(self, sRing: cute.Tensor, s: Int32, kc: Int32, kc0: Int32, rows: Int32,
                  t0: Int32, ksplit: Int32, nr: Int32, sX: cute.Tensor, sAcc: cute.Tensor,
                  sRed: cute.Tensor, buf: Int32, sc: Int64, k: Int32, warp: Int32, lane: Int32,
                  fp8: cutlass.Constexpr[bool]):
        if cutlass.const_expr(self.spec.mma):
            self.mma_tile(smem_words(sRing), s * (self.pipe.stage_elems // 2), kc, rows,
                          smem_words(sX), sRed, buf, warp, lane, fp8, sc, self.scale_stride(k),
                          kc0)
        elif cutlass.const_expr(fp8):
            self.gemv_tile_fp8(smem_words(sRing), s * (SMEM_STAGE_BYTES // 4), kc, kc0, rows, t0,
                               ksplit, nr, sX, sAcc, sc, self.scale_stride(k), warp, lane)
        else:
            self.gemv_tile(sRing, s * self.pipe.stage_elems, kc, rows, t0, ksplit, nr, sX, sAcc,
                           warp, lane)

    @cute.jit
    def reduce_any(self, op: Int32, sRed: cute.Tensor, buf: Int32, rows: Int32, t0: Int32,
                   nrp: Int32, sAcc: cute.Tensor, sc: Int64, k: Int32, tidx: Int32):
        """mma_reduce, with the rows' channel scales for an FP8 slab of channel granularity."""
        if cutlass.const_expr(self.fp8_any and self.fp8_chunk == 0 and not self.fp8_all):
            if one_of(op, self.fp8_ops):
                self.mma_reduce(sRed, buf, rows, t0, nrp, sAcc, tidx, True, sc,
                                self.scale_stride(k))
            else:
                self.mma_reduce(sRed, buf, rows, t0, nrp, sAcc, tidx, False, sc, Int64(0))
        else:
            self.mma_reduce(sRed, buf, rows, t0, nrp, sAcc, tidx,
                            self.fp8_all and self.fp8_chunk == 0, sc, self.scale_stride(k))

    @cute.jit
    def gemv_any(self, op: Int32, pW: cute.Pointer, w_base: Int64, row0: Int32, k: Int32,
                 rc0: Int32, kc0: Int32, kc: Int32, ng: Int32, ksplit: Int32, nrp: Int32,
                 sX: cute.Tensor, sAcc: cute.Tensor, warp: Int32, lane: Int32):
        """The global-memory GEMV in the opcode's weight format."""
        if cutlass.const_expr(self.fp8_any and not self.fp8_all):
            if one_of(op, self.fp8_ops):
                self.gemv_fp8(pW, w_base, row0, k, rc0, kc0, kc, ng, ksplit, nrp, sX, sAcc,
                              warp, lane)
            else:
                self.gemv(pW, w_base, k, rc0, kc0, kc, ng, ksplit, nrp, sX, sAcc, warp, lane)
        elif cutlass.const_expr(self.fp8_all):
            self.gemv_fp8(pW, w_base, row0, k, rc0, kc0, kc, ng, ksplit, nrp, sX, sAcc, warp,
                          lane)
        else:
            self.gemv(pW, w_base, k, rc0, kc0, kc, ng, ksplit, nrp, sX, sAcc, warp, lane)

    @cute.jit
    def gemv_tile_fp8(self, sRingW: cute.Tensor, wbase: Int32, kc: Int32, kc0: Int32,
                      rows: Int32, rowl0: Int32, ksplit: Int32, nrp: Int32, sX: cute.Tensor,
                      sAcc: cute.Tensor, sc: Int64, sstride: Int64, warp: Int32, lane: Int32):
        """gemv_tile for an FP8 tile [rows][kc] of codes at word `wbase` of the ring (as words):
        lane vector v is the 8 codes at byte row_major(r, 8 v, kc) of the stage, converted in
        registers; scales of tile row r at `sc` - r `sstride` (channel: the row's, applied to
        the warp's sum; block: chunk (kc0 + 8 v) / 128's, applied to the vector's partial)."""
        NB = self.NB
        r, ks = tile_warp(warp, ksplit)
        if r < rows:
            vb, ve = k_slice(kc // VEC, ksplit, ks, cutlass.min)
            srow = sc - Int64(r) * sstride
            rs = Float32(1.0)
            if cutlass.const_expr(self.fp8_chunk == 0):
                rs = ld_f32_at(srow)
            for nbk in cutlass.range(self.NO // NB):
                acc = cute.make_rmem_tensor((NB,), Float32)
                acc.fill(0.0)
                for v in cutlass.range(vb + lane, ve, LANES, unroll=2):
                    wq = cute.make_rmem_tensor((2,), Int32)
                    load_smem_words2(sRingW, wbase + row_major(r, v * VEC, kc) // 4, wq)
                    wv = e4m3x8_f32(wq)
                    if cutlass.const_expr(self.fp8_chunk == 0):
                        for jj in cutlass.range_constexpr(NB):
                            xv = load_smem_bf16x8(sX, row_major(nbk * NB + jj, v * VEC, self.XS))
                            acc[jj] = (wv * xv).reduce(cute.ReductionOp.ADD, acc[jj], 0)
                    else:
                        sv = ld_f32_at(srow + Int64(SCALE_BYTES * scale_chunk_of(
                            kc0 + v * VEC, self.fp8_chunk)))
                        for jj in cutlass.range_constexpr(NB):
                            xv = load_smem_bf16x8(sX, row_major(nbk * NB + jj, v * VEC, self.XS))
                            acc[jj] = acc[jj] + sv * (wv * xv).reduce(cute.ReductionOp.ADD,
                                                                      Float32(0.0), 0)
                for jj in cutlass.range_constexpr(NB):
                    acc[jj] = cute.arch.warp_reduction_sum(acc[jj])
                if lane == 0:
                    for jj in cutlass.range_constexpr(NB):
                        a = acc_index(ks, nbk * NB + jj, rowl0, self.NO, nrp) + r
                        sAcc[a] = sAcc[a] + acc[jj] * rs

    @cute.jit
    def gemv_tile(self, sRing: cute.Tensor, sbase: Int32, kc: Int32, rows: Int32, rowl0: Int32,
                  ksplit: Int32, nrp: Int32, sX: cute.Tensor, sAcc: cute.Tensor, warp: Int32,
                  lane: Int32):
        """sAcc[ks, n, rowl0 + r] += W_tile[r, slice(ks)] . x[n, slice(ks)], tile [rows][kc] at
        sRing[sbase]; warp = (r, ks) with NW / ksplit rows and ksplit K-slices."""
        NB = self.NB
        r, ks = tile_warp(warp, ksplit)
        if r < rows:
            vb, ve = k_slice(kc // VEC, ksplit, ks, cutlass.min)
            wrow = sbase + row_major(r, 0, kc)  # the loader's layout (spec.tile_copy)
            for nbk in cutlass.range(self.NO // NB):
                acc = cute.make_rmem_tensor((NB,), Float32)
                acc.fill(0.0)
                for v in cutlass.range(vb + lane, ve, LANES, unroll=2):
                    wv = load_smem_bf16x8(sRing, wrow + v * VEC)
                    for jj in cutlass.range_constexpr(NB):
                        xv = load_smem_bf16x8(sX, row_major(nbk * NB + jj, v * VEC, self.XS))
                        acc[jj] = (wv * xv).reduce(cute.ReductionOp.ADD, acc[jj], 0)
                for jj in cutlass.range_constexpr(NB):
                    acc[jj] = cute.arch.warp_reduction_sum(acc[jj])
                if lane == 0:
                    for jj in cutlass.range_constexpr(NB):
                        a = acc_index(ks, nbk * NB + jj, rowl0, self.NO, nrp) + r
                        sAcc[a] = sAcc[a] + acc[jj]

    @cute.jit
    def mma_tile(self, sRingW: cute.Tensor, wbase: Int32, kc: Int32, rows: Int32,
                 sXw: cute.Tensor, sRed: cute.Tensor, buf: Int32, warp: Int32, lane: Int32,
                 fp8: cutlass.Constexpr[bool], sc: Int64, sstride: Int64, kc0: Int32):
        """sRed[buf, warp, n, r] = x[n, slice] . W_tile[r, slice] for n < NO, r < 8, over this
        warp's K-slice of the tile, on mma.sync m16n8k16 (A = x rows, B = weight rows).

        Operands as 32-bit words (bf16 pairs) read 16 bytes per lane: lane (g, t) = (lane / 4,
        lane % 4) loads words [4t, 4t + 4) of each 32-input step from weight row g (B) and from
        activation rows g and g + 8 of every 16-row block (A). The mma's k slots {2t, 2t+1,
        2t+8, 2t+9} then hold inputs 8t + {0, 1, 2, 3} for the first mma and 8t + {4..7} for the
        second: the same permutation of k for every row of A and column of B, so each output is
        the plain dot product over the slice. C: c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t),
        c3 (g+8, 2t+1) of each block. Weight rows >= `rows` (a short last tile) read as zeros.

        `fp8`: the tile is e4m3 codes [8][kc]; lane (g, t) converts the 8 codes of the same
        inputs (fp8_index.fp8_operand_byte) into the 4 bf16 pair words. Block granularity: each
        warp's slice is whole 128-input chunks (fp8_index.mma_warp_steps), accumulated per chunk
        and added times the scales of its tile rows 2t, 2t + 1 (at `sc` - row `sstride`, chunk
        of input kc0 + 32 step); channel scales are mma_reduce's."""
        g = lane // 4
        t = lane - g * 4
        steps = kc // MMA_K_ALIGN
        block = fp8 and self.fp8_chunk > 0
        per = mma_warp_steps(steps, self.NW, CHUNK_STEPS if block else 1)
        sb = warp * per
        se = cutlass.min(steps, sb + per)
        MB = self.NO // MMA_M
        acc = cute.make_rmem_tensor((MB * 4,), Float32)
        acc.fill(0.0)
        if cutlass.const_expr(block):
            for c0 in cutlass.range(sb, se, CHUNK_STEPS):
                part = cute.make_rmem_tensor((MB * 4,), Float32)
                part.fill(0.0)
                for step in cutlass.range(c0, cutlass.min(se, c0 + CHUNK_STEPS)):
                    self.mma_step(sRingW, wbase, kc, rows, sXw, step, g, t, part, fp8)
                cb = Int64(SCALE_BYTES * scale_chunk_of(kc0 + c0 * MMA_K_ALIGN, self.fp8_chunk))
                s0 = Float32(0.0)
                s1 = Float32(0.0)
                if 2 * t < rows:
                    s0 = ld_f32_at(sc - Int64(2 * t) * sstride + cb)
                if 2 * t + 1 < rows:
                    s1 = ld_f32_at(sc - Int64(2 * t + 1) * sstride + cb)
                for mb in cutlass.range_constexpr(MB):
                    for c in cutlass.range_constexpr(4):
                        acc[mb * 4 + c] = acc[mb * 4 + c] + (s1 if c % 2 else s0) * part[
                            mb * 4 + c]
        else:
            for step in cutlass.range(sb, se):
                self.mma_step(sRingW, wbase, kc, rows, sXw, step, g, t, acc, fp8)
        for mb in cutlass.range_constexpr(MB):
            for c in cutlass.range_constexpr(4):
                m, n = mma_c_coord(g, t, c)
                sRed[mma_red_index(buf, warp, mb * MMA_M + m, n, self.NW, self.NO)] = acc[
                    mb * 4 + c]

    @cute.jit
    def mma_step(self, sRingW: cute.Tensor, wbase: Int32, kc: Int32, rows: Int32,
                 sXw: cute.Tensor, step: Int32, g: Int32, t: Int32, acc: cute.Tensor,
                 fp8: cutlass.Constexpr[bool]):
        """acc += one K-step (32 inputs) of mma_tile: the B words of weight row g (bf16 pairs,
        or FP8 codes converted to them), then two mmas per 16-row block of activations."""
        MB = self.NO // MMA_M
        xrow = self.XS // 2  # words per staged activation row
        wrow = kc // 2  # words per bf16 tile row
        b = cute.make_rmem_tensor((4,), Int32)
        b.fill(0)
        if g < rows:
            if cutlass.const_expr(fp8):
                wq = cute.make_rmem_tensor((2,), Int32)
                load_smem_words2(sRingW, wbase + fp8_operand_byte(g, step, t, kc) // 4, wq)
                for h in cutlass.range_constexpr(2):
                    lo, hi = e4m3x4_bf16x2(wq[h])
                    b[2 * h] = lo
                    b[2 * h + 1] = hi
            else:
                load_smem_words4(sRingW, wbase + mma_operand_word(g, step, t, wrow), b)
        for mb in cutlass.range_constexpr(MB):
            lo = cute.make_rmem_tensor((4,), Int32)
            hi = cute.make_rmem_tensor((4,), Int32)
            load_smem_words4(sXw, mma_operand_word(mb * MMA_M + g, step, t, xrow), lo)
            load_smem_words4(sXw, mma_operand_word(mb * MMA_M + g + 8, step, t, xrow), hi)
            for h in cutlass.range_constexpr(2):
                d = mma_bf16_16816(lo[2 * h], hi[2 * h], lo[2 * h + 1], hi[2 * h + 1],
                                   b[2 * h], b[2 * h + 1], acc[mb * 4], acc[mb * 4 + 1],
                                   acc[mb * 4 + 2], acc[mb * 4 + 3])
                for c in cutlass.range_constexpr(4):
                    acc[mb * 4 + c] = d[c]

    @cute.jit
    def mma_reduce(self, sRed: cute.Tensor, buf: Int32, rows: Int32, t0: Int32, nrp: Int32,
                   sAcc: cute.Tensor, tidx: Int32, scaled: cutlass.Constexpr[bool], sc: Int64,
                   sstride: Int64):
        """sAcc[n, t0 + r] += sum over warps (in warp order) of sRed[buf, warp, n, r]; `scaled`
        (an FP8 tile of channel granularity): times tile row r's scale (at sc - r sstride)."""
        for idx in cutlass.range(tidx, self.NO * MMA_N, self.NT):
            nn = idx // MMA_N
            r = idx - nn * MMA_N
            if r < rows:
                v = sRed[mma_red_index(buf, 0, nn, r, self.NW, self.NO)]
                for w in cutlass.range_constexpr(1, self.NW):
                    v = v + sRed[mma_red_index(buf, w, nn, r, self.NW, self.NO)]
                if cutlass.const_expr(scaled):
                    v = v * ld_f32_at(sc - Int64(r) * sstride)
                a = acc_index(0, nn, t0, self.NO, nrp) + r
                sAcc[a] = sAcc[a] + v

    # ---- prologue -----------------------------------------------------------------------------
    @cute.jit
    def row_rstd(self, op: Int32, pF: cute.Pointer, pI: cute.Pointer, slot: Int32,
                 work_off: Int32, live: Int32, in_off: Int32, k: Int32, n0: Int32,
                 sRstd: cute.Tensor, warp: Int32, lane: Int32):
        """sRstd[nn] = 1 / sqrt(mean(h[n0 + nn]^2) + eps), fp32 (one warp per row; an expert
        record's pair rows are rows of h through `in_row`)."""
        for nn in cutlass.range(warp, self.NO, self.NW):
            n = n0 + nn
            if n < live:
                row = self.in_row(op, pI, slot, work_off, n)
                ss = Float32(0.0)
                for v in cutlass.range(lane, k // VEC, LANES):
                    x = load_f32x8(pF, in_off + row * k + v * VEC)
                    ss = (x * x).reduce(cute.ReductionOp.ADD, ss, 0)
                ss = cute.arch.warp_reduction_sum(ss)
                if lane == 0:
                    sRstd[nn] = Float32(1.0) / cute.math.sqrt(ss / Float32(k) + Float32(self.eps))

    @cute.jit
    def stage_x(self, op: Int32, pW: cute.Pointer, pF: cute.Pointer, pB: cute.Pointer,
                pI: cute.Pointer, slot: Int32, work_off: Int32, live: Int32, norm_off: Int32,
                in_off: Int32, k: Int32, n0: Int32, kc0: Int32, kc: Int32, sX: cute.Tensor,
                sRstd: cute.Tensor, tidx: Int32):
        """sX[nn, 0:kc] = bf16(h * rstd * w) (norm opcodes) or the bf16 input, zeros past the
        live rows (N; an expert record's pair rows, read through `in_row`)."""
        nv = kc // VEC
        for idx in cutlass.range(tidx, self.NO * nv, self.NT):
            nn = idx // nv
            v = idx - nn * nv
            n = n0 + nn
            y = cute.make_rmem_tensor((VEC,), Float32)
            y.fill(0.0)
            if n < live:
                col = kc0 + v * VEC
                row = self.in_row(op, pI, slot, work_off, n)
                if norm_off >= 0:
                    h = load_f32x8(pF, in_off + row * k + col)
                    w = load_bf16x8(pW, norm_off + col)
                    if cutlass.const_expr(self.spec.norm_one_plus):  # Qwen3.5: (1 + w)
                        w = w + Float32(1.0)
                    y.store((h * sRstd[nn]) * w)
                else:
                    y.store(load_bf16x8(pB, in_off + row * k + col))
            store_smem_bf16x8(sX, row_major(nn, v * VEC, self.XS), y.load())

    # ---- the GEMV -----------------------------------------------------------------------------
    @cute.jit
    def gemv(self, pW: cute.Pointer, w_base: Int64, k: Int32, rc0: Int32, kc0: Int32, kc: Int32,
             ng: Int32, ksplit: Int32, nrp: Int32, sX: cute.Tensor, sAcc: cute.Tensor,
             warp: Int32, lane: Int32):
        """sAcc[ks, n, row] += W[rc0 + row, kc0 + slice(ks)] . x[n, slice(ks)] for this chunk."""
        R, NB = self.R, self.NB
        atom = weight_atom()
        ks = warp // ng
        if ks < ksplit:
            vb, ve = k_slice(kc // VEC, ksplit, ks, cutlass.min)
            for gi in cutlass.range(warp - ks * ng, ng, self.NW):
                rowl = gi * R
                row_off = w_base + row_major(Int64(rc0 + rowl), Int64(kc0), Int64(k))
                for nbk in cutlass.range(self.NO // NB):
                    acc = cute.make_rmem_tensor((R * NB,), Float32)
                    acc.fill(0.0)
                    for v in cutlass.range(vb + lane, ve, LANES, unroll=self.spec.gemv_unroll):
                        wv = [load_weights8(atom, pW, row_off + Int64(row_major(r, v * VEC, k)))
                              for r in range(R)]
                        for j in cutlass.range_constexpr(NB):
                            xv = load_smem_bf16x8(sX, row_major(nbk * NB + j, v * VEC, self.XS))
                            for r in cutlass.range_constexpr(R):
                                acc[r * NB + j] = (wv[r] * xv).reduce(
                                    cute.ReductionOp.ADD, acc[r * NB + j], 0)
                    for i in cutlass.range_constexpr(R * NB):
                        acc[i] = cute.arch.warp_reduction_sum(acc[i])
                    if lane == 0:
                        for r in cutlass.range_constexpr(R):
                            for j in cutlass.range_constexpr(NB):
                                # + r last: R consecutive words (vectorised)
                                a = acc_index(ks, nbk * NB + j, rowl, self.NO, nrp) + r
                                sAcc[a] = sAcc[a] + acc[r * NB + j]

    @cute.jit
    def gemv_fp8(self, pW: cute.Pointer, w_base: Int64, row0: Int32, k: Int32, rc0: Int32,
                 kc0: Int32, kc: Int32, ng: Int32, ksplit: Int32, nrp: Int32, sX: cute.Tensor,
                 sAcc: cute.Tensor, warp: Int32, lane: Int32):
        """`gemv` for an FP8 slab: the R rows' 8 codes per lane (8-byte loads at
        fp8_index.slab_byte) converted in registers; scales as gemv_tile_fp8's."""
        R, NB = self.R, self.NB
        atom = fp8_atom()
        sstride = self.scale_stride(k)
        ks = warp // ng
        if ks < ksplit:
            vb, ve = k_slice(kc // VEC, ksplit, ks, cutlass.min)
            for gi in cutlass.range(warp - ks * ng, ng, self.NW):
                rowl = gi * R
                row_addr = pW.toint() + slab_byte(w_base, Int64(rc0 + rowl), Int64(kc0),
                                                  Int64(k), Int64(1))
                srow = self.scale_addr(pW, w_base, row0, k, rc0 + rowl)
                for nbk in cutlass.range(self.NO // NB):
                    acc = cute.make_rmem_tensor((R * NB,), Float32)
                    acc.fill(0.0)
                    for v in cutlass.range(vb + lane, ve, LANES, unroll=self.spec.gemv_unroll):
                        wq = [cute.make_rmem_tensor((2,), Int32) for _ in range(R)]
                        for r in cutlass.range_constexpr(R):  # loads in flight, then converted
                            load_fp8_words(atom, row_addr + Int64(row_major(r, v * VEC, k)),
                                           wq[r])
                        wv = [e4m3x8_f32(wq[r]) for r in range(R)]
                        if cutlass.const_expr(self.fp8_chunk == 0):
                            for j in cutlass.range_constexpr(NB):
                                xv = load_smem_bf16x8(sX, row_major(nbk * NB + j, v * VEC, self.XS))
                                for r in cutlass.range_constexpr(R):
                                    acc[r * NB + j] = (wv[r] * xv).reduce(
                                        cute.ReductionOp.ADD, acc[r * NB + j], 0)
                        else:
                            cb = Int64(SCALE_BYTES * scale_chunk_of(kc0 + v * VEC, self.fp8_chunk))
                            sv = [ld_f32_at(srow - Int64(r) * sstride + cb) for r in range(R)]
                            for j in cutlass.range_constexpr(NB):
                                xv = load_smem_bf16x8(sX, row_major(nbk * NB + j, v * VEC, self.XS))
                                for r in cutlass.range_constexpr(R):
                                    acc[r * NB + j] = acc[r * NB + j] + sv[r] * (wv[r] * xv).reduce(
                                        cute.ReductionOp.ADD, Float32(0.0), 0)
                    for i in cutlass.range_constexpr(R * NB):
                        acc[i] = cute.arch.warp_reduction_sum(acc[i])
                    if lane == 0:
                        for r in cutlass.range_constexpr(R):
                            rs = Float32(1.0)
                            if cutlass.const_expr(self.fp8_chunk == 0):
                                rs = ld_f32_at(srow - Int64(r) * sstride)
                            for j in cutlass.range_constexpr(NB):
                                a = acc_index(ks, nbk * NB + j, rowl, self.NO, nrp) + r
                                sAcc[a] = sAcc[a] + acc[r * NB + j] * rs

    @cute.jit
    def acc_value(self, sAcc: cute.Tensor, nn: Int32, row: Int32, ksplit: Int32,
                  nrp: Int32) -> Float32:
        """Result of (activation row nn, chunk row): the K-slices summed in order."""
        v = sAcc[acc_index(0, nn, row, self.NO, nrp)]
        for ks in cutlass.range(1, ksplit):
            v = v + sAcc[acc_index(ks, nn, row, self.NO, nrp)]
        return v

    # ---- expert records (moe.py) ---------------------------------------------------------------
    @cute.jit
    def bind(self, op: Int32, rec: cute.Tensor, w_base: Int64, pI: cute.Pointer):
        """(W, SLOT, WORK_OFF, live rows) of the record: W and the N activation rows, or an
        expert record bound to its slot's expert and pair rows (moe.Experts.bind)."""
        live = Int32(self.N)
        slot = Int32(0)
        work_off = Int32(0)
        wb = w_base
        if cutlass.const_expr(self.moe.on):
            if one_of(op, self.moe.codes):
                slot = rec[word(Op.EXPERT_GATEUP, "SLOT")]  # (both expert opcodes: Experts)
                work_off = rec[word(Op.EXPERT_GATEUP, "WORK_OFF")]
                wb, live = self.moe.bind(w_base, slot, work_off, pI)
        return wb, slot, work_off, live

    @cute.jit
    def in_row(self, op: Int32, pI: cute.Pointer, slot: Int32, work_off: Int32,
               n: Int32) -> Int32:
        """Input row of live row n: n, or an expert record's pair row's activation row (gate/up:
        h [N, H]) or expert slot row (down: act_moe [N slots, I_e])."""
        row = n
        if cutlass.const_expr(self.moe.on):
            if one_of(op, self.moe.codes):
                an, q = self.moe.rows(slot, work_off, pI, n)
                row = an
                if one_of(op, self.moe.down):
                    row = q
        return row

    @cute.jit
    def swiglu(self, sAcc: cute.Tensor, nn: Int32, c: Int32, ksplit: Int32,
               nrp: Int32) -> Float32:
        """silu(gate) * up of activation column c of a chunk whose rows alternate
        GATEUP_BLOCK gate rows and GATEUP_BLOCK up rows (fp32)."""
        blk = isa.GATEUP_BLOCK
        gr = (c // blk) * (2 * blk) + c % blk
        g = self.acc_value(sAcc, nn, gr, ksplit, nrp)
        u = self.acc_value(sAcc, nn, gr + blk, ksplit, nrp)
        return g / (Float32(1.0) + cute.math.exp(-g)) * u


@cute.jit
def mma_bf16_16816(a0: Int32, a1: Int32, a2: Int32, a3: Int32, b0: Int32, b1: Int32,
                   c0: Float32, c1: Float32, c2: Float32, c3: Float32):
    """D = A . B + C on one warp: mma.sync m16n8k16, A row-major and B column-major bf16 pairs in
    32-bit registers, fp32 C/D (PTX ISA fragment layout). Returns (d0, d1, d2, d3)."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{{$w0}, {$w1}, {$w2}, {$w3}}, {{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, "
        "{{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3])
