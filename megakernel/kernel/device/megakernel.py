"""The persistent decode megakernel: one CTA per SM interprets its queue of the program.

Per record: read the 16 words, start what may run during the dependency wait (the handler's
`prefetch`: an ATTN_PARTIAL's cached keys/values, a recurrent unit's state; without the pipeline
also the L2 lookahead of this CTA's next weight slabs, lookahead.py), wait on the producer
counter, run the opcode, signal. At the end of the queue the CTA counts itself out and the last
one advances the epoch (sync.py).

Shared-memory weight pipeline (spec.smem_stages >= 2, the default where the spec fits): the CTA
gets one extra warp, the loader (pipeline.py), which walks the same queue and streams every matvec
slab into a ring of shared-memory stages (cp.async.bulk + mbarriers) ahead of the consumer warps,
across their dependency waits, and slides the L2 lookahead ahead of its own tiles; the consumers
(the spec's num_threads) run the loop above, read the weights from the ring (Matvec.run_piped)
and synchronise on named barrier 1. With smem_stages = 0 the consumers read the weights from
global memory (Matvec.run) and there is no loader warp.

Who runs an opcode: EMBED and ARGMAX (a speculative build's ACCEPT, speculative_index.py)
here; the matvec family in matvec.py, by epilogue (the MoE's expert slabs bound at run time to
their work-list slot); every other opcode by the handler class
its ISA declaration names (OpSpec.handler, the interface in handler.py): split-KV attention and
its merge in attention.py, the gated delta rule in gdn.py and with a channel-wise decay (KDA) in
kda.py, Mamba2 in mamba2.py / mamba_replay.py, their speculative commits in commit.py, the n-gram
drafter in speculative.py, latent attention in mla.py, the MoE router in moe_router.py and
MOE_COMBINE in moe.py.
Records are read by field name and the opcode sets the loop branches on (the matvec opcodes, the
ticket opcodes that signal from their merge) come from the ISA registry (fields.py); a record
whose opcode the build has no handler for traps. The host side `__call__` exists only to give
`cute.compile` something to trace: launches go through the driver API (runtime.py), so the
entry takes plain pointers and int32s (spec.PARAMS).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Float32, Int32, Int64, Uint8

from megakernel import isa
from megakernel.isa import Op
from megakernel.kernel.config.fields import OpTable, common, none_of, one_of, slab_word, word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device import sync, timeline
from megakernel.kernel.device.epilogues import warp_argmax
from megakernel.kernel.device.handler import Step, handlers_for
from megakernel.kernel.device.lookahead import Lookahead
from megakernel.kernel.device.matvec import Matvec
from megakernel.kernel.device.memory import (
    elem_ptr,
    join64,
    ld,
    load_bf16x8,
    record_word,
    st,
    store_f32x8,
)
from megakernel.kernel.device.pipeline import Pipeline
from megakernel.kernel.device.sync import cta_sync
from megakernel.kernel.host.limits import LANES, VEC
from megakernel.kernel.host.speculative_index import AcceptShape


class DecodeMegakernel:
    """Static config in `__init__`, host trace in `__call__`, device code in `kernel`."""

    def __init__(self, spec: KernelSpec):
        spec.validate()
        self.spec = spec
        self.ops = OpTable.for_spec(spec)  # the opcodes this build handles (fields.py)
        self.NT, self.NW = spec.num_threads, spec.num_warps
        self.N, self.T, self.B, self.H = spec.rows, spec.tokens, spec.batch, spec.hidden
        self.matvec = Matvec(spec)
        # the opcodes' handler classes (OpSpec.handler; kernel/device/handler.py), one instance each
        self.handlers = handlers_for(spec, self.ops.handled)
        self.regions = spec.smem_regions()
        self.smem_bytes = spec.smem_bytes
        self.window = spec.prefetch_window
        self.piped = spec.pipelined
        self.named = spec.num_threads if spec.pipelined else 0  # consumer barrier (pipeline.py)
        self.pipe = Pipeline(spec) if spec.pipelined else None
        self.lookahead = Lookahead(spec)
        # the step's end: ARGMAX, or ACCEPT in a speculative build (speculative_index.py)
        self.end_op = Op.ACCEPT if spec.drafts else Op.ARGMAX
        self.acc = AcceptShape.for_spec(spec)

    @cute.jit
    def __call__(self, program: cute.Pointer, counters: cute.Pointer, weights: cute.Pointer,
                 f32: cute.Pointer, bf16: cute.Pointer, i32: cute.Pointer, k_cache: cute.Pointer,
                 v_cache: cute.Pointer, state: cute.Pointer, queue_len: Int32, s_max: Int32,
                 len_off: Int32, num_ctas: Int32, stream: cuda.CUstream):
        self.kernel(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state,
                    queue_len, s_max, len_off).launch(
            grid=[num_ctas, 1, 1], block=[self.spec.block_threads, 1, 1], smem=self.smem_bytes,
            cooperative=True, min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, program: cute.Pointer, counters: cute.Pointer, weights: cute.Pointer,
               f32: cute.Pointer, bf16: cute.Pointer, i32: cute.Pointer, k_cache: cute.Pointer,
               v_cache: cute.Pointer, state: cute.Pointer, queue_len: Int32, s_max: Int32,
               len_off: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        # ---- shared memory (spec.smem_regions) ----
        smem = cutlass.memory.SmemAllocator()
        raw = smem.allocate_tensor(Uint8, cute.make_layout(self.smem_bytes), byte_alignment=128)
        sX = self.region(raw, "x", BFloat16)  # [NO * KC] staged matvec input
        sAcc = self.region(raw, "acc", Float32)  # [ks][n][row] GEMV results
        sRstd = self.region(raw, "rstd", Float32)  # [NO]
        sBest = self.region(raw, "best", Float32)  # [NO][2] running (max, index)
        sQ = self.region(raw, "q", Float32)  # [NW][D]
        sO = self.region(raw, "o", Float32)  # [NW][D]
        sML = self.region(raw, "ml", Float32)  # [NW][2]
        sFlag = self.region(raw, "flag", Int32)  # [1] broadcast from thread 0

        sRed = sAcc  # [2][NW][NO][8] mma partials (spec.mma); unused otherwise
        if cutlass.const_expr(self.spec.mma):
            sRed = self.region(raw, "red", Float32)
        sSsm = sAcc  # the recurrent handlers' scratch span (spec.recurrent_smem_bytes)
        if cutlass.const_expr(self.spec.recurrent_smem_bytes > 0):
            sSsm = cute.make_tensor(cute.recast_ptr(raw.iterator, dtype=Float32),
                                    cute.make_layout(self.spec.recurrent_smem_bytes // 4))
        if cutlass.const_expr(self.piped):
            sRing = self.region(raw, "ring", BFloat16)  # [S][stage] weight tiles
            mbar = cute.recast_ptr(raw.iterator + self.regions["mbar"][0], dtype=Int64)
            if tidx == 0:
                self.pipe.init(mbar)
            cute.arch.sync_threads()  # the last CTA-wide barrier: mbarriers initialised
            if warp == self.NW:  # the loader warp
                if lane == 0:
                    if cutlass.const_expr(self.spec.timeline):
                        self.pipe.load_queue(program + bidx * queue_len * isa.RECORD_WORDS,
                                             weights, sRing.iterator, mbar, counters, i32,
                                             timeline.cta_records(program, num_ctas, queue_len,
                                                                  bidx))
                    else:
                        self.pipe.load_queue(program + bidx * queue_len * isa.RECORD_WORDS,
                                             weights, sRing.iterator, mbar, counters, i32)
            else:
                self.consume(program, counters, weights, f32, bf16, i32, k_cache, v_cache,
                             state, queue_len, s_max, len_off, sX, sAcc, sRstd, sBest, sQ, sO, sML,
                             sFlag, sRing, sRed, sSsm, mbar, tidx, bidx, num_ctas, warp, lane)
        else:
            self.consume(program, counters, weights, f32, bf16, i32, k_cache, v_cache, state,
                         queue_len, s_max, len_off, sX, sAcc, sRstd, sBest, sQ, sO, sML, sFlag,
                         sX, sRed, sSsm, counters, tidx, bidx, num_ctas, warp, lane)

    @cute.jit
    def consume(self, program: cute.Pointer, counters: cute.Pointer, weights: cute.Pointer,
                f32: cute.Pointer, bf16: cute.Pointer, i32: cute.Pointer, k_cache: cute.Pointer,
                v_cache: cute.Pointer, state: cute.Pointer, queue_len: Int32, s_max: Int32,
                len_off: Int32, sX: cute.Tensor, sAcc: cute.Tensor, sRstd: cute.Tensor,
                sBest: cute.Tensor, sQ: cute.Tensor, sO: cute.Tensor, sML: cute.Tensor,
                sFlag: cute.Tensor,
                sRing: cute.Tensor, sRed: cute.Tensor, sSsm: cute.Tensor, mbar, tidx: Int32,
                bidx: Int32, num_ctas: Int32, warp: Int32, lane: Int32):
        """The consumer warps' persistent loop over this CTA's queue (module docstring)."""
        named = self.named
        epoch = Int32(0)
        if tidx == 0:
            epoch = sync.read_epoch(counters)

        queue = program + bidx * queue_len * isa.RECORD_WORDS
        pc = Int32(0)
        # lookahead state (global-memory build): record pf_pc's slab is requested up to byte
        # pf_off; pf_cum and cum are offsets in this CTA's stream of slabs (the lookahead
        # position, the start of slab pc)
        pf_pc = Int32(0)
        pf_off = Int64(0)
        pf_cum = Int64(0)
        cum = Int64(0)
        j = Int32(0)  # pipeline tiles consumed (pipeline.py)
        if cutlass.const_expr(self.spec.timeline):  # this CTA's timeline records (timeline.py)
            tl = timeline.cta_records(program, num_ctas, queue_len, bidx)
        op = record_word(queue, pc, common("OPCODE"))
        while op != Op.END:
            rec = cute.make_rmem_tensor((isa.RECORD_WORDS,), Int32)
            gRec = cute.make_tensor(elem_ptr(queue, pc * isa.RECORD_WORDS, 16),
                                    cute.make_layout(isa.RECORD_WORDS))
            cute.autovec_copy(gRec, rec)
            layer = rec[common("LAYER")]
            st = Step(rec, layer, epoch, counters, weights, f32, bf16, i32, k_cache, v_cache,
                      state, s_max, sQ, sO, sML, sFlag, sRstd, sSsm, tidx, warp, lane)
            for h in cutlass.range_constexpr(len(self.handlers)):  # what may start early
                if one_of(op, self.handlers[h].ops):
                    self.handlers[h].prefetch(op, st)
            # the loader warp slides it when piped (pipeline.py); l2_window 0 builds no lookahead
            if cutlass.const_expr(not self.piped and self.window > 0):
                pf_pc, pf_off, pf_cum = self.lookahead.extend(weights, queue, pc, cum, pf_pc,
                                                              pf_off, pf_cum, tidx, self.NT)
            if cutlass.const_expr(self.spec.timeline):
                if tidx == 0:
                    timeline.stamp(tl, pc, "wait_start")
            sync.wait_counter(counters, rec[common("WAIT_CID")],
                              epoch * rec[common("WAIT_TOTAL")] + rec[common("WAIT_TARGET")],
                              tidx, named)
            if cutlass.const_expr(self.spec.timeline):
                if tidx == 0:
                    timeline.stamp(tl, pc, "wait_end")
                    timeline.put(tl, pc, "opcode", op)
            if op == Op.EMBED:
                self.embed(rec, weights, f32, i32, tidx)
            elif op == self.end_op:  # ARGMAX, or a speculative build's ACCEPT
                if cutlass.const_expr(self.spec.drafts > 0):
                    self.accept(rec, f32, i32, s_max, tidx, warp, lane)
                else:
                    self.argmax(rec, f32, i32, tidx, warp, lane)
            elif one_of(op, self.ops.matvec):
                if cutlass.const_expr(self.piped):
                    j = self.matvec.run_piped(op, rec, layer, weights, f32, bf16, i32, k_cache,
                                              v_cache, s_max, len_off, sX, sAcc, sRstd, sBest,
                                              sRing, sRed, mbar, j, tidx, warp, lane)
                    if cutlass.const_expr(self.pipe.moe.on):  # before the signal (pipeline.py)
                        if one_of(op, self.pipe.moe.codes):
                            self.pipe.wait_bound(mbar, pc, tidx)
                else:
                    self.matvec.run(op, rec, layer, weights, f32, bf16, i32, k_cache, v_cache,
                                    s_max, len_off, sX, sAcc, sRstd, sBest, tidx, warp, lane)
            else:  # the handler classes' opcodes (handler.py), else a trap
                self.dispatch(op, st, 0)
            if cutlass.const_expr(len(self.ops.ticket) > 0):
                if none_of(op, self.ops.ticket):  # a ticket opcode signals from its merge
                    sync.signal_counter(counters, rec[common("SIGNAL_CID")], tidx, named)
            else:
                sync.signal_counter(counters, rec[common("SIGNAL_CID")], tidx, named)
            if cutlass.const_expr(self.spec.timeline):
                if tidx == 0:
                    timeline.stamp(tl, pc, "finish")
            if cutlass.const_expr(not self.piped):
                cum = cum + self.lookahead.slab_bytes(op, rec[slab_word("NROWS")],
                                                      rec[slab_word("K")])
            pc += 1
            op = record_word(queue, pc, common("OPCODE"))
        if cutlass.const_expr(self.piped):
            if tidx == 0:
                self.pipe.check_done(mbar, j)
        sync.finish_step(counters, epoch, num_ctas, tidx, named)

    @cute.jit
    def dispatch(self, op: Int32, st: Step, i: int):
        """Run `op` by handler i if it is one of its opcodes, else try handler i + 1 (an if/elif
        chain unrolled at trace time); past the last handler: an opcode this build has no
        handler for, which fails the launch."""
        if cutlass.const_expr(i == len(self.handlers)):
            cute.arch.inline_ptx("trap;")
        else:
            if one_of(op, self.handlers[i].ops):
                self.handlers[i].run(op, st)
            else:
                self.dispatch(op, st, i + 1)

    def region(self, raw: cute.Tensor, name: str, dtype):
        off, nbytes = self.regions[name]
        width = dtype.width // 8
        ptr = cute.recast_ptr(raw.iterator + off, dtype=dtype)
        return cute.make_tensor(ptr, cute.make_layout(max(nbytes // width, 1)))

    # ---- helpers and small handlers -----------------------------------------------------------
    @cute.jit
    def embed(self, rec: cute.Tensor, weights: cute.Pointer, f32: cute.Pointer,
              i32: cute.Pointer, tidx: Int32):
        """h[n] = fp32(embedding[tokens_in[n]]) for n in [N0, N1)."""
        w_base = join64(rec[word(Op.EMBED, "W_LO")], rec[word(Op.EMBED, "W_HI")])
        n0, n1, k = rec[word(Op.EMBED, "N0")], rec[word(Op.EMBED, "N1")], rec[word(Op.EMBED, "K")]
        tok_off, out_off = rec[word(Op.EMBED, "TOK_OFF")], rec[word(Op.EMBED, "OUT_OFF")]
        nv = k // VEC
        for idx in cutlass.range(tidx, (n1 - n0) * nv, self.NT):
            nn = idx // nv
            v = idx - nn * nv
            tok = ld(i32, tok_off + n0 + nn)
            row = load_bf16x8(weights, w_base + Int64(tok) * Int64(k) + Int64(v * VEC))
            store_f32x8(f32, out_off + (n0 + nn) * k + v * VEC, row)

    @cute.jit
    def best_token(self, n: Int32, n_tiles: Int32, parg: Int32, f32: cute.Pointer, lane: Int32):
        """Row n's greedy token over the LM-head tiles' partial (max, index) pairs, a lane per
        tile then the warp: the largest value, equal maxima to the lowest index (every lane
        gets it)."""
        best = Float32(-float("inf"))
        bidx = Int32(0x7FFFFFFF)
        for tile in cutlass.range(lane, n_tiles, LANES):
            v = ld(f32, parg + self.acc.parg(tile, n, 0))
            i = ld(f32, parg + self.acc.parg(tile, n, 1)).to(Int32)
            take = (v > best) | ((v == best) & (i < bidx))
            if take:
                best = v
                bidx = i
        best, bidx = warp_argmax(best, bidx)
        return bidx

    @cute.jit
    def argmax(self, rec: cute.Tensor, f32: cute.Pointer, i32: cute.Pointer, tidx: Int32,
               warp: Int32, lane: Int32):
        """tokens_out[n] = argmax over the LM-head tiles' partials; then the step's flags."""
        n_tiles, parg = rec[word(Op.ARGMAX, "N_TILES")], rec[word(Op.ARGMAX, "PARG_OFF")]
        out_off, tok_off = rec[word(Op.ARGMAX, "OUT_OFF")], rec[word(Op.ARGMAX, "TOK_OFF")]
        len_off, flags = rec[word(Op.ARGMAX, "LEN_OFF")], rec[word(Op.ARGMAX, "FLAGS")]
        for n in cutlass.range(warp, self.N, self.NW):
            bidx = self.best_token(n, n_tiles, parg, f32, lane)
            if lane == 0:
                st(i32, out_off + n, bidx)
                if (flags & isa.FLAG_FEEDBACK) != 0:
                    st(i32, tok_off + n, bidx)
        if (flags & isa.FLAG_ADVANCE) != 0:
            for b in cutlass.range(tidx, self.B, self.NT):
                st(i32, len_off + b, ld(i32, len_off + b) + self.T)

    @cute.jit
    def accept(self, rec: cute.Tensor, f32: cute.Pointer, i32: cute.Pointer, s_max: Int32,
               tidx: Int32, warp: Int32, lane: Int32):
        """The speculative step's end (layers/speculative.py ACCEPT; speculative_index.py): the
        greedy tokens as ARGMAX's, a warp per row; one barrier; then a thread per sequence
        counts the accepted drafts and emits them and the bonus."""
        a_ = self.acc
        n_tiles, parg = rec[word(Op.ACCEPT, "N_TILES")], rec[word(Op.ACCEPT, "PARG_OFF")]
        out_off, tok_off = rec[word(Op.ACCEPT, "OUT_OFF")], rec[word(Op.ACCEPT, "TOK_OFF")]
        len_off, emit_off = rec[word(Op.ACCEPT, "LEN_OFF")], rec[word(Op.ACCEPT, "EMIT_OFF")]
        hist = rec[word(Op.ACCEPT, "HIST_OFF")]
        for n in cutlass.range(warp, self.N, self.NW):
            bidx = self.best_token(n, n_tiles, parg, f32, lane)
            if lane == 0:
                st(i32, out_off + n, bidx)
        cta_sync(self.named)  # every row's greedy token (this CTA's stores) is visible
        for b in cutlass.range(tidx, self.B, self.NT, unroll=1):
            g = cute.make_rmem_tensor((self.T,), Int32)  # greedy tokens of the T rows
            x = cute.make_rmem_tensor((self.T,), Int32)  # the T inputs
            for t in cutlass.range_constexpr(self.T):
                g[t] = ld(i32, out_off + a_.row(b, t))
                x[t] = ld(i32, tok_off + a_.row(b, t))
            length = ld(i32, len_off + b)
            acc = Int32(0)  # leading drafts equal to the greedy token of the row before them
            alive = Int32(1)
            for t in cutlass.range_constexpr(a_.drafts):
                if x[t + 1] != g[t]:
                    alive = Int32(0)
                acc = acc + alive
            e = a_.emitted(acc, length, s_max, cutlass.min, cutlass.max)
            bonus = x[0]
            for t in cutlass.range_constexpr(self.T):  # committed inputs; the bonus g[e - 1]
                if t < e:
                    st(i32, hist + a_.hist(b, length + t, s_max), x[t])
                if t == e - 1:
                    bonus = g[t]
            if e > 0:
                st(i32, hist + a_.hist(b, length + e, s_max), bonus)
                st(i32, tok_off + a_.row(b, 0), bonus)
            st(i32, emit_off + b, e)
            st(i32, len_off + b, length + e)
