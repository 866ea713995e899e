"""CPU executor of a megakernel program: rung 2 of the ladder (DESIGN.md §1).

It runs the encoded int32 records (not the compiler's Python objects) on the same flat buffers the
kernel gets (weight arena, fp32/bf16/int32 arenas, KV cache, counters), rounding to bf16 at the same
points, one instruction at a time with torch ops on whole slabs. SMs are interleaved in a seeded
random order among those whose next instruction's wait is met, with the ISA's epoch-relative,
wrap-around counter semantics and the EXIT/EPOCH protocol.

Checks (on by default, `check=False` turns the expensive ones off):
- deadlock: no runnable SM while some queue is unfinished -> `DeadlockError` naming each stuck
  SM, its instruction and the counter value it waits for;
- poisoning: scratch is NaN (tokens_out -1) before every step, and matvec outputs must be finite;
- races: a vector-clock happens-before check on every element read or written. Reading a value
  whose writer is not ordered before the reader by program order and counters, writing over a
  value whose readers or writer are not ordered before the writer, or reading scratch never written
  this step raises `RaceError`. It catches a missing wait whatever the interleaving;
- exactly once: after the step, every scratch element and KV slot was written exactly as often as
  the program's semantics say (h: 1 + 2L, per-layer buffers: L, outputs: 1, new KV slots: 1,
  everything else 0) -> `WriteCountError` otherwise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megakernel.config import ModelConfig
from megakernel.program import isa
from megakernel.program.compiler import F32_CONSTANTS, Program, compile_program, rope_tables
from megakernel.program.gpus import GPU
from megakernel.program.gpus import gpu as gpu_by_name
from megakernel.program.isa import Op
from megakernel.program.pack import PackedWeights, pack_weights

__all__ = ["Executor", "ExecutorError", "DeadlockError", "RaceError", "WriteCountError",
           "generate"]


class ExecutorError(RuntimeError):
    """The program did something the kernel must never do."""


class DeadlockError(ExecutorError):
    pass


class RaceError(ExecutorError):
    pass


class WriteCountError(ExecutorError):
    pass


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
    """Holds the program's buffers and runs steps on them."""

    f32_constants: tuple[str, ...] = tuple(F32_CONSTANTS)  # fp32 regions kept when poisoning

    def __init__(self, prog: Program, packed: PackedWeights, check: bool = True) -> None:
        if packed.layout != prog.layout:
            raise ExecutorError("packed weights do not match the program's weight layout")
        self.prog = prog
        self.cfg = prog.cfg
        self.check = check
        b = prog.buffers
        self.records = prog.records()  # [n_sm, Q, 16] int32: what the kernel reads
        self.n_sm = self.records.shape[0]
        self.weights = packed.arena
        self.f32 = torch.full((b.f32_numel,), float("nan"), dtype=torch.float32)
        self.bf16 = torch.full((b.bf16_numel,), float("nan"), dtype=torch.bfloat16)
        self.i32 = torch.zeros(b.i32_numel, dtype=torch.int32)
        self.k = torch.full(b.kv_shape, float("nan"), dtype=torch.bfloat16)
        self.v = torch.full(self._v_shape(b), float("nan"), dtype=torch.bfloat16)
        self.counters = [0] * prog.counter_words()
        cos, sin = self._rope_tables()
        self._region("f32", "rope_cos").copy_(cos)
        self._region("f32", "rope_sin").copy_(sin)
        self.counter_names = [c.name for c in prog.counters]
        if check:
            self.tracks = {k: _Track.new(n, self.n_sm) for k, n in self._tracked(b).items()}

    # ---- what a subclass (hybrid_executor.py) changes -------------------------------------------
    @staticmethod
    def _v_shape(b) -> tuple[int, ...]:  # noqa: ANN001 (the buffer plan)
        return b.kv_shape

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.cfg, self.prog.max_seq_len)

    def _tracked(self, b) -> dict[str, int]:  # noqa: ANN001 (the buffer plan)
        """Buffers the race detector and the write counts track: name -> elements."""
        return {"f32": b.f32_numel, "bf16": b.bf16_numel, "i32": b.i32_numel,
                "k": self.k.numel(), "v": self.v.numel()}

    # ---- buffers ------------------------------------------------------------------------------
    def _arena(self, name: str) -> torch.Tensor:
        return {"f32": self.f32, "bf16": self.bf16, "i32": self.i32}[name]

    def _region(self, arena: str, name: str) -> torch.Tensor:
        r = getattr(self.prog.buffers, arena)[name]
        return self._arena(arena)[r.offset : r.offset + r.numel].view(r.shape)

    @property
    def lengths(self) -> torch.Tensor:
        return self._region("i32", "lengths")

    @property
    def logits(self) -> torch.Tensor:
        """[N, V] fp32 logits of the last step."""
        return self._region("f32", "logits")

    @property
    def tokens_out(self) -> torch.Tensor:
        return self._region("i32", "tokens_out")

    def load_cache(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copy a reference cache (bf16 [L, B, Hkv, S, D], S <= S_max) and its lengths."""
        L, B, H, S, D = k.shape
        want = self.prog.buffers.kv_shape
        if (L, B, H, D) != (want[0], want[1], want[2], want[4]) or S > want[3]:
            raise ExecutorError(f"cache shape {tuple(k.shape)} does not fit the program's {want}")
        self.k[:, :, :, :S] = k.to(torch.bfloat16)
        self.v[:, :, :, :S] = v.to(torch.bfloat16)
        self.lengths.copy_(lengths.to(torch.int32))

    # ---- access with happens-before checks ------------------------------------------------------
    def _view(self, t: torch.Tensor, off: int, shape: tuple[int, ...], idx) -> torch.Tensor:  # noqa: ANN001
        n = 1
        for s in shape:
            n *= s
        return t[off : off + n].view(shape)[idx]

    def _meta(self, buf: str, off: int, shape, idx):  # noqa: ANN001, ANN202
        tr = self.tracks[buf]
        return (self._view(tr.lw_sm, off, shape, idx), self._view(tr.lw_pos, off, shape, idx),
                tr.lr[off : off + _numel(shape)].view(*shape, self.n_sm)[idx],
                self._view(tr.count, off, shape, idx))

    def _buf(self, buf: str) -> tuple[torch.Tensor, int]:
        if buf in ("k", "v"):
            return getattr(self, buf).view(-1), 0
        return self._arena(buf), 0

    def read(self, buf: str, off: int, shape: tuple[int, ...], idx=(), scratch: bool = True):  # noqa: ANN001, ANN201
        data = self._view(self._buf(buf)[0], off, shape, idx)
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

    def write(self, buf: str, off: int, shape: tuple[int, ...], idx, value: torch.Tensor) -> None:  # noqa: ANN001
        data = self._view(self._buf(buf)[0], off, shape, idx)
        if self.check:
            sm, pos = self.cur
            wsm, wpos, lr, cnt = self._meta(buf, off, shape, idx)
            written = wsm >= 0
            self._check_hb(wsm[written], wpos[written], "overwrites a value written by", buf)
            vc = self.vc[sm]
            bad = lr >= vc  # a read not ordered before this write
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
        vc = self.vc[sm]
        bad = vc[wsm.long()] <= wpos
        if bool(bad.any()):
            i = int(bad.nonzero()[0][0])
            s2, p2 = int(wsm.reshape(-1)[i]), int(wpos.reshape(-1)[i])
            raise RaceError(f"SM {sm} {self.cur_desc} {what} SM {s2} instruction {p2} "
                            f"({self._desc(s2, p2)}) in {buf} without synchronising with it")

    # record decoding (a subclass running another opcode table overrides these two)
    @staticmethod
    def decode_record(rec: list[int]) -> dict:
        return isa.decode(rec)

    @staticmethod
    def describe_record(rec: list[int]) -> str:
        return isa.describe(rec)

    def _desc(self, sm: int, pos: int) -> str:
        return self.describe_record(self.records[sm, pos].tolist())

    # ---- a step -------------------------------------------------------------------------------
    def poison(self) -> None:
        b = self.prog.buffers
        keep = [b.f32[n] for n in self.f32_constants]
        saved = [self.f32[r.offset : r.offset + r.numel].clone() for r in keep]
        self.f32.fill_(float("nan"))
        for r, s in zip(keep, saved, strict=True):
            self.f32[r.offset : r.offset + r.numel] = s
        self.bf16.fill_(float("nan"))
        self._region("i32", "tokens_out").fill_(-1)

    def step(self, tokens: torch.Tensor | None = None, seed: int = 0) -> torch.Tensor:
        """Run one step; `tokens` [B, T] (None: use tokens_in as left by the previous step).

        Returns tokens_out [B, T] (int64); logits stay in `self.logits`.
        """
        p = self.prog
        lengths = self.lengths.tolist()
        if tokens is not None:
            tokens = torch.as_tensor(tokens)
            if tuple(tokens.shape) != (p.batch, p.tokens):
                raise ExecutorError(f"tokens must be [{p.batch}, {p.tokens}], "
                                    f"got {tuple(tokens.shape)}")
            self._region("i32", "tokens_in").copy_(tokens.reshape(-1).to(torch.int32))
        toks = self._region("i32", "tokens_in")
        if bool(((toks < 0) | (toks >= self.cfg.vocab_size)).any()):
            raise ExecutorError(f"token ids outside [0, {self.cfg.vocab_size}): {toks.tolist()}")
        for b, n in enumerate(lengths):
            if n + p.tokens > p.max_seq_len:
                raise ExecutorError(f"sequence {b}: {n} cached + {p.tokens} new tokens exceed "
                                    f"the program's max sequence length {p.max_seq_len}")
        self.poison()
        if self.check:
            for tr in self.tracks.values():
                tr.reset()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # slab-sized ops: threading costs more than it saves
        try:
            self._run(seed)
        finally:
            torch.set_num_threads(threads)
        if self.check:
            self._check_counts(lengths)
        return self.tokens_out.view(p.batch, p.tokens).to(torch.int64)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        n = self.n_sm
        epoch = self.counters[isa.EPOCH]
        pcs = [0] * n
        done = [False] * n
        self.vc = [torch.zeros(n, dtype=torch.int32) for _ in range(n)]
        self.cvc = {}  # counter -> vector clock of its releases
        recs = self.records.tolist()
        while True:
            runnable = []
            for s in range(n):
                if done[s]:
                    continue
                rec = recs[s][pcs[s]]
                if rec[0] == Op.END:
                    done[s] = True
                    self._exit(s, epoch)
                    continue
                cid, target, total = rec[1], rec[2], rec[3]
                if cid == isa.NO_COUNTER or _wrap(
                        self.counters[isa.COUNTER_BASE + cid] - (epoch * total + target)) >= 0:
                    runnable.append(s)
            if not runnable:
                if all(done):
                    return
                raise DeadlockError(self._deadlock_report(recs, pcs, done, epoch))
            s = rng.choice(runnable)
            rec = recs[s][pcs[s]]
            self.cur = (s, pcs[s])
            self.cur_desc = f"instruction {pcs[s]} ({self.describe_record(rec)})"
            vc = self.vc[s]
            vc[s] = pcs[s]
            if rec[1] != isa.NO_COUNTER and rec[1] in self.cvc:
                torch.maximum(vc, self.cvc[rec[1]], out=vc)
            self._exec(self.decode_record(rec), epoch)
            pcs[s] += 1

    def _release(self, cid: int, acquire: bool = False) -> int:
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

    def _exit(self, s: int, epoch: int) -> None:
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
            lines.append(f"  SM {s} at instruction {pcs[s]} {self.describe_record(rec)} waits "
                         f"for counter {cid} ({self.counter_names[cid]}) >= "
                         f"{epoch * total + target}, it is {val}")
        return "\n".join(lines)

    # ---- instruction semantics -------------------------------------------------------------------
    def _exec(self, d: dict, epoch: int) -> None:
        op = d["OPCODE"]
        getattr(self, f"_op_{op.name.lower()}")(d, epoch)
        if d["SIGNAL_CID"] != isa.NO_COUNTER and op != Op.ATTN_PARTIAL:
            self._release(d["SIGNAL_CID"])

    def _norm_input(self, d: dict) -> torch.Tensor:
        """RMSNorm(h) * w rounded to bf16 -> fp32 [N, K] (the matvec input), or the bf16 input."""
        n, k = self.prog.rows, d["K"]
        if d["NORM_OFF"] < 0:
            return self.read("bf16", d["IN_OFF"], (n, k)).float()
        x = self.read("f32", d["IN_OFF"], (n, k)).float()
        w = self.weights[d["NORM_OFF"] : d["NORM_OFF"] + k].float()
        y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.cfg.rms_norm_eps) * w
        return y.to(torch.bfloat16).float()

    def _matvec(self, d: dict) -> torch.Tensor:
        x = self._norm_input(d)
        w = self.weights[d["W"] : d["W"] + d["NROWS"] * d["K"]].view(d["NROWS"], d["K"])
        acc = F.linear(x, w.float())  # [N, NROWS] fp32
        if self.check and not bool(torch.isfinite(acc).all()):
            raise ExecutorError(f"{self.cur_desc}: non-finite matvec output (poisoned input?)")
        return acc

    def _op_embed(self, d: dict, epoch: int) -> None:
        n0, n1, k = d["N0"], d["N1"], d["K"]
        toks = self.read("i32", d["TOK_OFF"], (self.prog.rows,), slice(n0, n1), scratch=False)
        emb = self.weights[d["W"] : d["W"] + self.cfg.vocab_size * k].view(-1, k)
        self.write("f32", d["OUT_OFF"], (self.prog.rows, k), slice(n0, n1),
                   emb[toks.long()].float())

    def _op_qkv(self, d: dict, epoch: int) -> None:
        c, p = self.cfg, self.prog
        n, t_, dh, g = p.rows, p.tokens, c.head_dim, c.group_size
        acc = self._matvec(d).view(n, -1, dh)  # [N, heads, D]
        lengths = self.read("i32", p.buffers.i32["lengths"].offset, (p.batch,), scratch=False)
        pos = (lengths.long()[:, None] + torch.arange(t_)).reshape(-1)  # [N]
        half = dh // 2
        cos_h = self.f32[d["ROPE_OFF"] : d["ROPE_OFF"] + p.max_seq_len * half].view(-1, half)
        so = d["ROPE_OFF"] + p.max_seq_len * half
        sin_h = self.f32[so : so + p.max_seq_len * half].view(-1, half)
        cos = torch.cat((cos_h[pos], cos_h[pos]), dim=-1)  # [N, D]
        sin = torch.cat((sin_h[pos], sin_h[pos]), dim=-1)
        slot0 = d["ROW0"] // dh
        layer = d["LAYER"]
        kv = p.buffers.kv_shape
        for j in range(acc.shape[1]):
            slot = slot0 + j
            grp, jj = divmod(slot, g + 2)
            x = acc[:, j]  # [N, D]
            if jj <= g:  # q or k: qk-norm, RoPE
                if d["QK_NORM_OFF"] >= 0:
                    wo = d["QK_NORM_OFF"] + (0 if jj < g else dh)
                    w = self.weights[wo : wo + dh].float()
                    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w
                x = x * cos + torch.cat((-x[:, half:], x[:, :half]), dim=-1) * sin
            if jj < g:
                head = grp * g + jj
                self.write("bf16", d["OUT_OFF"], (n, c.num_heads, dh), (slice(None), head), x)
            else:
                buf = "k" if jj == g else "v"
                for row in range(n):
                    b = row // t_
                    idx = (layer, b, grp, int(pos[row]))
                    self.write(buf, 0, kv, idx, x[row])

    def _op_attn_partial(self, d: dict, epoch: int) -> None:
        c, p = self.cfg, self.prog
        n, t_, dh, g, hq = p.rows, p.tokens, c.head_dim, c.group_size, c.num_heads
        b, grp, s, ns, layer = d["B_IDX"], d["KV_HEAD"], d["SPLIT"], d["N_SPLITS"], d["LAYER"]
        length = int(self.read("i32", d["LEN_OFF"], (p.batch,), b, scratch=False))
        ctx = length + t_
        k0, k1 = s * ctx // ns, (s + 1) * ctx // ns
        rows = slice(b * t_, (b + 1) * t_)
        heads = slice(grp * g, (grp + 1) * g)
        q = self.read("bf16", d["Q_OFF"], (n, hq, dh), (rows, heads)).float()  # [T, G, D]
        kv = p.buffers.kv_shape
        mid = min(max(k0, length), k1)  # keys below `length` are from earlier steps
        kk = torch.cat((
            self.read("k", 0, kv, (layer, b, grp, slice(k0, mid)), scratch=False),
            self.read("k", 0, kv, (layer, b, grp, slice(mid, k1))))).float()
        vv = torch.cat((
            self.read("v", 0, kv, (layer, b, grp, slice(k0, mid)), scratch=False),
            self.read("v", 0, kv, (layer, b, grp, slice(mid, k1))))).float()
        scores = torch.einsum("tgd,sd->tgs", q, kk) * dh**-0.5  # [T, G, nk]
        qpos = length + torch.arange(t_)
        visible = torch.arange(k0, k1)[None, :] <= qpos[:, None]  # [T, nk]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        m = scores.amax(dim=-1) if k1 > k0 else torch.full((t_, g), float("-inf"))
        safe_m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        pr = torch.exp(scores - safe_m[..., None])  # exp(-inf) = 0 for masked keys
        l_ = pr.sum(-1)
        o = torch.einsum("tgs,sd->tgd", pr, vv)
        self.write("f32", d["PO_OFF"], (ns, n, hq, dh), (s, rows, heads), o)
        self.write("f32", d["PML_OFF"], (ns, n, hq, 2), (s, rows, heads),
                   torch.stack((m, l_), dim=-1))
        old = self._release(d["SIGNAL_CID"], acquire=True)  # the (b, g) ticket
        if _wrap(old - (epoch * ns + ns - 1)) != 0:
            return
        # the last split of (b, grp): merge splits 0..S-1 in order
        po = self.read("f32", d["PO_OFF"], (ns, n, hq, dh), (slice(None), rows, heads))
        pml = self.read("f32", d["PML_OFF"], (ns, n, hq, 2), (slice(None), rows, heads))
        ms, ls = pml[..., 0], pml[..., 1]  # [S, T, G]
        big = ms.amax(dim=0)
        wgt = torch.exp(ms - big)  # [S, T, G]; 0 for empty splits
        out = (po * wgt[..., None]).sum(0) / (ls * wgt).sum(0)[..., None]  # [T, G, D]
        self.write("bf16", d["OUT_OFF"], (n, hq, dh), (rows, heads), out)
        self._release(d["DONE_CID"])

    def _op_oproj(self, d: dict, epoch: int) -> None:
        self._residual(d)

    def _op_down(self, d: dict, epoch: int) -> None:
        self._residual(d)

    def _residual(self, d: dict) -> None:
        acc = self._matvec(d)
        n, h = self.prog.rows, self.cfg.hidden_size
        cols = (slice(None), slice(d["ROW0"], d["ROW0"] + d["NROWS"]))
        cur = self.read("f32", d["OUT_OFF"], (n, h), cols)
        self.write("f32", d["OUT_OFF"], (n, h), cols, cur + acc)

    def _op_gateup(self, d: dict, epoch: int) -> None:
        acc = self._matvec(d)  # [N, NROWS], blocks of [gate 16 | up 16]
        n = self.prog.rows
        blk = acc.view(n, -1, 2, isa.GATEUP_BLOCK)
        act = (F.silu(blk[:, :, 0]) * blk[:, :, 1]).reshape(n, -1)
        c0 = d["ROW0"] // 2
        self.write("bf16", d["OUT_OFF"], (n, self.cfg.intermediate_size),
                   (slice(None), slice(c0, c0 + d["NROWS"] // 2)), act)

    def _op_lmhead(self, d: dict, epoch: int) -> None:
        acc = self._matvec(d)
        n, v = self.prog.rows, self.cfg.vocab_size
        r0 = d["ROW0"]
        self.write("f32", d["OUT_OFF"], (n, v), (slice(None), slice(r0, r0 + d["NROWS"])), acc)
        best, idx = acc.max(dim=-1)  # first index of the max
        nt = self.prog.num_sms
        self.write("f32", d["PARG_OFF"], (nt, n, 2), d["TILE"],
                   torch.stack((best, (idx + r0).float()), dim=-1))

    def _op_argmax(self, d: dict, epoch: int) -> None:
        p = self.prog
        n, nt = p.rows, d["N_TILES"]
        parg = self.read("f32", d["PARG_OFF"], (p.num_sms, n, 2), slice(0, nt))  # [nt, N, 2]
        vals, idxs = parg[..., 0], parg[..., 1]
        best = vals.amax(dim=0)
        cand = torch.where(vals == best, idxs, torch.full_like(idxs, float("inf")))
        tok = cand.amin(dim=0).to(torch.int32)  # lowest index among equal maxima
        self.write("i32", d["OUT_OFF"], (n,), slice(None), tok)
        if d["FLAGS"] & isa.FLAG_ADVANCE:
            ln = self.read("i32", d["LEN_OFF"], (p.batch,), slice(None), scratch=False)
            self.write("i32", d["LEN_OFF"], (p.batch,), slice(None), ln + p.tokens)
        if d["FLAGS"] & isa.FLAG_FEEDBACK:
            self.write("i32", d["TOK_OFF"], (n,), slice(None), tok)

    # ---- exactly-once check ---------------------------------------------------------------------
    def _check_counts(self, lengths: list[int]) -> None:
        p, c, b = self.prog, self.cfg, self.prog.buffers
        L = c.num_layers
        argmax = next(i for i in p.instrs if i.op == Op.ARGMAX)
        flags = argmax.operands["FLAGS"]
        n_tiles = argmax.operands["N_TILES"]
        expect = {k: torch.zeros_like(t.count) for k, t in self.tracks.items()}

        def put(arena: str, name: str, times: int, idx=()) -> None:  # noqa: ANN001
            r = getattr(b, arena)[name]
            expect[arena][r.offset : r.offset + r.numel].view(r.shape)[idx] = times

        put("f32", "h", 1 + 2 * L)
        put("f32", "part_o", L)
        put("f32", "part_ml", L)
        put("f32", "logits", 1)
        put("f32", "part_argmax", 1, slice(0, n_tiles))
        put("bf16", "q", L)
        put("bf16", "attn", L)
        put("bf16", "act", L)
        put("i32", "tokens_out", 1)
        if flags & isa.FLAG_ADVANCE:
            put("i32", "lengths", 1)
        if flags & isa.FLAG_FEEDBACK:
            put("i32", "tokens_in", 1)
        for kv in ("k", "v"):
            e = expect[kv].view(b.kv_shape)
            for bi, n0 in enumerate(lengths):
                e[:, bi, :, n0 : n0 + p.tokens] = 1
        self._compare_write_counts(expect)

    def _compare_write_counts(self, expect: dict[str, torch.Tensor]) -> None:
        """Raise WriteCountError unless every tracked element was written `expect` times."""
        for k, tr in self.tracks.items():
            bad = tr.count != expect[k]
            if bool(bad.any()):
                i = int(bad.nonzero()[0][0])
                raise WriteCountError(
                    f"{k}[{i}] was written {int(tr.count[i])} times this step, expected "
                    f"{int(expect[k][i])} ({int(bad.sum())} elements differ)")


def _numel(shape) -> int:  # noqa: ANN001
    n = 1
    for s in shape:
        n *= s
    return n


# ---- generation (the "cpu-executor" backend) ----------------------------------------------------
DEFAULT_SMS = 8  # SMs of the description the CPU backend compiles for (fewer = faster on a CPU)


def executor_gpu(num_sms: int = DEFAULT_SMS, base: str = "h100") -> GPU:
    return gpu_by_name(base).with_sms(num_sms)


def generate(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    prompts: list[list[int]],
    steps: int,
    max_seq_len: int | None = None,
    seed: int = 0,
    num_sms: int = DEFAULT_SMS,
    check: bool = True,
) -> list[list[int]]:
    """Greedy generation like `reference.generate`, decode steps run by the program.

    The prompt is prefilled by the reference in "bf16" mode (its cache is used as is); every
    decode step is one program step, and since the program feeds its own tokens back and advances
    the lengths, the host only reads tokens_out between steps.
    """
    from reference.model import ReferenceModel, greedy

    if steps < 0:
        raise ExecutorError(f"steps must be >= 0, got {steps}")
    if not prompts:
        raise ExecutorError("no prompts given")
    if steps == 0:
        return [[] for _ in prompts]
    if max_seq_len is None:
        max_seq_len = max(len(p) for p in prompts) + steps - 1
    ref = ReferenceModel(cfg, weights, mode="bf16")
    cache = ref.new_cache(len(prompts), max_seq_len)
    first = greedy(ref.prefill(cache, prompts))  # [B]
    out = [first]
    if steps > 1:
        prog = compile_program(cfg, len(prompts), executor_gpu(num_sms), tokens=1,
                               max_seq_len=max_seq_len)
        ex = Executor(prog, pack_weights(cfg, weights), check=check)
        ex.load_cache(cache.k, cache.v, cache.lengths)
        tok = ex.step(first[:, None], seed=seed)
        out.append(tok[:, 0])
        for i in range(steps - 2):
            tok = ex.step(None, seed=seed + 1 + i)
            out.append(tok[:, 0])
    return torch.stack(out, dim=1).tolist()
