"""The MoE expert handlers' device side (layers/moe.py; index arithmetic in moe_index.py).

EXPERT_GATEUP / EXPERT_DOWN run on the matvec handler (matvec.py) over the rows of their
work-list slot, with their epilogue here (`ExpertEpilogue`); this module binds a record at run
time (`bind`: the slab of the slot's expert and its live pair rows) and maps a pair row to its
activation and expert slot rows (`rows`). MOE_COMBINE is its own handler (`combine`).

Who reads the binding, and when (everyone agrees on the bound W and the passes, so the tiles the
loader streams are the tiles the consumers read, and an unbound slot streams and reads none):
- the consumers, after the record's dependency wait (the router's counter for EXPERT_GATEUP,
  gate/up's for EXPERT_DOWN, which implies the router's);
- the loader warp (pipeline.py) once the binding is the router's: it waits on the layer's router
  counter (`wait_queued`, moe_index.bind_counter), not on the record's own dependency, so a down
  record's slab streams while gate/up runs; the shared expert (static binding) waits on nothing.
  No deadlock: the router's counter never depends on the records after it in a queue;
- the loader's L2 lookahead cursor (Pipeline.prefetch_tiles) enters an expert record the loader
  has not reached once its binding is readable (`bound_yet`, no wait); the global-memory build's
  lookahead (lookahead.Lookahead.extend), which runs before the consumers' wait, stops at an
  expert record and leaves its slab to the demand loads.
The work list is one region for every MoE layer, so a binding must be read before the next MoE
layer's router rewrites it: the consumers leave an expert record only after the loader has read
its binding (Pipeline.wait_bound; an unbound slot has no tiles that would order them), and the
next router waits (through the combine) on every expert record of the layer (the verifier's
binding rule, program/verify.py). So every read of a row, the lookahead's included (it reads only
records ahead of the loader, which the consumers have not passed), precedes its rewrite.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from megakernel import isa
from megakernel.isa import Op
from megakernel.kernel.config.fields import OpTable, common, one_of, shared_word, word
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.device.epilogue import Chunk, Epilogue
from megakernel.kernel.device.handler import Handler, Step
from megakernel.kernel.device.memory import ld, load_f32x8, record_word, st, store_f32x8
from megakernel.kernel.device.sync import spin_counter
from megakernel.kernel.host import moe_index as mi
from megakernel.kernel.host.dense_index import row_major
from megakernel.kernel.host.limits import VEC

EXPERT_OPS = (Op.EXPERT_GATEUP, Op.EXPERT_DOWN)
COMBINE_BATCH = 4  # routed experts' outputs (8 fp32 each) a combine thread loads at once


class Experts(Handler):
    """Run-time binding of the expert slab records and the MOE_COMBINE handler."""

    def __init__(self, spec: KernelSpec):
        ops = OpTable.for_spec(spec)
        self.down = ops.epilogue("moe.ExpertDown")
        self.codes = ops.epilogue("moe.ExpertGateUp") + self.down
        self.on = bool(self.codes)  # the build handles the expert records
        self.N, self.H, self.NO, self.NT = spec.rows, spec.hidden, spec.no, spec.num_threads
        if spec.has("moe"):
            _e, self.top_k, self.I, _g, _tg, shared = spec.constants("moe")[:6]
            self.slots = self.top_k + shared
            self.stride = mi.x_stride(self.I, self.H, spec.quant)
        for name in ("SLOT", "WORK_OFF"):  # read as EXPERT_GATEUP's words for both opcodes
            shared_word(EXPERT_OPS, name)

    @cute.jit
    def run(self, op: Int32, s: Step):  # MOE_COMBINE
        self.combine(s.rec, s.f32, s.i32, s.tidx, self.NT)

    # ---- binding --------------------------------------------------------------------------------
    @cute.jit
    def bind(self, w: Int64, slot: Int32, work_off: Int32, pI: cute.Pointer):
        """(bound W, live pair rows) of an expert record whose dependency wait is met: the shared
        expert (slot -1) keeps W and has every row; a slot's expert x moves W x experts on, an
        unbound slot (x = -1) has no rows."""
        live = Int32(self.N)
        wb = w
        if slot >= 0:
            row = work_off + mi.work_row(slot, self.N)
            x = ld(pI, row)
            live = ld(pI, row + 1)
            if x < 0:
                live = Int32(0)
            wb = mi.bound_w(w, Int64(x), Int64(self.stride), cutlass.max)
        return wb, live

    @cute.jit
    def bind_queued(self, queue: cute.Pointer, pc: Int32, w: Int64, pI: cute.Pointer):
        """`bind` for record pc of a queue in global memory (the loader and its lookahead)."""
        return self.bind(w, record_word(queue, pc, word(Op.EXPERT_GATEUP, "SLOT")),
                         record_word(queue, pc, word(Op.EXPERT_GATEUP, "WORK_OFF")), pI)

    @cute.jit
    def bind_target(self, op: Int32, queue: cute.Pointer, pc: Int32, epoch: Int32):
        """(counter, target) after which record pc's binding is readable: the layer's router
        counter (moe_index.bind_counter), or (-1, 0) for the shared expert (static binding)."""
        down = Int32(0)
        if one_of(op, self.down):
            down = Int32(1)
        cid = mi.bind_counter(down, record_word(queue, pc, common("WAIT_CID")))
        if record_word(queue, pc, word(Op.EXPERT_GATEUP, "SLOT")) < 0:
            cid = Int32(-1)
        return cid, (epoch + 1) * Int32(mi.ROUTER_SIGNALS)

    @cute.jit
    def wait_queued(self, op: Int32, counters: cute.Pointer, queue: cute.Pointer, pc: Int32,
                    epoch: Int32):
        """One thread (the loader): wait until record pc's binding is the router's (`bind_target`;
        not the record's own dependency: a down record's slab needs no gate/up output)."""
        cid, target = self.bind_target(op, queue, pc, epoch)
        spin_counter(counters, cid, target)

    @cute.jit
    def bound_yet(self, op: Int32, counters: cute.Pointer, queue: cute.Pointer, pc: Int32,
                  epoch: Int32) -> Int32:
        """1 when record pc's binding is readable now (the L2 lookahead, which must not wait):
        `bind_target` met (one acquire load), else 0."""
        cid, target = self.bind_target(op, queue, pc, epoch)
        ok = Int32(1)
        if cid >= 0:
            v = cute.arch.load(counters + (cid + isa.COUNTER_BASE), Int32, sem="acquire",
                               scope="gpu")
            if v - target < 0:
                ok = Int32(0)
        return ok

    @cute.jit
    def rows(self, slot: Int32, work_off: Int32, pI: cute.Pointer, i: Int32):
        """Pair row i (< live) of a bound record -> (activation row n, expert slot row q)."""
        n, q = mi.shared_rows(i, self.top_k, self.slots)
        if slot >= 0:
            p = ld(pI, work_off + mi.work_row(slot, self.N) + 2 + i)
            n, q = mi.pair_rows(p, self.top_k, self.slots)
        return n, q

    # ---- MOE_COMBINE ----------------------------------------------------------------------------
    @cute.jit
    def combine(self, rec: cute.Tensor, pF: cute.Pointer, pI: cute.Pointer, tidx: Int32,
                nthreads: int):
        """h[n, cols] += sum over the top_k slots in increasing expert id of w * moe_y[n, s, cols]
        + moe_y[n, top_k, cols] (shared), fp32 in that order; a thread per (row, 8 columns).
        The row's ids and weights are read once and the walk runs on registers, so the global
        loads are the ids, then the routed outputs COMBINE_BATCH at a time."""
        r0, ncols = rec[word(Op.MOE_COMBINE, "ROW0")], rec[word(Op.MOE_COMBINE, "NROWS")]
        y_off, ids_off = rec[word(Op.MOE_COMBINE, "Y_OFF")], rec[word(Op.MOE_COMBINE, "IDS_OFF")]
        wts_off, out_off = rec[word(Op.MOE_COMBINE, "WTS_OFF")], rec[word(Op.MOE_COMBINE,
                                                                           "OUT_OFF")]
        nv = ncols // VEC
        K = self.top_k
        ids = cute.make_rmem_tensor((K,), Int32)
        wts = cute.make_rmem_tensor((K,), cutlass.Float32)
        picks = cute.make_rmem_tensor((K,), Int32)  # the top_k slots in increasing expert id
        order_w = cute.make_rmem_tensor((K,), cutlass.Float32)  # their weights
        for idx in cutlass.range(tidx, self.N * nv, nthreads, unroll=1):
            n = idx // nv
            col = r0 + (idx - n * nv) * VEC
            for s in cutlass.range_constexpr(K):  # the row's ids and weights, loads in flight
                ids[s] = ld(pI, ids_off + n * K + s)
                wts[s] = ld(pF, wts_off + n * K + s)
            prev = Int32(mi.WALK_START[0])
            for r in cutlass.range_constexpr(K):  # the selection walk, on registers
                best = Int32(mi.WALK_START[1])
                picks[r] = Int32(0)
                order_w[r] = wts[0]
                for s in cutlass.range_constexpr(K):
                    if mi.takes(ids[s], prev, best):
                        best = ids[s]
                        picks[r] = Int32(s)
                        order_w[r] = wts[s]
                prev = best
            acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            acc.fill(0.0)
            for rb in cutlass.range_constexpr(0, K, COMBINE_BATCH):  # these y's in flight
                ys = []
                for r in cutlass.range_constexpr(rb, min(rb + COMBINE_BATCH, K)):
                    ys.append(load_f32x8(pF, y_off + (n * self.slots + picks[r]) * self.H + col))
                for r in cutlass.range_constexpr(rb, min(rb + COMBINE_BATCH, K)):
                    acc.store(acc.load() + ys[r - rb] * order_w[r])
            if cutlass.const_expr(self.slots > self.top_k):
                acc.store(acc.load() + load_f32x8(pF, y_off + (n * self.slots + self.top_k)
                                                  * self.H + col))
            a = out_off + n * self.H + col
            store_f32x8(pF, a, load_f32x8(pF, a) + acc.load())


class ExpertEpilogue(Epilogue):
    """The expert records' epilogue, at slot row q of pair row n0 + nn (Experts.rows): gate/up
    -> act_moe[q, (row0 + rc0) / 2 + c] = bf16(silu(gate) * up) (GATEUP's block interleave);
    down -> moe_y[q, row0 + rc0 + r] = acc (fp32)."""

    gate = True

    @cute.jit
    def run(self, op: Int32, c: Chunk):
        gate = self.gate
        cols = c.nr // 2 if gate else c.nr
        for idx in cutlass.range(c.tidx, self.mv.NO * cols, self.mv.NT, unroll=1):
            nn = idx // cols
            col = idx - nn * cols
            if c.n0 + nn < c.live:
                _n, q = self.mv.moe.rows(c.slot, c.work_off, c.i32, c.n0 + nn)
                if cutlass.const_expr(gate):
                    st(c.bf16, c.out_off + row_major(q, (c.row0 + c.rc0) // 2 + col, self.mv.moe.I),
                       self.mv.swiglu(c.sAcc, nn, col, c.ksplit, c.nrp).to(BFloat16))
                else:
                    st(c.f32, c.out_off + row_major(q, c.row0 + c.rc0 + col, self.mv.H),
                       self.mv.acc_value(c.sAcc, nn, col, c.ksplit, c.nrp))


class ExpertGateUp(ExpertEpilogue):
    """EXPERT_GATEUP: bf16(silu(gate) * up) into act_moe."""


class ExpertDown(ExpertEpilogue):
    """EXPERT_DOWN: fp32 into moe_y."""

    gate = False
