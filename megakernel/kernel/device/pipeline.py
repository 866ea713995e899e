"""Shared-memory weight pipeline: a loader warp streams matvec slabs into a ring of stages.

Used when `KernelSpec.smem_stages` = S >= 2. The CTA has the spec's consumer warps plus one loader
warp (the last). The loader walks the CTA's queue exactly like the consumers do (same records, same
END), and for every slab record (the registry's `slab` opcodes the build handles, fields.OpTable)
streams its slab `spec.passes` times (once per pass over the activation rows), in tiles of
`tile_rows(KC)` rows of one K-chunk (spec.matvec_tiles: the loop nest of Matvec.run_piped).
Tile j goes to stage j % S (spec.ring_slot):

    loader (lane 0)                          consumers (every consumer thread)
    wait empty[s] parity ((j / S) & 1) ^ 1   wait full[s] parity (j / S) & 1
    arrive.expect_tx(full[s], bytes)         read the tile from shared memory, compute
    cp.async.bulk G2S -> stage s, full[s]    __syncwarp; lane 0 of each warp arrives on empty[s]

full[s] counts 1 arrival (the loader's expect_tx) plus the transaction bytes; empty[s] counts one
arrival per consumer warp. At END the loader stores its tile count and arrives on `done`; before
counting the CTA out, consumer thread 0 waits for `done` and traps unless the count equals its own
(a loader/consumer disagreement on the tile sequence fails the launch at once).

Weights never depend on activations, so the loader runs up to S tiles ahead of the consumers,
across instruction boundaries and across their dependency waits. The one exception: an expert
record (EXPERT_GATEUP / EXPERT_DOWN) is bound at run time to its work-list slot's expert, so the
loader waits on the layer's router counter (only reading it; none for the shared expert) before
it reads the binding, streams the bound slab for ceil(live rows / NO) passes, nothing for an
unbound slot, and publishes that it has read it (the `bound` word): the consumers leave an expert
record only once it has (`wait_bound`), so no binding is read after the next MoE layer's router
rewrites the work list (moe.py: the rule, and why it cannot deadlock).
FP8 slabs (spec.fp8_ops; fp8_index.py) are the same walk in bytes: a record's slab starts at byte
2W for either format, a tile is `tile_rows(kc, 1)` rows of kc one-byte codes (twice the rows of
a bf16 tile where the stage, not the warp count, bounds them), and the stage holds it as
[rows][kc] bytes. The scales are not staged: the consumers read them through L1 (a row's one
scale per tile for channel granularity, one per 128 inputs for block), and the lookahead cursor
asks L2 for a slab's scale run when it enters the slab.
Before each tile it also runs the L2 lookahead (`prefetch_tiles`): a second cursor over the
same tile sequence prefetches the tiles that follow, up to `spec.prefetch_window` bytes past the
ones issued, so HBM keeps streaming exactly the bytes the loader will copy while the ring is
full: spec.loader_lookahead_plan is the host mirror.
`spec.stage_plan` is the host mirror of its schedule.

Barriers: the loader warp leaves the CTA-wide barrier after the mbarrier set-up, so the consumers
synchronise among themselves with named barrier 1 over `spec.num_threads` threads
(`sync.cta_sync`). Every mbarrier wait has the counter waits' watchdog: a wait unmet after
`sync.WAIT_TIMEOUT_NS` traps (a broken schedule fails the launch instead of hanging the GPU).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from megakernel.isa import Op
from megakernel.kernel.config.fields import OpTable, common, mv, one_of, slab_word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device import timeline
from megakernel.kernel.device.lookahead import prefetch_scales, slab_wbytes
from megakernel.kernel.device.memory import join64, record_word
from megakernel.kernel.device.moe import Experts
from megakernel.kernel.device.sync import WAIT_TIMEOUT_NS, read_epoch
from megakernel.kernel.host import moe_index
from megakernel.kernel.host.dense_index import ring_slot, tile_copy
from megakernel.kernel.host.fp8_index import slab_byte
from megakernel.kernel.host.limits import SMEM_STAGE_BYTES


class Pipeline:
    """The ring (stages of SMEM_STAGE_BYTES), its mbarriers, the loader and the consumer steps."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.ops = OpTable.for_spec(spec)  # slab opcodes: the registry's `slab` (fields.py)
        self.moe = Experts(spec)  # expert records: bound at run time (moe.py)
        self.S = spec.smem_stages
        self.NW = spec.num_warps
        self.stage_elems = SMEM_STAGE_BYTES // 2  # bf16 per stage
        self.window = spec.prefetch_window
        self.fp8_ops = spec.fp8_ops  # slab opcodes whose weights are e4m3 codes
        self.fp8_chunk = spec.fp8_chunk  # inputs per scale (0: one per row)

    @cute.jit
    def weight_bytes(self, op: Int32) -> Int32:
        """Bytes per weight of `op`'s slab: 1 (FP8) or 2 (bf16), spec.weight_bytes."""
        return slab_wbytes(op, self.fp8_ops)

    @cute.jit
    def tile_rows(self, kc: Int32, wb: Int32) -> Int32:
        """Device twin of spec.tile_rows: the largest power of two <= NW rows of `kc` weights of
        `wb` bytes that fit one stage (the spec guarantees that one row of a K-chunk fits)."""
        tr = Int32(1)
        for c in cutlass.range_constexpr(1, 8):
            if cutlass.const_expr((1 << c) <= self.NW):
                if Int32(1 << c) * kc * wb <= SMEM_STAGE_BYTES:
                    tr = Int32(1 << c)
        return tr

    # ---- set-up (one thread, before the CTA-wide barrier) -------------------------------------
    @cute.jit
    def init(self, mbar: cute.Pointer):
        for s in cutlass.range_constexpr(self.S):
            cute.arch.mbarrier_init(mbar + s, 1)  # full[s]: the loader's expect_tx
            cute.arch.mbarrier_init(mbar + self.S + s, self.NW)  # empty[s]: one per warp
        cute.arch.mbarrier_init(mbar + 2 * self.S, 1)  # done: the loader reached END
        self.bound_word(mbar)[0] = Int32(0)  # no expert record bound yet
        cute.arch.mbarrier_init_fence()

    def bound_word(self, mbar: cute.Pointer) -> cute.Tensor:
        """The int32 after the tile count (spec.smem_regions "mbar"): 1 + the queue position of
        the last expert record whose binding the loader has read."""
        return cute.make_tensor(cute.recast_ptr(mbar + 2 * self.S + 2, dtype=Int32),
                                cute.make_layout(1))

    # ---- loader warp --------------------------------------------------------------------------
    @cute.jit
    def load_queue(self, queue: cute.Pointer, weights: cute.Pointer, ring: cute.Pointer,
                   mbar: cute.Pointer, counters: cute.Pointer, pI: cute.Pointer,
                   tl: cute.Pointer | None = None):
        """Stream every matvec slab of this CTA's queue into the ring (run by one thread), tile by
        tile in the consumers' loop nest (spec.matvec_tiles): pass > ROW_CHUNK rows > K-chunk >
        `tile_rows` rows. A tile of whole rows (K-chunk = K) is one bulk copy, else one per row (the
        slab is row-major [NROWS, K]); the stage holds the tile as [rows][kc]. `tl`: the timeline
        build's records (kernel/device/timeline.py; None otherwise): the loader stamps when it
        reaches each slab and when it has issued the slab's last tile. An expert record is streamed
        as bound after its dependency wait (`bind`)."""
        KC, RC = self.spec.k_chunk, self.spec.row_chunk
        epoch = Int32(0)
        if cutlass.const_expr(self.moe.on):
            epoch = read_epoch(counters)
        j = Int32(0)  # tiles issued
        pc = Int32(0)
        vol = Int64(0)  # bytes of the tiles issued so far
        # the prefetch cursor (prefetch_tiles): record, pass, row chunk, K-chunk, tile row, volume
        f_pc, f_p, f_rc, f_kc, f_t = Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)
        f_vol = Int64(0)
        op = record_word(queue, pc, common("OPCODE"))
        while op != Op.END:
            if one_of(op, self.ops.slab):
                w_base, nrows, k = slab_record(queue, pc)
                if cutlass.const_expr(self.moe.on):
                    if one_of(op, self.moe.codes):
                        self.moe.wait_queued(op, counters, queue, pc, epoch)
                w_base, passes = self.bind(op, queue, pc, w_base, pI)
                if cutlass.const_expr(self.moe.on):
                    if one_of(op, self.moe.codes):  # read: the consumers may leave it
                        cute.arch.store(self.bound_word(mbar).iterator, pc + 1, sem="release",
                                        scope="cta")
                wb = self.weight_bytes(op)
                tr = self.tile_rows(cutlass.min(Int32(KC), k), wb)
                src0 = weights.toint() + w_base * Int64(2)  # byte 2W: bf16 and FP8 slabs
                if cutlass.const_expr(tl is not None):
                    timeline.stamp(tl, pc, "load_start")
                for _p in cutlass.range(passes):
                    for rc0 in cutlass.range(0, nrows, RC):
                        nr = cutlass.min(Int32(RC), nrows - rc0)
                        for kc0 in cutlass.range(0, k, KC):
                            kc = cutlass.min(Int32(KC), k - kc0)
                            for t0 in cutlass.range(0, nr, tr):
                                rows = cutlass.min(tr, nr - t0)
                                # the L2 lookahead: this CTA's coming tiles, `window` bytes on
                                # (none built when the spec's l2_window is 0)
                                if cutlass.const_expr(self.window > 0):
                                    f_pc, f_p, f_rc, f_kc, f_t, f_vol = self.prefetch_tiles(
                                        weights, queue, pI, counters, epoch, pc, vol, f_pc,
                                        f_p, f_rc, f_kc, f_t, f_vol)
                                s, _, empty_parity = ring_slot(j, self.S)
                                mbar_wait(mbar + self.S + s, empty_parity)
                                cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, rows * kc * wb)
                                dst = (ring + s * self.stage_elems).toint()  # the stage's byte
                                row0, col0 = Int64(rc0 + t0), Int64(kc0)
                                if kc == k:  # whole rows: the tile is contiguous
                                    d, e = tile_copy(Int32(0), row0, col0, kc, Int64(k))
                                    bulk_g2s(dst + d * wb, src0 + e * Int64(wb), rows * kc * wb,
                                             mbar + s)
                                else:  # a K-chunk: one copy per row (spec.tile_copy)
                                    for r in cutlass.range(rows):
                                        d, e = tile_copy(r, row0, col0, kc, Int64(k))
                                        bulk_g2s(dst + d * wb, src0 + e * Int64(wb), kc * wb,
                                                 mbar + s)
                                j += 1
                                vol = vol + Int64(rows * kc * wb)
                if cutlass.const_expr(tl is not None):
                    timeline.stamp(tl, pc, "load_end")
            pc += 1
            op = record_word(queue, pc, common("OPCODE"))
        # END: publish the tile count (the consumers check it against theirs, check_done)
        cute.make_tensor(mbar + 2 * self.S + 1, cute.make_layout(1))[0] = Int64(j)
        cute.arch.mbarrier_arrive(mbar + 2 * self.S)

    @cute.jit
    def bind(self, op: Int32, queue: cute.Pointer, pc: Int32, w_base: Int64, pI: cute.Pointer):
        """(W, passes) of slab record pc: W and spec.passes, or an expert record's bound slab
        and ceil(live / NO) passes (0: an unbound slot). Only for a record whose dependency wait
        the loader has met (moe.py)."""
        passes = Int32(self.spec.passes)
        wb = w_base
        if cutlass.const_expr(self.moe.on):
            if one_of(op, self.moe.codes):
                wb, live = self.moe.bind_queued(queue, pc, w_base, pI)
                passes = moe_index.passes(live, self.spec.no)
        return wb, passes

    @cute.jit
    def prefetch_tiles(self, weights: cute.Pointer, queue: cute.Pointer, pI: cute.Pointer,
                       counters: cute.Pointer, epoch: Int32, loader_pc: Int32, loader_vol: Int64,
                       pc: Int32, p: Int32, rc0: Int32, kc0: Int32, t0: Int32, vol: Int64):
        """The L2 lookahead of the pipelined build: a second walk over the loader's own tile
        sequence (same records, passes, row chunks, K-chunks and tile rows, as an odometer) that
        issues cp.async.bulk.prefetch.L2 for each tile's bytes (one request for whole rows, one
        per row of a K-chunk) until the bytes it has covered reach the loader's volume
        (`loader_vol`, at its record `loader_pc`) + window. So HBM fetches exactly what the
        loader will copy, in its order, `window` bytes ahead, within slabs and across the
        consumers' waits. The cursor: (record, pass, row chunk start, K-chunk start, tile row,
        covered bytes); returned advanced. It holds at an expert record whose binding is not
        readable yet (`held`), and one it held at that the loader has passed since (unbound: no
        tiles) is behind it: it restarts at the loader's record, never reading a binding the
        consumers may have left. Host mirror: spec.loader_lookahead_plan."""
        KC, RC = self.spec.k_chunk, self.spec.row_chunk
        limit = loader_vol + Int64(self.window)
        if pc < loader_pc:
            pc, p, rc0, kc0, t0, vol = loader_pc, Int32(0), Int32(0), Int32(0), Int32(0), \
                loader_vol
        op = record_word(queue, pc, common("OPCODE"))
        held = self.held(op, counters, queue, pc, loader_pc, epoch)
        more = (vol < limit) & (op != Op.END) & (held == 0)
        while more:
            passes = Int32(0)
            w_base = Int64(0)
            nrows = Int32(0)
            k = Int32(0)
            if one_of(op, self.ops.slab):
                w_base, nrows, k = slab_record(queue, pc)
                w_base, passes = self.bind(op, queue, pc, w_base, pI)
            if passes > 0:
                wb = self.weight_bytes(op)
                tr = self.tile_rows(cutlass.min(Int32(KC), k), wb)
                nr = cutlass.min(Int32(RC), nrows - rc0)
                kc = cutlass.min(Int32(KC), k - kc0)
                rows = cutlass.min(tr, nr - t0)
                if cutlass.const_expr(len(self.fp8_ops) > 0):  # entering an FP8 slab: its scales
                    if (p == 0) & (rc0 == 0) & (kc0 == 0) & (t0 == 0):
                        prefetch_scales(weights, op, self.fp8_ops, self.fp8_chunk, w_base,
                                        record_word(queue, pc, mv("ROW0")), nrows, k, Int32(0),
                                        1)
                src = weights.toint() + slab_byte(w_base, Int64(rc0 + t0), Int64(kc0), Int64(k),
                                                  Int64(wb))
                if kc == k:  # whole rows: one contiguous request (<= one stage)
                    prefetch_l2(src, rows * kc * wb)
                else:
                    for r in cutlass.range(rows):
                        prefetch_l2(src + Int64(r) * Int64(k) * Int64(wb), kc * wb)
                vol = vol + Int64(rows * kc * wb)
                t0 = t0 + tr  # the odometer: tile rows > K-chunks > row chunks > passes
                if t0 >= nr:
                    t0 = Int32(0)
                    kc0 = kc0 + KC
                    if kc0 >= k:
                        kc0 = Int32(0)
                        rc0 = rc0 + RC
                        if rc0 >= nrows:
                            rc0 = Int32(0)
                            p = p + 1
                            if p >= passes:
                                p = Int32(0)
                                pc = pc + 1
            else:  # no slab, or an unbound expert slot: no tiles
                pc = pc + 1
            op = record_word(queue, pc, common("OPCODE"))
            held = self.held(op, counters, queue, pc, loader_pc, epoch)
            more = (vol < limit) & (op != Op.END) & (held == 0)
        return pc, p, rc0, kc0, t0, vol

    @cute.jit
    def held(self, op: Int32, counters: cute.Pointer, queue: cute.Pointer, pc: Int32,
             loader_pc: Int32, epoch: Int32) -> Int32:
        """1 when record pc is an expert record ahead of the loader whose binding is not readable
        yet (its router counter unmet: moe.Experts.bound_yet), else 0."""
        h = Int32(0)
        if cutlass.const_expr(self.moe.on):
            if one_of(op, self.moe.codes):
                if pc > loader_pc:
                    h = 1 - self.moe.bound_yet(op, counters, queue, pc, epoch)
        return h

    # ---- consumer side ------------------------------------------------------------------------
    @cute.jit
    def wait_full(self, mbar: cute.Pointer, j: Int32):
        """Block until tile j is in its stage."""
        s, full_parity, _ = ring_slot(j, self.S)
        mbar_wait(mbar + s, full_parity)

    @cute.jit
    def wait_bound(self, mbar: cute.Pointer, pc: Int32, tidx: Int32):
        """Consumer thread 0 at expert record pc, before it signals: spin (acquire, with the
        watchdog) until the loader has read the record's binding (module docstring)."""
        if tidx == 0:
            word = self.bound_word(mbar).iterator
            pending = Int32(0)
            if cute.arch.load(word, Int32, sem="acquire", scope="cta") <= pc:
                pending = Int32(1)
            if pending != 0:
                t0 = cute.arch.globaltimer()
                while pending != 0:
                    if cute.arch.load(word, Int32, sem="acquire", scope="cta") > pc:
                        pending = Int32(0)
                    elif cute.arch.globaltimer() - t0 > Int64(WAIT_TIMEOUT_NS):
                        cute.arch.inline_ptx("trap;")  # the loader never bound it: fail

    @cute.jit
    def check_done(self, mbar: cute.Pointer, j: Int32):
        """End of the queue (one consumer thread): wait until the loader has reached END and
        trap unless it issued exactly the `j` tiles the consumers read. A mismatch would
        otherwise read wrong tiles silently or leave bulk copies in flight at CTA exit."""
        mbar_wait(mbar + 2 * self.S, Int32(0))
        loaded = cute.make_tensor(mbar + 2 * self.S + 1, cute.make_layout(1))[0]
        if loaded != Int64(j):
            cute.arch.inline_ptx("trap;")  # loader and consumers disagree on the tile sequence

    @cute.jit
    def release(self, mbar: cute.Pointer, j: Int32, lane: Int32):
        """This warp is done reading tile j's stage."""
        s, _, _ = ring_slot(j, self.S)
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(mbar + self.S + s)


@cute.jit
def bulk_g2s(dst: Int32, src: Int64, nbytes: Int32, bar: cute.Pointer):
    """cp.async.bulk global -> shared of `nbytes` (a multiple of 16, both ends 16-byte aligned)
    to shared address `dst`, completing as transaction bytes on mbarrier `bar`."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[{$r0}], [{$r1}], {$r2}, [{$r3}];",
        read_only_args=[dst, src, nbytes, bar.toint()])


@cute.jit
def slab_record(queue: cute.Pointer, pc: Int32):
    """(W, NROWS, K) of slab record pc: the slab's first element in the weight arena, its rows
    and row length (the registry's slab fields, fields.slab_word)."""
    w_base = join64(record_word(queue, pc, slab_word("W_LO")),
                    record_word(queue, pc, slab_word("W_HI")))
    return (w_base, record_word(queue, pc, slab_word("NROWS")),
            record_word(queue, pc, slab_word("K")))


@cute.jit
def prefetch_l2(src: Int64, nbytes: Int32):
    """cp.async.bulk.prefetch.L2 of `nbytes` (a multiple of 16) at global address `src`."""
    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                         read_only_args=[src, nbytes])


@cute.jit
def mbar_wait(bar: cute.Pointer, parity: Int32):
    """mbarrier wait for the phase of `parity`, with the %globaltimer watchdog (module doc)."""
    pending = Int32(1)
    if cute.arch.mbarrier_try_wait(bar, parity):
        pending = Int32(0)
    if pending != 0:
        t0 = cute.arch.globaltimer()
        while pending != 0:
            if cute.arch.mbarrier_try_wait(bar, parity):
                pending = Int32(0)
            elif cute.arch.globaltimer() - t0 > Int64(WAIT_TIMEOUT_NS):
                cute.arch.inline_ptx("trap;")  # a broken ring schedule: fail, do not hang
