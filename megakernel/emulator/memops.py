"""Decoders of the instructions that touch the machine: loads and stores by state space,
atomics, warp collectives (shfl.sync, vote.sync, bar.warp.sync), CTA barriers, mbarriers, bulk
copies and mma.sync. Each `op_<name>(dec, ins, index)` returns a closure as in decode.py; memory
and synchronisation state live in machine.py (`w.emu`, `w.cta`)."""

from __future__ import annotations

import numpy as np

from megakernel.emulator.decode import (
    ALL,
    BLOCK,
    LANES,
    NONE,
    NP,
    UINT,
    YIELD,
    Decoder,
    Fn,
    _type_of,
)
from megakernel.emulator.errors import UnsupportedForm
from megakernel.emulator.ptx import Instr

_SPACES = {"global": "global", "shared": "shared", "shared::cta": "shared",
           "shared::cluster": "shared", "param": "param"}


def _space(parts: tuple[str, ...]) -> str:
    for p in parts:
        if p in _SPACES:
            return _SPACES[p]
    raise UnsupportedForm("generic addressing (no state space)")


def _vec(parts: tuple[str, ...]) -> int:
    for p in parts:
        if p in ("v2", "v4", "v8"):
            return int(p[1])
    return 1


def address(dec: Decoder, op, ins: Instr) -> Fn:  # noqa: ANN001
    """w -> the 64-bit address of a [base + offset] operand on all 32 lanes."""
    if op[0] != "mem":
        raise UnsupportedForm(f"expected an address, got {op!r}")
    base, off = op[1], np.uint64(op[2] & (2**64 - 1))
    r = dec.reader(base, "u64", dec_ins(ins))
    if off == 0:
        return r
    return lambda w: r(w) + off


def dec_ins(ins: Instr) -> Instr:
    return ins


def _active(w) -> np.ndarray:  # noqa: ANN001
    return ALL if w.m is None else w.m


def _dest_writers(dec: Decoder, op, ty: str, ins: Instr) -> list:  # noqa: ANN001
    ops = op[1] if op[0] == "vec" else [op]
    return [dec.writer(x, ty, ins) for x in ops]


def _src_readers(dec: Decoder, op, ty: str, ins: Instr) -> list:  # noqa: ANN001
    ops = op[1] if op[0] == "vec" else [op]
    return [dec.reader(x, ty, ins) for x in ops]


# ---- loads and stores ---------------------------------------------------------------------------
def op_ld(dec: Decoder, ins: Instr, index: int) -> Fn:
    p = ins.parts
    space, n, ty = _space(p), _vec(p), _type_of(p)
    esize = np.dtype(NP[ty]).itemsize
    d, a = ins.operands
    if space == "param":
        pname = a[1][1]
        if pname not in dec.param_index:
            raise UnsupportedForm(f"unknown parameter {pname}")
        pi = dec.param_index[pname]
        wd = dec.writer(d, ty, ins)
        return lambda w: wd(w, w.emu.param_vals[pi].astype(NP[ty]))
    ws = _dest_writers(dec, d, ty, ins)
    if len(ws) != n:
        raise UnsupportedForm("vector width and destination count differ")
    addr = address(dec, a, ins)
    acquire = "acquire" in p or "volatile" in p or "relaxed" in p

    def ld(w):  # noqa: ANN001, ANN202
        act = _active(w)
        vals = w.emu.load(w, ins, space, addr(w)[act], esize, n)
        out = np.zeros((LANES, n), UINT[esize])
        out[act] = vals
        for i, wr in enumerate(ws):
            wr(w, out[:, i].view(NP[ty]))
        if acquire:
            w.polled = True
        return None

    return ld


def op_st(dec: Decoder, ins: Instr, index: int) -> Fn:
    p = ins.parts
    space, n, ty = _space(p), _vec(p), _type_of(p)
    esize = np.dtype(NP[ty]).itemsize
    a, s = ins.operands
    rs = _src_readers(dec, s, ty, ins)
    if len(rs) != n:
        raise UnsupportedForm("vector width and source count differ")
    addr = address(dec, a, ins)
    u = UINT[esize]

    publishes = _publishes(p)

    def st(w):  # noqa: ANN001, ANN202
        act = _active(w)
        vals = np.stack([np.asarray(r(w)).view(u) for r in rs], axis=1)[act]
        w.emu.store(w, ins, space, addr(w)[act], esize, vals)
        if publishes and act.any():
            w.emu.releaser = w
        return None

    return st


_ATOM = {"add": np.add, "max": np.maximum, "min": np.minimum, "and": np.bitwise_and,
         "or": np.bitwise_or, "xor": np.bitwise_xor}


def _publishes(parts: tuple[str, ...]) -> bool:
    """A release wider than the CTA (st.release, red.release, atom.acq_rel; .gpu is the default
    scope): another CTA may act on it, so the scheduler may stall the releasing warp's siblings
    right after (machine.stall)."""
    return ("release" in parts or "acq_rel" in parts) and "cta" not in parts  # default: .gpu


def _atomic(dec: Decoder, ins: Instr, returns: bool) -> Fn:
    p = ins.parts
    space, ty = _space(p), _type_of(p)
    op = next((x for x in p if x in _ATOM or x in ("exch", "cas", "inc", "dec")), None)
    if op is None or op in ("inc", "dec"):
        raise UnsupportedForm(f"atomic operation of {ins.form}")
    ops = ins.operands
    wd = dec.writer(ops[0], ty, ins) if returns else None
    a = ops[1] if returns else ops[0]
    addr = address(dec, a, ins)
    rb = dec.reader(ops[2] if returns else ops[1], ty, ins)
    rc = dec.reader(ops[3], ty, ins) if op == "cas" else None
    esize = np.dtype(NP[ty]).itemsize
    dt = np.dtype(NP[ty])
    publishes = _publishes(p)

    def atom(w):  # noqa: ANN001, ANN202
        act = _active(w)
        if publishes and act.any():
            w.emu.releaser = w
        ad, b = addr(w), rb(w)
        c = rc(w) if rc is not None else None
        old = np.zeros(LANES, dt)
        for lane in np.nonzero(act)[0]:  # lanes in order: one atomic after another
            cur = w.emu.load(w, ins, space, ad[lane:lane + 1], esize, 1).view(dt)[0, 0]
            old[lane] = cur
            if op == "exch":
                new = b[lane]
            elif op == "cas":
                new = c[lane] if cur == b[lane] else cur
            else:
                new = _ATOM[op](np.array([cur], dt), np.array([b[lane]], dt))[0]
            w.emu.store(w, ins, space, ad[lane:lane + 1], esize,
                        np.array([[new]], dt).view(UINT[esize]))
        if wd is not None:
            wd(w, old)
        return None

    return atom


def op_atom(dec: Decoder, ins: Instr, index: int) -> Fn:
    return _atomic(dec, ins, True)


def op_red(dec: Decoder, ins: Instr, index: int) -> Fn:
    return _atomic(dec, ins, False)


# ---- warp collectives ---------------------------------------------------------------------------
def _members(mask: np.ndarray) -> np.ndarray:
    m = int(mask[0]) & 0xFFFFFFFF
    return ((m >> np.arange(LANES)) & 1).astype(bool)


def op_shfl(dec: Decoder, ins: Instr, index: int) -> Fn:
    p = ins.parts
    mode = p[2]
    if p[1] != "sync" or mode not in ("bfly", "idx", "up", "down"):
        raise UnsupportedForm(ins.form)
    d, a, b, c, mask = ins.operands
    if d[0] == "reg" and "|" in d[1]:
        raise UnsupportedForm("shfl with a predicate destination")
    wd = dec.writer(d, "b32", ins)
    ra, rb, rc = (dec.reader(x, "u32", ins) for x in (a, b, c))
    rm = dec.reader(mask, "u32", ins)
    lanes = np.arange(LANES, dtype=np.int64)

    def shfl(w):  # noqa: ANN001, ANN202
        mem = _members(rm(w))
        if not w.collective(mem, ins):
            return BLOCK
        bb, cc = rb(w).astype(np.int64), rc(w).astype(np.int64)
        clamp, seg = cc & 31, (cc >> 8) & 31
        lo = lanes & seg
        hi = lo | (clamp & ~seg)
        if mode == "idx":
            j = lo | (bb & ~seg)
            ok = j <= hi
        elif mode == "bfly":
            j = lanes ^ bb
            ok = j <= hi
        elif mode == "up":
            j = lanes - bb
            ok = j >= lo
        else:
            j = lanes + bb
            ok = j <= hi
        j = np.where(ok, j, lanes) & 31
        wd(w, ra(w)[j])
        return None

    return shfl


def op_vote(dec: Decoder, ins: Instr, index: int) -> Fn:
    p = ins.parts
    if p[1:3] != ("sync", "ballot"):
        raise UnsupportedForm(ins.form)
    d, pr, mask = ins.operands
    wd = dec.writer(d, "b32", ins)
    rp = dec.reader(pr, "pred", ins)
    rm = dec.reader(mask, "u32", ins)
    weights = (np.uint64(1) << np.arange(LANES, dtype=np.uint64))

    def vote(w):  # noqa: ANN001, ANN202
        mem = _members(rm(w))
        if not w.collective(mem, ins):
            return BLOCK
        bits = int((weights * (rp(w) & _active(w) & mem)).sum())
        wd(w, np.full(LANES, bits, np.uint32))
        return None

    return vote


def op_bar(dec: Decoder, ins: Instr, index: int) -> Fn:
    p = ins.parts
    if p[1] == "warp" and p[2] == "sync":
        rm = dec.reader(ins.operands[0], "u32", ins)

        def warp_sync(w):  # noqa: ANN001, ANN202
            return None if w.collective(_members(rm(w)), ins) else BLOCK

        return warp_sync
    if p[1:] not in (("sync",), ("cta", "sync"), ("sync", "aligned")):
        raise UnsupportedForm(ins.form)
    rid = dec.reader(ins.operands[0], "u32", ins)
    rcount = dec.reader(ins.operands[1], "u32", ins) if len(ins.operands) > 1 else None

    def bar(w):  # noqa: ANN001, ANN202
        bid = int(rid(w)[0])
        count = int(rcount(w)[0]) if rcount is not None else None
        return w.cta.barrier(w, ins, bid, count)

    return bar


def op_barrier(dec: Decoder, ins: Instr, index: int) -> Fn:
    return op_bar(dec, ins, index)


# ---- mbarriers and bulk copies ------------------------------------------------------------------
def op_mbarrier(dec: Decoder, ins: Instr, index: int) -> Fn:
    p = ins.parts
    what = p[1]
    o = ins.operands
    if what == "init":
        addr = address(dec, o[0], ins)
        rc = dec.reader(o[1], "u32", ins)

        def init(w):  # noqa: ANN001, ANN202
            act = _active(w)
            ad, c = addr(w), rc(w)
            for lane in np.nonzero(act)[0]:
                w.cta.mbar_init(w, ins, int(ad[lane]), int(c[lane]))
            return None

        return init
    if what == "arrive":
        expect = "expect_tx" in p
        if "noComplete" in p or "release" in p and "cluster" in p:
            raise UnsupportedForm(ins.form)
        wd = dec.writer(o[0], "b64", ins)
        addr = address(dec, o[1], ins)
        rn = dec.reader(o[2], "u32", ins) if len(o) > 2 else None

        def arrive(w):  # noqa: ANN001, ANN202
            act = _active(w)
            ad = addr(w)
            n = rn(w) if rn is not None else None
            for lane in np.nonzero(act)[0]:
                a = int(ad[lane])
                if expect:
                    w.cta.mbar_tx(w, ins, a, int(n[lane]))
                    w.cta.mbar_arrive(w, ins, a, 1)
                else:
                    w.cta.mbar_arrive(w, ins, a, 1 if n is None else int(n[lane]))
            wd(w, np.zeros(LANES, np.uint64))
            return None

        return arrive
    if what in ("try_wait", "test_wait"):
        if "parity" not in p:
            raise UnsupportedForm("mbarrier wait on a state token")
        wd = dec.writer(o[0], "pred", ins)
        addr = address(dec, o[1], ins)
        rpar = dec.reader(o[2], "u32", ins)

        def wait(w):  # noqa: ANN001, ANN202
            act = _active(w)
            ad, par = addr(w), rpar(w)
            a0, p0 = ad[act], par[act] & 1
            if (a0 == a0[0]).all() and (p0 == p0[0]).all():  # one barrier, one parity
                one = w.cta.mbar_done(w, ins, int(a0[0]), int(p0[0]))
                wd(w, ALL if one else NONE)
                if one:
                    return None
                w.waiting_on = f"mbarrier at shared 0x{int(a0[0]):x}"
                return YIELD
            done = np.zeros(LANES, bool)
            for lane in np.nonzero(act)[0]:
                done[lane] = w.cta.mbar_done(w, ins, int(ad[lane]), int(par[lane]) & 1)
            wd(w, done)
            if not done[act].all():
                w.waiting_on = f"mbarrier at shared 0x{int(ad[act][0]):x}"
                return YIELD
            return None

        return wait
    raise UnsupportedForm(ins.form)


def op_cp(dec: Decoder, ins: Instr, index: int) -> Fn:
    p = ins.parts
    if p[1:3] != ("async", "bulk"):
        raise UnsupportedForm(ins.form)
    o = ins.operands
    if "prefetch" in p:
        return lambda w: None  # an L2 hint: nothing to emulate
    if not ("shared::cluster" in p and "global" in p and "mbarrier::complete_tx::bytes" in p):
        raise UnsupportedForm(ins.form)
    dst, src = address(dec, o[0], ins), address(dec, o[1], ins)
    rsize = dec.reader(o[2], "u32", ins)
    mbar = address(dec, o[3], ins)

    def bulk(w):  # noqa: ANN001, ANN202
        act = _active(w)
        d, s, n, mb = dst(w), src(w), rsize(w), mbar(w)
        for lane in np.nonzero(act)[0]:
            w.emu.bulk_copy(w, ins, int(d[lane]), int(s[lane]), int(n[lane]), int(mb[lane]))
        return None

    return bulk


# ---- tensor cores -------------------------------------------------------------------------------
def op_mma(dec: Decoder, ins: Instr, index: int) -> Fn:
    if ins.form != "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32":
        raise UnsupportedForm(ins.form)
    d, a, b, c = ins.operands
    wds = _dest_writers(dec, d, "f32", ins)
    ras = _src_readers(dec, a, "b32", ins)
    rbs = _src_readers(dec, b, "b32", ins)
    rcs = _src_readers(dec, c, "f32", ins)
    lanes = np.arange(LANES)
    g, t = lanes >> 2, lanes & 3

    def halves(v):  # noqa: ANN001, ANN202
        lo = (v & np.uint32(0xFFFF)).astype(np.uint32) << np.uint32(16)
        hi = v & np.uint32(0xFFFF0000)
        return lo.view(np.float32).astype(np.float64), hi.view(np.float32).astype(np.float64)

    def mma(w):  # noqa: ANN001, ANN202
        if not w.collective(ALL, ins):
            return BLOCK
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        C = np.zeros((16, 8))
        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                        (g + 8, 2 * t + 8))):
            lo, hi = halves(ras[r](w))
            A[row, col], A[row, col + 1] = lo, hi
        for r, krow in enumerate((2 * t, 2 * t + 8)):
            lo, hi = halves(rbs[r](w))
            B[krow, g], B[krow + 1, g] = lo, hi
        for r, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                        (g + 8, 2 * t + 1))):
            C[row, col] = rcs[r](w).astype(np.float64)
        D = (A @ B + C).astype(np.float32)
        for r, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                        (g + 8, 2 * t + 1))):
            wds[r](w, D[row, col])
        return None

    return mma


OPS = {name[3:]: f for name, f in list(globals().items()) if name.startswith("op_")}
