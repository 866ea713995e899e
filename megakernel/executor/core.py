"""CPU executor of a megakernel program: rung 2 of the ladder (docs/TESTING.md), for every family.

It runs the encoded int32 records (not the compiler's Python objects) on the same flat buffers the
kernel gets (weight arena, fp32/bf16/int32 arenas, KV cache, persistent state, counters), rounding
to bf16 at the same points, one instruction at a time with torch ops on whole slabs. Each opcode's
semantics is one op function (executor/ops/*.py, registered by opcode name, math from the
reference's layer modules). SMs are interleaved in a seeded random order among those whose next
instruction's wait is met, with the ISA's epoch-relative, wrap-around counter semantics and the
EXIT/EPOCH protocol.

Checks (on by default, `check=False` turns the expensive ones off):
- deadlock: no runnable SM while some queue is unfinished -> `DeadlockError` naming each stuck
  SM, its instruction and the counter value it waits for;
- poisoning: scratch is NaN (tokens_out -1) before every step, and matvec outputs must be finite;
- races: a vector-clock happens-before check on every element read or written. Reading a value
  whose writer is not ordered before the reader by program order and counters, writing over a
  value whose readers or writer are not ordered before the writer, or reading scratch never written
  this step raises `RaceError`. It catches a missing wait whatever the interleaving;
- exactly once: after the step, every scratch element, cache slot and state element was written
  exactly as often as the program's semantics say -> `WriteCountError` otherwise. The expected
  counts follow from the declarations: h once per block plus the embedding; every other scratch
  region a block needs, once per block over the block's own extent; logits, tokens_out once; the
  new KV slots once per cache layer; a recurrent layer's conv window once, its state once
  (recurrent) or at a fold (ReplaySSM), its new ring entries and ring count once.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megakernel import isa
from megakernel.common.finite import NonFiniteError
from megakernel.common.registry import Registry
from megakernel.layers import kind
from megakernel.layers.base import STREAM
from megakernel.layers.frame import needs as frame_needs

__all__ = ["BLOCKED", "Executor", "ExecutorError", "DeadlockError", "RaceError",
           "WriteCountError", "op"]


class ExecutorError(RuntimeError):
    """The program did something the kernel must never do (or the executor was misused)."""


class NonFiniteActivations(ExecutorError, NonFiniteError):
    """A matvec of finite, written inputs overflowed: the model's numbers, not the program."""


class DeadlockError(ExecutorError):
    pass


class RaceError(ExecutorError):
    pass


class WriteCountError(ExecutorError):
    pass


OpFn = Callable[["Executor", dict, int], object]
Stall = Callable[[], str] | None  # what `Executor.stepper` yields: None, or a stall's report
BLOCKED = object()  # an op's return value: it waits on another executor, retry it later
_OPS: Registry[OpFn] = Registry("megakernel.executor.ops", "op function")


def op(name: str) -> Callable[[OpFn], OpFn]:
    """Register the op function of opcode `name` (isa registry name)."""
    return lambda fn: _OPS.add(name, fn)


def _load_ops() -> dict[str, OpFn]:
    return _OPS.load_all()


def _wrap(x: int) -> int:
    """int32 wrap-around."""
    return (x + (1 << 31)) % (1 << 32) - (1 << 31)


@dataclass
class _Track:
    """Happens-before bookkeeping of one tracked buffer (flat)."""

    lw_sm: torch.Tensor  # last writer SM (-1: not written this step)
    lw_pos: torch.Tensor  # its queue position
    lr: torch.Tensor  # [numel, n_sm] last read position per SM since the last write (-1)
    count: torch.Tensor  # writes this step

    @classmethod
    def new(cls, numel: int, n_sm: int) -> _Track:
        return cls(torch.full((numel,), -1, dtype=torch.int32),
                   torch.full((numel,), -1, dtype=torch.int32),
                   torch.full((numel, n_sm), -1, dtype=torch.int32),
                   torch.zeros(numel, dtype=torch.int32))

    def reset(self) -> None:
        self.lw_sm.fill_(-1)
        self.lw_pos.fill_(-1)
        self.lr.fill_(-1)
        self.count.zero_()


class Executor:
    """Holds a program's buffers and runs steps on them."""

    def __init__(self, prog, packed, check: bool = True,  # noqa: ANN001
                 arenas: dict[str, torch.Tensor] | None = None) -> None:
        """`arenas`: run on these CPU tensors (f32, bf16, i32, k, v and optionally state, shaped
        as the kernel gets them) instead of fresh ones; they keep what they hold (lengths, cache),
        so a caller that owns the kernel's arguments can have the executor serve its launch."""
        if packed.layout != prog.layout:
            raise ExecutorError("packed weights do not match the program's weight layout")
        self.ops = _load_ops()
        missing = sorted({isa.spec(i.op).name for i in prog.instrs} - set(self.ops))
        if missing:
            raise ExecutorError(f"the executor has no op function for {', '.join(missing)}")
        self.prog, self.cfg, self.check = prog, prog.cfg, check
        self.eps = self.cfg.rms_norm_eps
        self.vocab_size = self.cfg.vocab_size  # token ids accepted (a TP rank: the whole vocab)
        self.one_plus = prog.header["NORM_KIND"] == 1  # (1 + w) RMSNorm
        b = prog.buffers
        self.records = prog.records()  # [n_sm, Q, 16] int32: what the kernel reads
        self.n_sm = self.records.shape[0]
        self.packed, self.weights = packed, packed.arena
        fresh = {"f32": torch.full((b.f32_numel,), float("nan"), dtype=torch.float32),
                 "bf16": torch.full((b.bf16_numel,), float("nan"), dtype=torch.bfloat16),
                 "i32": torch.zeros(b.i32_numel, dtype=torch.int32),
                 "state": torch.zeros(b.state_numel, dtype=torch.float32),
                 "k": torch.full(b.kv_shape, float("nan"), dtype=torch.bfloat16),
                 "v": torch.full(b.v_shape, float("nan"), dtype=torch.bfloat16)}
        for name, t in (arenas or {}).items():
            want = fresh[name]
            if (t.dtype, tuple(t.shape), t.device.type) != (want.dtype, tuple(want.shape), "cpu") \
                    or not t.is_contiguous():
                raise ExecutorError(f"arena {name}: {t.dtype} {tuple(t.shape)} on {t.device} "
                                    f"given, the program needs a contiguous CPU {want.dtype} "
                                    f"{tuple(want.shape)}")
            fresh[name] = t
        self.f32, self.bf16, self.i32 = fresh["f32"], fresh["bf16"], fresh["i32"]
        self.state, self.k, self.v = fresh["state"], fresh["k"], fresh["v"]
        self._arenas = {"f32": self.f32, "bf16": self.bf16, "i32": self.i32, "state": self.state,
                        "k": self.k.view(-1), "v": self.v.view(-1)}  # flat views, made once
        self.counters = [0] * prog.counter_words()
        self.slab_bytes = {"weights": 0, "expert": 0}  # weight slabs read in the last step
        self.counter_names = [c.name for c in prog.counters]
        self.blocks = {(blk.layer, blk.kind): blk for blk in self.cfg.blocks}
        shape = prog.step_shape()
        for blk in self.cfg.blocks:  # host-written constants: RoPE tables, SSM params, routers
            for name, t in kind(blk.kind).constants(blk, self.cfg, shape).items():
                self.region("f32", name).copy_(t)
        for (name, layer), t in packed.tables.items():
            self.region("f32", name)[b.region_row(name, layer)][: t.numel()].copy_(t)
        if check:
            self.tracks = {k: _Track.new(n, self.n_sm) for k, n in (
                ("f32", b.f32_numel), ("bf16", b.bf16_numel), ("i32", b.i32_numel),
                ("state", b.state_numel), ("k", self.k.numel()), ("v", self.v.numel()))}

    # ---- buffers ------------------------------------------------------------------------------
    def arena_tensor(self, name: str) -> torch.Tensor:
        """The arena tensor itself, as given or made (k and v keep their cache shape)."""
        return {"f32": self.f32, "bf16": self.bf16, "i32": self.i32, "state": self.state,
                "k": self.k, "v": self.v}[name]

    def arena(self, name: str) -> torch.Tensor:
        """A whole arena, flat (the KV caches flattened)."""
        return self._arenas[name]

    def region(self, arena: str, name: str) -> torch.Tensor:
        """A region of an arena as a tensor of its shape (a view)."""
        r = getattr(self.prog.buffers, arena)[name]
        return self.arena(arena)[r.offset : r.offset + r.numel].view(r.shape)

    def state_region(self, layer: int, name: str) -> torch.Tensor:
        return self.prog.buffers.state_view(self.state, layer, name)

    def block(self, d: dict, kind_name: str):  # noqa: ANN201 (models.Block)
        """The block of record `d`'s layer of kind `kind_name`."""
        return self.blocks[d["LAYER"], kind_name]

    @property
    def lengths(self) -> torch.Tensor:
        return self.region("i32", "lengths")

    @property
    def logits(self) -> torch.Tensor:
        """[N, V] fp32 logits of the last step."""
        return self.region("f32", "logits")

    @property
    def tokens_out(self) -> torch.Tensor:
        return self.region("i32", "tokens_out")

    def recurrent_state(self, layer: int) -> torch.Tensor:
        """The state [B, ...] of recurrent layer `layer` (committed state under ReplaySSM)."""
        return self.state_region(layer, "state")

    def load_cache(self, cache) -> None:  # noqa: ANN001 (reference.Cache)
        """Copy a reference cache (bf16 mode) into this executor's arenas (`load_cache`)."""
        load_cache(self.prog, cache, k=self.k, v=self.v, state=self.state, i32=self.i32)

    # ---- access with happens-before checks ------------------------------------------------------
    @staticmethod
    def _view(t: torch.Tensor, off: int, shape: tuple[int, ...], idx) -> torch.Tensor:  # noqa: ANN001
        return t[off : off + math.prod(shape)].view(shape)[idx]

    def _meta(self, buf: str, off: int, shape, idx):  # noqa: ANN001, ANN202
        tr, end = self.tracks[buf], off + math.prod(shape)
        return (tr.lw_sm[off:end].view(shape)[idx], tr.lw_pos[off:end].view(shape)[idx],
                tr.lr[off:end].view(*shape, self.n_sm)[idx], tr.count[off:end].view(shape)[idx])

    def read(self, buf: str, off: int, shape: tuple[int, ...], idx=(),  # noqa: ANN001, ANN201
             scratch: bool = True):
        """Elements `idx` of the [shape] view at `off` of buffer `buf`; `scratch`: they must have
        been written this step (False: persistent data such as caches and states)."""
        data = self._view(self.arena(buf), off, shape, idx)
        if self.check:
            sm, pos = self.cur
            wsm, wpos, lr, _ = self._meta(buf, off, shape, idx)
            written = wsm >= 0
            if scratch and not bool(written.all()):
                raise RaceError(f"SM {sm} {self.cur_desc} reads {buf} elements that were not "
                                f"written this step (offset {off}, shape {shape}, index {idx})")
            self._check_hb(wsm[written], wpos[written], "reads a value written by", buf)
            lr[..., sm] = pos
        return data

    def write(self, buf: str, off: int, shape: tuple[int, ...], idx,  # noqa: ANN001
              value: torch.Tensor) -> None:
        data = self._view(self.arena(buf), off, shape, idx)
        if self.check:
            sm, pos = self.cur
            wsm, wpos, lr, cnt = self._meta(buf, off, shape, idx)
            written = wsm >= 0
            self._check_hb(wsm[written], wpos[written], "overwrites a value written by", buf)
            bad = lr >= self.vc[sm]  # a read not ordered before this write
            bad[..., sm] = False  # this SM's own reads are in program order
            if bool(bad.any()):
                r_sm = int(bad.nonzero()[0][-1])
                r_pos = int(lr[bad].max())
                raise RaceError(
                    f"SM {sm} {self.cur_desc} overwrites {buf} read by SM {r_sm} instruction "
                    f"{r_pos} ({self._desc(r_sm, r_pos)}) without waiting for it")
            wsm.fill_(sm)
            wpos.fill_(pos)
            lr.fill_(-1)
            cnt += 1
        data.copy_(value.to(data.dtype))

    def _check_hb(self, wsm: torch.Tensor, wpos: torch.Tensor, what: str, buf: str) -> None:
        if wsm.numel() == 0:
            return
        sm, _ = self.cur
        bad = self.vc[sm][wsm.long()] <= wpos
        if bool(bad.any()):
            i = int(bad.nonzero()[0][0])
            s2, p2 = int(wsm.reshape(-1)[i]), int(wpos.reshape(-1)[i])
            raise RaceError(f"SM {sm} {self.cur_desc} {what} SM {s2} instruction {p2} "
                            f"({self._desc(s2, p2)}) in {buf} without synchronising with it")

    def _desc(self, sm: int, pos: int) -> str:
        return isa.describe(self.records[sm, pos].tolist())

    # ---- shared arithmetic of the op functions --------------------------------------------------
    def norm_weight(self, off: int, k: int) -> torch.Tensor:
        """A model RMSNorm weight [k] as fp32, in the model's form (w or 1 + w)."""
        w = self.weights[off : off + k].float()
        return 1.0 + w if self.one_plus else w

    def norm_input(self, d: dict) -> torch.Tensor:
        """RMSNorm(h) * w rounded to bf16 -> fp32 [N, K] (the matvec input), or the bf16 input."""
        n, k = self.prog.rows, d["K"]
        if d["NORM_OFF"] < 0:
            return self.read("bf16", d["IN_OFF"], (n, k)).float()
        x = self.read("f32", d["IN_OFF"], (n, k)).float()
        y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.norm_weight(d["NORM_OFF"], k)).to(torch.bfloat16).float()

    def slab(self, d: dict) -> torch.Tensor:
        """The record's weight slab [NROWS, K] as fp32 (bf16, or FP8 codes times their scales),
        its bytes (scales included) counted in `slab_bytes`."""
        cat = "expert" if isa.spec(d["OPCODE"]).kind == "moe" else "weights"  # as bytes.py
        w, nbytes = self.packed.slab(d["W"], d["ROW0"], d["NROWS"], d["K"])
        self.slab_bytes[cat] += nbytes
        return w

    def matvec(self, d: dict) -> torch.Tensor:
        """[N, NROWS] fp32 = the prologue's input times the slab, fp32 accumulation."""
        acc = F.linear(self.norm_input(d), self.slab(d))
        if self.check and not bool(torch.isfinite(acc).all()):
            # unwritten (NaN-poisoned) scratch is a RaceError at its read, so this is the data
            raise NonFiniteActivations(
                f"cpu-executor: non-finite values at the step with sequence lengths "
                f"{getattr(self, '_step_lengths', '?')} ({self.cur_desc}): the model's "
                "activations overflow; check the weights")
        return acc

    # ---- a step -------------------------------------------------------------------------------
    def poison(self) -> None:
        self.prog.buffers.poison_scratch(self.f32, self.bf16)
        self.tokens_out.fill_(-1)

    def step(self, tokens: torch.Tensor | None = None, seed: int = 0) -> torch.Tensor:
        """Run one step; `tokens` [B, T] (None: use tokens_in as left by the previous step).

        Returns tokens_out [B, T] (int64); logits stay in `self.logits`.
        """
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # slab-sized ops: threading costs more than it saves
        try:
            for stall in self.stepper(tokens, seed):
                if stall is not None:
                    raise DeadlockError(stall())
        finally:
            torch.set_num_threads(threads)
        return self.tokens_out.view(self.prog.batch, self.prog.tokens).to(torch.int64)

    def stepper(self, tokens: torch.Tensor | None = None, seed: int = 0) -> Iterator[Stall]:
        """One step as a generator (what `step` runs): yields None after each instruction and,
        when no SM can run, a callable that describes the stall; a group of executors that wait
        on each other (executor/tp.py) interleaves these."""
        p = self.prog
        lengths = self.lengths.tolist()
        self._step_lengths = lengths  # named by a non-finite error
        if tokens is not None:
            tokens = torch.as_tensor(tokens)
            if tuple(tokens.shape) != (p.batch, p.tokens):
                raise ExecutorError(f"tokens must be [{p.batch}, {p.tokens}], "
                                    f"got {tuple(tokens.shape)}")
            self.region("i32", "tokens_in").copy_(tokens.reshape(-1).to(torch.int32))
        toks = self.region("i32", "tokens_in")
        if bool(((toks < 0) | (toks >= self.vocab_size)).any()):
            raise ExecutorError(f"token ids outside [0, {self.vocab_size}): {toks.tolist()}")
        for b, n in enumerate(lengths):
            if n + p.tokens > p.max_seq_len:
                raise ExecutorError(f"sequence {b}: {n} cached + {p.tokens} new tokens exceed "
                                    f"the program's max sequence length {p.max_seq_len}")
        ring_before = (self.region("i32", "ring_count").clone()
                       if "ring_count" in p.buffers.i32 else None)
        self.poison()
        self.slab_bytes = {"weights": 0, "expert": 0}
        if self.check:
            for tr in self.tracks.values():
                tr.reset()
        yield from self._run(seed)
        if self.check:
            self._check_counts(lengths, ring_before)

    def _run(self, seed: int) -> Iterator[Stall]:
        rng = random.Random(seed)
        n = self.n_sm
        epoch = self.counters[isa.EPOCH]
        pcs = [0] * n
        done = [False] * n
        self.vc = [torch.zeros(n, dtype=torch.int32) for _ in range(n)]
        self.cvc: dict[int, torch.Tensor] = {}  # counter -> vector clock of its releases
        recs = self.records.tolist()
        spinning: set[int] = set()  # SMs whose op waits on another executor (BLOCKED)
        retried = True  # every spinning SM tried since the last instruction or stall
        while True:
            runnable = []
            for s in range(n):
                if done[s] or s in spinning:
                    continue
                rec = recs[s][pcs[s]]
                if rec[0] == isa.Op.END:
                    done[s] = True
                    self._exit(epoch)
                    continue
                cid, target, total = rec[1], rec[2], rec[3]
                if cid == isa.NO_COUNTER or _wrap(
                        self.counters[isa.COUNTER_BASE + cid] - (epoch * total + target)) >= 0:
                    runnable.append(s)
            if not runnable:
                if all(done):
                    return
                if not retried:  # try the spinning SMs once more before stalling
                    spinning.clear()
                    retried = True
                    continue
                yield functools.partial(self._deadlock_report, recs, pcs, done, epoch)
                spinning.clear()  # resumed: the others may have moved on
                continue
            s = rng.choice(runnable)
            rec = recs[s][pcs[s]]
            self.cur = (s, pcs[s])
            self.cur_desc = f"instruction {pcs[s]} ({isa.describe(rec)})"
            vc = self.vc[s]
            vc[s] = pcs[s]
            if rec[1] != isa.NO_COUNTER and rec[1] in self.cvc:
                torch.maximum(vc, self.cvc[rec[1]], out=vc)
            d = isa.decode(rec)
            spec = isa.spec(d["OPCODE"])
            if self.ops[spec.name](self, d, epoch) is BLOCKED:
                spinning.add(s)  # retried when this executor is resumed after a stall
                continue
            if d["SIGNAL_CID"] != isa.NO_COUNTER and not spec.ticket:
                self.release(d["SIGNAL_CID"])
            pcs[s] += 1
            retried = not spinning
            yield None

    def release(self, cid: int, acquire: bool = False) -> int:
        """Counter add with release semantics (acq_rel when `acquire`); returns the old value."""
        s, pos = self.cur
        vc = self.vc[s]
        vc[s] = pos + 1
        if cid in self.cvc:
            if acquire:
                torch.maximum(vc, self.cvc[cid], out=vc)
            torch.maximum(self.cvc[cid], vc, out=self.cvc[cid])
        else:
            self.cvc[cid] = vc.clone()
        w = isa.COUNTER_BASE + cid
        old = self.counters[w]
        self.counters[w] = _wrap(old + 1)
        return old

    def last_of(self, old: int, epoch: int, total: int) -> bool:
        """Whether a ticket add that returned `old` was the last of `total` this step."""
        return _wrap(old - (epoch * total + total - 1)) == 0

    def _exit(self, epoch: int) -> None:
        old = self.counters[isa.EXIT]
        self.counters[isa.EXIT] = _wrap(old + 1)
        if _wrap(old - (epoch * self.n_sm + self.n_sm - 1)) == 0:
            self.counters[isa.EPOCH] = _wrap(epoch + 1)

    def _deadlock_report(self, recs, pcs, done, epoch) -> str:  # noqa: ANN001
        lines = ["deadlock: no SM can run its next instruction"]
        for s in range(self.n_sm):
            if done[s]:
                continue
            rec = recs[s][pcs[s]]
            cid, target, total = rec[1], rec[2], rec[3]
            val = self.counters[isa.COUNTER_BASE + cid]
            lines.append(f"  SM {s} at instruction {pcs[s]} {isa.describe(rec)} waits "
                         f"for counter {cid} ({self.counter_names[cid]}) >= "
                         f"{epoch * total + target}, it is {val}")
        return "\n".join(lines)

    # ---- exactly-once check ---------------------------------------------------------------------
    def _check_counts(self, lengths: list[int], ring_before: torch.Tensor | None) -> None:
        p, cfg, b = self.prog, self.cfg, self.prog.buffers
        shape = p.step_shape()
        end = next(i for i in p.instrs if isa.spec(i.op).ends_step)
        flags, n_tiles = end.operands.get("FLAGS", 0), end.operands["N_TILES"]
        expect = {k: torch.zeros_like(t.count) for k, t in self.tracks.items()}

        def add(arena: str, name: str, extent: tuple[int, ...] | None = None, times: int = 1
                ) -> None:
            r = getattr(b, arena)[name]
            idx = tuple(slice(0, e) for e in extent) if extent is not None else ()
            expect[arena][r.offset : r.offset + r.numel].view(r.shape)[idx] += times

        add("f32", "h", times=1 + len(cfg.blocks))  # the embedding, then each block's residual
        add("f32", "logits")
        add("f32", "part_argmax", (n_tiles,))
        add("i32", "tokens_out")
        if flags & isa.FLAG_ADVANCE:
            add("i32", "lengths")
        if flags & isa.FLAG_FEEDBACK:
            add("i32", "tokens_in")
        if p.drafts:
            self._expect_accept(lengths, expect)
        frame = {nd.name for nd in frame_needs(cfg, shape)}
        for blk in cfg.blocks:
            kd = kind(blk.kind)
            for nd in kd.needs(blk, cfg, shape):
                if nd.const or nd.persistent or nd.group == STREAM or nd.name in frame:
                    continue
                r = getattr(b, nd.arena)[nd.name]  # the block's view: the region's start
                expect[nd.arena][r.offset : r.offset + math.prod(nd.shape)] += 1
            if kd.kv_cache:
                self._expect_kv(b.kv_slot[blk.layer], lengths, expect)
            if kd.recurrent:
                self._expect_state(blk, expect, ring_before)
        for k, tr in self.tracks.items():
            bad = tr.count != expect[k]
            if bool(bad.any()):
                i = int(bad.nonzero()[0][0])
                raise WriteCountError(
                    f"{k}[{i}] was written {int(tr.count[i])} times this step, expected "
                    f"{int(expect[k][i])} ({int(bad.sum())} elements differ)")

    def _expect_kv(self, slot: int, lengths: list[int], expect: dict) -> None:
        """The new K/V of cache slot `slot` once: positions lengths[b] .. + T of each sequence,
        or (paged) the page position of every row's non-negative slot_mapping entry."""
        p, paged = self.prog, self.prog.buffers.paged
        for kv in ("k", "v"):
            e = expect[kv].view(getattr(self, kv).shape)
            if paged is None:
                for bi, n0 in enumerate(lengths):
                    e[slot, bi, :, n0 : n0 + p.tokens] = 1
                continue
            for s in self.region("i32", "slot_mapping").tolist():
                if s >= 0:
                    blk, o = divmod(s, paged.block_size)
                    if kv == "k":  # K pages are [D, block_size]
                        e[slot, blk, :, :, o] = 1
                    else:
                        e[slot, blk, :, o] = 1

    def _expect_accept(self, lengths: list[int], expect: dict) -> None:
        """ACCEPT: lengths and emitted once; per sequence with e = emitted > 0 the history at
        positions lengths .. lengths + e and the bonus in tokens_in once; NGRAM: the drafts once."""
        p, b = self.prog, self.prog.buffers
        emitted = self.region("i32", "emitted").tolist()

        def add(name: str, idx) -> None:  # noqa: ANN001
            r = b.i32[name]
            expect["i32"][r.offset : r.offset + r.numel].view(r.shape)[idx] += 1

        add("lengths", slice(None))
        add("emitted", slice(None))
        for i, (n, e) in enumerate(zip(lengths, emitted, strict=True)):
            if e:
                add("history", (i, slice(n, n + e + 1)))
                add("tokens_in", i * p.tokens)
            if p.ngram:
                add("tokens_in", slice(i * p.tokens + 1, (i + 1) * p.tokens))

    def _expect_state(self, blk, expect: dict, ring_before) -> None:  # noqa: ANN001
        """A recurrent layer: conv window once; recurrent: state once; ReplaySSM: the new ring
        entries and the ring count once, the state of a sequence once if it folded (a speculative
        step: after its emitted entries; its pending inputs once)."""
        p, b = self.prog, self.prog.buffers
        regs, st = b.state[blk.layer], expect["state"]
        emitted = self.region("i32", "emitted").tolist() if p.drafts else None

        def mark(name: str, idx=()) -> None:  # noqa: ANN001
            r = regs[name]
            st[r.offset : r.offset + r.numel].view(r.shape)[idx] = 1

        mark("conv")
        if not b.ring_cap:
            mark("state")
            return
        row = b.row("rec", blk.layer)
        units = kind(blk.kind).units(blk.cfg)
        cnt = b.i32["ring_count"]
        expect["i32"][cnt.offset : cnt.offset + cnt.numel].view(cnt.shape)[row, :, :units] = 1
        if p.drafts:
            mark("pending")
        for bi in range(p.batch):
            n0 = int(ring_before[row, bi, 0])
            if n0 + (emitted[bi] if emitted else p.tokens) >= p.replay_window:
                mark("state", bi)
            for name in regs:
                if name not in ("conv", "state", "pending"):
                    mark(name, (bi, slice(n0, n0 + p.tokens)))



def load_cache(prog, cache, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,  # noqa: ANN001
               i32: torch.Tensor) -> None:
    """Copy a reference cache (bf16 mode) into a program's arenas, on whatever device they are:
    the KV caches of the attention and MLA layers, the conv windows, (committed) states,
    ReplaySSM rings and counts, and the lengths. What the first step after a prefill by the
    reference reads (the executor's and the kernel's)."""
    from megakernel.reference.model import layer_kv

    p, b = prog, prog.buffers
    if b.paged is not None:
        raise ExecutorError("a paged program's KV cache is the caller's pages; load_cache "
                            "fills the contiguous cache")
    if cache.replay_window != p.replay_window:
        raise ExecutorError(f"the cache is for replay_window {cache.replay_window}, the "
                            f"program runs replay_window {p.replay_window}")
    if cache.pending is not None:
        raise ExecutorError("the cache has a verified step that is not committed")
    if cache.batch != p.batch:
        raise ExecutorError(f"cache batch {cache.batch} != program batch {p.batch}")
    if cache.max_seq_len > p.max_seq_len:
        raise ExecutorError(f"cache of {cache.max_seq_len} positions does not fit the "
                            f"program's {p.max_seq_len}")

    def region(t: torch.Tensor, r) -> torch.Tensor:  # noqa: ANN001 (buffers.Region)
        return t[r.offset : r.offset + r.numel].view(r.shape)

    for layer, slot in b.kv_slot.items():
        ck, cv = layer_kv(cache.layers[layer])  # [B, heads, S, dims] each
        s = ck.shape[2]
        k[slot, :, :, :s] = ck.to(torch.bfloat16)
        v[slot, :, :, :s] = cv.to(torch.bfloat16)
    for layer, regs in b.state.items():
        c = cache.layers[layer]
        regs_t = {n: region(state, r) for n, r in regs.items()}
        regs_t["conv"].copy_(c.conv)
        regs_t["state"].copy_(c.state)
        if b.ring_cap:
            n = int(c.count.max())
            if n + p.tokens > b.ring_cap:
                raise ExecutorError(f"layer {layer}: {n} ring entries + {p.tokens} do not fit "
                                    f"the program's ring of {b.ring_cap}")
            for name, t in c.ring.items():
                regs_t[name][:, :n] = t[:, :n]
            cnt = region(i32, b.i32["ring_count"])[b.row("rec", layer)]  # [B, units]
            cnt.copy_(c.count[:, None].expand_as(cnt).to(torch.int32))
    region(i32, b.i32["lengths"]).copy_(cache.lengths.to(torch.int32))

