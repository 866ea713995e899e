"""Pre-decode each PTX instruction once into a closure over a warp's 32-lane register vectors.

A closure takes the warp (machine.Warp) and returns None (next instruction), an instruction index
(a branch), or one of the signals below; it reads `w.m`, the active-lane mask of the warp's
current group (None: all 32 lanes), and writes registers only on those lanes. Registers live in
one bank per PTX register prefix (uint of the register's width, bool for predicates), so a 32-bit
register holds the raw bits of an s32, u32 or f32 alike and each instruction views them in its
own type. Memory, barriers and the scheduler are the machine's (machine.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megakernel.emulator import numerics as nx
from megakernel.emulator.errors import EmulatorError, UnsupportedForm
from megakernel.emulator.ptx import Instr, Kernel

YIELD = -1  # done; end the warp's quantum (a spin: failed wait, nanosleep)
BLOCK = -2  # not done; the warp waits (barrier, collective) and retries this instruction
EXIT = -3  # the active lanes exited

NP = {"b8": np.uint8, "u8": np.uint8, "s8": np.int8, "b16": np.uint16, "u16": np.uint16,
      "s16": np.int16, "f16": np.float16, "bf16": np.uint16, "b32": np.uint32, "u32": np.uint32,
      "s32": np.int32, "f32": np.float32, "b64": np.uint64, "u64": np.uint64, "s64": np.int64,
      "f64": np.float64, "pred": np.bool_}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
LANES = 32
ALL = np.ones(LANES, bool)
NONE = np.zeros(LANES, bool)
ALL.setflags(write=False)
NONE.setflags(write=False)

Fn = Callable[..., object]


def typed_views(banks: list[np.ndarray]) -> dict[tuple[int, np.dtype], np.ndarray]:
    """(bank, dtype) -> the bank as that numpy type: itself, and viewed as every other type of NP
    of its width (a warp's register banks, built once; predicates only as themselves)."""
    out = {}
    for bi, b in enumerate(banks):
        out[bi, b.dtype] = b
        for t in set(NP.values()):
            dt = np.dtype(t)
            if dt.itemsize == b.dtype.itemsize and np.bool_ not in (dt, b.dtype):
                out[bi, dt] = b.view(dt)
    return out


def _type_of(parts: tuple[str, ...]) -> str:
    for p in reversed(parts):
        if p in NP:
            return p
    raise KeyError(parts)


class Decoder:
    """Turns a parsed kernel into one closure per instruction (`decode_all`)."""

    def __init__(self, kernel: Kernel, shared_base: int, param_index: dict[str, int],
                 machine_ops: dict[str, Callable] | None = None):
        self.k = kernel
        self.machine_ops = machine_ops or {}  # opcode -> decoder of what the machine implements
        self.shared_base = shared_base
        self.param_index = param_index
        self.banks: dict[str, tuple[int, np.dtype]] = {}
        self.bank_shapes: list[tuple[int, np.dtype]] = []
        for i, (prefix, (ty, count)) in enumerate(sorted(kernel.regs.items())):
            dt = np.bool_ if ty == "pred" else UINT[np.dtype(NP[ty]).itemsize]
            self.banks[prefix] = (i, dt)
            self.bank_shapes.append((count + 1, dt))

    # ---- operands ------------------------------------------------------------------------------
    def _reg(self, name: str, ins: Instr) -> tuple[int, int, np.dtype]:
        i = len(name)
        while i and name[i - 1].isdigit():
            i -= 1
        prefix, num = name[:i], name[i:]
        if prefix not in self.banks or not num:
            raise EmulatorError(f"PTX line {ins.line}: unknown register %{name}")
        bi, dt = self.banks[prefix]
        return bi, int(num), dt

    def const(self, value: int | float, ty: str) -> np.ndarray:
        dt = np.dtype(NP[ty])
        if dt.kind == "f":
            a = np.full(LANES, value, dt)
        elif dt == np.bool_:
            a = np.full(LANES, bool(value))
        else:
            bits = int(value) & ((1 << (8 * dt.itemsize)) - 1)
            a = np.full(LANES, bits, UINT[dt.itemsize]).view(dt)
        a.setflags(write=False)
        return a

    def reader(self, op, ty: str, ins: Instr) -> Fn:  # noqa: ANN001
        """A function w -> the operand's 32 lanes as numpy type `ty`."""
        kind = op[0]
        want = np.dtype(NP[ty])
        if kind == "reg":
            bi, ri, dt = self._reg(op[1], ins)
            if dt == np.bool_ or want == np.bool_:
                if dt != want:
                    raise EmulatorError(f"PTX line {ins.line}: %{op[1]} read as {ty}")
                return lambda w: w.b[bi][ri]
            if np.dtype(dt).itemsize == want.itemsize:
                if dt == want:
                    return lambda w: w.b[bi][ri]
                key = (bi, want)
                return lambda w: w.tv[key][ri]
            # a register of another width (cvt): value-convert through its unsigned bits
            return lambda w: w.b[bi][ri].astype(UINT[want.itemsize]).view(want)
        if kind == "imm":
            if want.kind == "f":
                raise EmulatorError(f"PTX line {ins.line}: integer immediate for {ty}")
            c = self.const(op[1], ty)
            return lambda w: c
        if kind == "f32":
            c = np.full(LANES, op[1], np.uint32).view(np.float32)
            if want.itemsize == 4:
                c = c.view(want)
            else:
                c = c.astype(want)
            c.setflags(write=False)
            return lambda w: c
        if kind == "f64":
            c = np.full(LANES, op[1], np.uint64).view(np.float64).astype(want)
            return lambda w: c
        if kind == "sym":
            if op[1] in self.k.shared_symbols:
                c = self.const(self.shared_base, ty)
                return lambda w: c
            raise EmulatorError(f"PTX line {ins.line}: unknown symbol {op[1]}")
        if kind == "sreg":
            name = op[1]
            return lambda w: w.sreg(name).astype(want)
        raise EmulatorError(f"PTX line {ins.line}: operand {op!r} cannot be read as {ty}")

    def writer(self, op, ty: str, ins: Instr) -> Fn:  # noqa: ANN001
        """A function (w, values) storing `values` (numpy type `ty`) on the active lanes."""
        if op[0] == "sink":
            return lambda w, v: None
        if op[0] != "reg":
            raise EmulatorError(f"PTX line {ins.line}: cannot write to {op!r}")
        bi, ri, dt = self._reg(op[1], ins)
        want = np.dtype(NP[ty])
        same = np.dtype(dt).itemsize == want.itemsize or dt == np.bool_
        if dt == want or (np.dtype(dt).itemsize == want.itemsize and np.bool_ not in (dt, want)):
            key = (bi, want)  # the register's bank as the written type (typed_views)

            def write_view(w, v):  # noqa: ANN001, ANN202
                if v.__class__ is not np.ndarray or (v.dtype is not want and v.dtype != want):
                    v = np.asarray(v).astype(want)
                m = w.m
                if m is None:
                    w.tv[key][ri][...] = v
                else:
                    np.copyto(w.tv[key][ri], v, where=m)

            return write_view

        def write(w, v):  # noqa: ANN001, ANN202
            v = np.asarray(v)
            if v.dtype != want:
                v = v.astype(want)
            if same:
                if v.dtype != dt:
                    v = v.view(dt)
            else:
                v = v.view(UINT[want.itemsize]).astype(dt)
            row = w.b[bi][ri]
            if w.m is None:
                row[...] = v
            else:
                np.copyto(row, v, where=w.m)

        return write

    # ---- decoding ------------------------------------------------------------------------------
    def decode_all(self) -> list[Fn]:
        return [self.decode(ins, i) for i, ins in enumerate(self.k.code)]

    def decode(self, ins: Instr, index: int) -> Fn:
        op = ins.parts[0]
        handler = getattr(self, "op_" + op, None)
        if handler is None and op in self.machine_ops:
            def handler(ins, index, f=self.machine_ops[op]):  # noqa: ANN001, ANN202
                return f(self, ins, index)
        if handler is None:
            raise UnsupportedForm(f"PTX line {ins.line}: unsupported instruction form "
                                  f"{ins.form!r} ({ins.text})")
        try:
            fn = handler(ins, index)
        except UnsupportedForm:
            raise
        except (KeyError, IndexError, ValueError) as e:
            raise UnsupportedForm(f"PTX line {ins.line}: unsupported instruction form "
                                  f"{ins.form!r} ({ins.text}): {e}") from None
        if ins.guard is None or op in ("bra", "ret", "exit"):
            return fn
        return self._guarded(ins, fn)

    def _guarded(self, ins: Instr, fn: Fn) -> Fn:
        bi, ri, dt = self._reg(ins.guard, ins)
        neg = ins.guard_neg

        def g(w):  # noqa: ANN001, ANN202
            p = w.b[bi][ri]
            if neg:
                p = ~p
            m0 = w.m
            if m0 is None:
                n = int(np.count_nonzero(p))
                if n == LANES:
                    return fn(w)
                if n == 0:
                    return None
                m = p
            else:
                m = p & m0
                if not m.any():
                    return None
            w.m = m
            r = fn(w)
            if r == BLOCK or r == EXIT:
                raise EmulatorError(f"PTX line {ins.line}: a collective or exit under a guard "
                                    f"that splits the warp is not supported by the emulator")
            w.m = m0
            return r

        return g

    def guard_mask(self, ins: Instr) -> Fn:
        """w -> the lanes of the current group for which the guard holds (bool[32])."""
        if ins.guard is None:
            return lambda w: ALL if w.m is None else w.m
        bi, ri, _ = self._reg(ins.guard, ins)
        neg = ins.guard_neg

        def gm(w):  # noqa: ANN001, ANN202
            p = w.b[bi][ri]
            if neg:
                p = ~p
            return p if w.m is None else (p & w.m)

        return gm

    # ---- generic ALU ---------------------------------------------------------------------------
    def _alu(self, ins: Instr, dty: str, styps: list[str], f: Callable) -> Fn:
        o = ins.operands
        wd = self.writer(o[0], dty, ins)
        rs = [self.reader(x, t, ins) for x, t in zip(o[1:], styps, strict=True)]
        if len(rs) == 1:
            (r0,) = rs
            return lambda w: wd(w, f(r0(w)))
        if len(rs) == 2:
            r0, r1 = rs
            return lambda w: wd(w, f(r0(w), r1(w)))
        r0, r1, r2 = rs
        return lambda w: wd(w, f(r0(w), r1(w), r2(w)))

    def _float_binary(self, ins: Instr, index: int, f64op: Callable) -> Fn:
        p = ins.parts
        if "f32x2" in p:  # a pair of f32 in a 64-bit register (sm_100a)
            mode = next((m for m in ("rn", "rz", "rm", "rp") if m in p), "rn")

            def pair(a, b):  # noqa: ANN001, ANN202
                x = np.ascontiguousarray(a).view(np.float32).astype(np.float64)
                y = np.ascontiguousarray(b).view(np.float32).astype(np.float64)
                return nx.f32_round(f64op(x, y), mode).view(np.uint64)

            return self._alu(ins, "b64", ["b64", "b64"], pair)
        ty = _type_of(p)
        mode = next((m for m in ("rn", "rz", "rm", "rp") if m in p), "rn")
        if ty != "f32":
            raise UnsupportedForm(ty)
        flush = "ftz" in p
        sat = "sat" in p

        def f(a, b):  # noqa: ANN001, ANN202
            if flush:
                a, b = nx.ftz(a), nx.ftz(b)
            r = nx.f32_round(f64op(a.astype(np.float64), b.astype(np.float64)), mode)
            if sat:
                r = np.clip(np.nan_to_num(r, nan=0.0), 0, 1).astype(np.float32)
            return nx.ftz(r) if flush else r

        return self._alu(ins, ty, [ty, ty], f)

    def op_add(self, ins: Instr, index: int) -> Fn:
        if "f32x2" in ins.parts:
            return self._float_binary(ins, index, np.add)
        ty = _type_of(ins.parts)
        if ty == "f32":
            return self._float_binary(ins, index, np.add)
        return self._alu(ins, ty, [ty, ty], np.add)

    def op_sub(self, ins: Instr, index: int) -> Fn:
        ty = _type_of(ins.parts)
        if ty == "f32":
            return self._float_binary(ins, index, np.subtract)
        return self._alu(ins, ty, [ty, ty], np.subtract)

    def op_mul(self, ins: Instr, index: int) -> Fn:
        p = ins.parts
        ty = "f32" if "f32x2" in p else _type_of(p)
        if ty == "f32" or "f32x2" in p:
            return self._float_binary(ins, index, np.multiply)
        dt = np.dtype(NP[ty])
        if "wide" in p:
            wide = {"s16": "s32", "u16": "u32", "s32": "s64", "u32": "u64"}[ty]
            wdt = NP[wide]
            return self._alu(ins, wide, [ty, ty], lambda a, b: a.astype(wdt) * b.astype(wdt))
        if "hi" in p:
            bits = 8 * dt.itemsize
            if dt.itemsize == 8:
                def hi64(a, b):  # noqa: ANN001, ANN202
                    return np.array([(int(x) * int(y)) >> 64 for x, y in zip(a, b, strict=True)],
                                    dtype=object).astype(np.int64 if dt.kind == "i"
                                                         else np.uint64)
                return self._alu(ins, ty, [ty, ty], hi64)
            wdt = np.int64 if dt.kind == "i" else np.uint64
            return self._alu(ins, ty, [ty, ty],
                             lambda a, b: ((a.astype(wdt) * b.astype(wdt)) >> bits).astype(dt))
        return self._alu(ins, ty, [ty, ty], np.multiply)  # .lo: wraps

    def op_mad(self, ins: Instr, index: int) -> Fn:
        p = ins.parts
        ty = _type_of(p)
        if "wide" in p:
            wide = {"s32": "s64", "u32": "u64", "s16": "s32", "u16": "u32"}[ty]
            wdt = NP[wide]
            return self._alu(ins, wide, [ty, ty, wide],
                             lambda a, b, c: a.astype(wdt) * b.astype(wdt) + c)
        if "lo" not in p:
            raise UnsupportedForm("mad without .lo")
        return self._alu(ins, ty, [ty, ty, ty], lambda a, b, c: a * b + c)

    def op_fma(self, ins: Instr, index: int) -> Fn:
        p = ins.parts
        if p[-2:] == ("f32", "bf16"):  # f32 = bf16 * bf16 + f32 (sm_100a): exact product
            mode = next((m for m in ("rn", "rz", "rm", "rp") if m in p), "rn")

            def mixed(a, b, c):  # noqa: ANN001, ANN202
                x = nx.bf16_to_f32(a).astype(np.float64) * nx.bf16_to_f32(b)
                return nx.f32_round(x + c, mode)

            return self._alu(ins, "f32", ["b16", "b16", "f32"], mixed)
        ty = _type_of(p)
        if ty != "f32":
            raise UnsupportedForm(ty)
        mode = next((m for m in ("rn", "rz", "rm", "rp") if m in p), "rn")
        flush, sat = "ftz" in p, "sat" in p

        def f(a, b, c):  # noqa: ANN001, ANN202
            if flush:
                a, b, c = nx.ftz(a), nx.ftz(b), nx.ftz(c)
            r = nx.f32_round(a.astype(np.float64) * b.astype(np.float64) + c, mode)
            if sat:
                r = np.clip(np.nan_to_num(r, nan=0.0), 0, 1).astype(np.float32)
            return nx.ftz(r) if flush else r

        return self._alu(ins, ty, [ty, ty, ty], f)

    def op_div(self, ins: Instr, index: int) -> Fn:
        ty = _type_of(ins.parts)
        if ty == "f32":
            if "approx" in ins.parts or "full" in ins.parts:
                return self._alu(ins, ty, [ty, ty], lambda a, b: (a.astype(np.float64) / b
                                                                  ).astype(np.float32))
            return self._float_binary(ins, index, np.divide)
        dt = np.dtype(NP[ty])

        def f(a, b):  # noqa: ANN001, ANN202
            z = b == 0
            bb = np.where(z, 1, b)
            if dt.kind == "i":
                a64, b64 = a.astype(np.int64), bb.astype(np.int64)
                q = np.abs(a64) // np.abs(b64) * np.sign(a64) * np.sign(b64)
                return np.where(z, -1, q).astype(dt)
            return np.where(z, np.iinfo(dt).max, a // bb).astype(dt)

        return self._alu(ins, ty, [ty, ty], f)

    def op_rem(self, ins: Instr, index: int) -> Fn:
        ty = _type_of(ins.parts)
        dt = np.dtype(NP[ty])

        def f(a, b):  # noqa: ANN001, ANN202
            z = b == 0
            bb = np.where(z, 1, b)
            if dt.kind == "i":
                a64, b64 = a.astype(np.int64), bb.astype(np.int64)
                r = np.abs(a64) % np.abs(b64) * np.sign(a64)
                return np.where(z, a, r).astype(dt)
            return np.where(z, a, a % bb).astype(dt)

        return self._alu(ins, ty, [ty, ty], f)

    def op_neg(self, ins: Instr, index: int) -> Fn:
        ty = _type_of(ins.parts)
        return self._alu(ins, ty, [ty], np.negative)

    def op_abs(self, ins: Instr, index: int) -> Fn:
        ty = _type_of(ins.parts)
        return self._alu(ins, ty, [ty], np.abs)

    def _minmax(self, ins: Instr, fl: Callable, il: Callable) -> Fn:
        ty = _type_of(ins.parts)
        relu = "relu" in ins.parts
        f = fl if ty == "f32" else il
        if relu:
            g = f
            return self._alu(ins, ty, [ty, ty], lambda a, b: np.maximum(g(a, b), 0).astype(
                NP[ty]))
        return self._alu(ins, ty, [ty, ty], f)

    def op_min(self, ins: Instr, index: int) -> Fn:
        return self._minmax(ins, np.fmin, np.minimum)

    def op_max(self, ins: Instr, index: int) -> Fn:
        return self._minmax(ins, np.fmax, np.maximum)

    def _bitwise(self, ins: Instr, f: Callable) -> Fn:
        ty = _type_of(ins.parts)
        n = len(ins.operands) - 1
        return self._alu(ins, ty, [ty] * n, f)

    def op_and(self, ins: Instr, index: int) -> Fn:
        return self._bitwise(ins, np.bitwise_and)

    def op_or(self, ins: Instr, index: int) -> Fn:
        return self._bitwise(ins, np.bitwise_or)

    def op_xor(self, ins: Instr, index: int) -> Fn:
        return self._bitwise(ins, np.bitwise_xor)

    def op_not(self, ins: Instr, index: int) -> Fn:
        return self._bitwise(ins, np.invert)

    def op_popc(self, ins: Instr, index: int) -> Fn:
        ty = _type_of(ins.parts)

        def f(a):  # noqa: ANN001, ANN202
            return np.array([bin(int(x)).count("1") for x in a], np.uint32)

        return self._alu(ins, "u32", [ty], f)

    def _shift(self, ins: Instr, left: bool) -> Fn:
        ty = _type_of(ins.parts)
        dt = np.dtype(NP[ty])
        bits = 8 * dt.itemsize
        o = ins.operands
        if o[2][0] == "imm" and 0 <= int(o[2][1]) < bits:  # a constant in-range shift
            sc = dt.type(int(o[2][1]))
            wd, r0 = self.writer(o[0], ty, ins), self.reader(o[1], ty, ins)
            if left:
                return lambda w: wd(w, r0(w) << sc)
            return lambda w: wd(w, r0(w) >> sc)

        def f(a, s):  # noqa: ANN001, ANN202
            big = s >= bits
            sc = np.minimum(s, bits - 1).astype(dt)
            if left:
                return np.where(big, 0, a << sc).astype(dt)
            r = a >> sc
            if dt.kind == "i":
                return np.where(big, a >> (bits - 1), r).astype(dt)
            return np.where(big, 0, r).astype(dt)

        return self._alu(ins, ty, [ty, "u32"], f)

    def op_shl(self, ins: Instr, index: int) -> Fn:
        return self._shift(ins, True)

    def op_shr(self, ins: Instr, index: int) -> Fn:
        return self._shift(ins, False)

    def op_selp(self, ins: Instr, index: int) -> Fn:
        ty = _type_of(ins.parts)
        return self._alu(ins, ty, [ty, ty, "pred"], lambda a, b, c: np.where(c, a, b))

    _CMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal,
            "hi": np.greater, "hs": np.greater_equal}

    def op_setp(self, ins: Instr, index: int) -> Fn:
        p = ins.parts
        cmp, ty = p[1], _type_of(p)
        if len(p) > 3:
            raise UnsupportedForm("setp with a boolean combiner")
        if ty in ("b16", "b32", "b64") and cmp not in ("eq", "ne"):
            ty = "u" + ty[1:]
        if ty.startswith("f"):
            if cmp in ("num", "nan"):
                f = ((lambda a, b: ~(np.isnan(a) | np.isnan(b))) if cmp == "num"
                     else (lambda a, b: np.isnan(a) | np.isnan(b)))
            elif cmp.endswith("u"):
                base = self._CMP[cmp[:-1]]
                def f(a, b, base=base):  # noqa: ANN001, ANN202
                    return base(a, b) | np.isnan(a) | np.isnan(b)
            else:
                base = self._CMP[cmp]
                if cmp == "ne":
                    def f(a, b):  # noqa: ANN001, ANN202
                        return (a != b) & ~(np.isnan(a) | np.isnan(b))
                else:
                    f = base
        else:
            f = self._CMP[cmp]
        o = ins.operands
        if o[0][0] == "reg" and "|" in o[0][1]:
            raise UnsupportedForm("setp with two destinations")
        return self._alu(ins, "pred", [ty, ty], f)

    def op_mov(self, ins: Instr, index: int) -> Fn:
        ty = _type_of(ins.parts)
        d, a = ins.operands
        size = np.dtype(NP[ty]).itemsize
        if d[0] == "vec":  # unpack
            n = len(d[1])
            part = UINT[size // n]
            ra = self.reader(a, ty, ins)
            ws = [self.writer(x, {1: "b8", 2: "b16", 4: "b32"}[size // n], ins) for x in d[1]]

            def unpack(w):  # noqa: ANN001, ANN202
                v = np.ascontiguousarray(ra(w).view(UINT[size]))
                parts = v.view(part).reshape(LANES, n)
                for i, wr in enumerate(ws):
                    wr(w, parts[:, i].copy())
            return unpack
        if a[0] == "vec":  # pack
            n = len(a[1])
            pty = {1: "b8", 2: "b16", 4: "b32"}[size // n]
            rs = [self.reader(x, pty, ins) for x in a[1]]
            wd = self.writer(d, ty, ins)
            part = UINT[size // n]

            def pack(w):  # noqa: ANN001, ANN202
                m = np.stack([r(w).view(part) for r in rs], axis=1)
                wd(w, np.ascontiguousarray(m).view(UINT[size]).reshape(LANES).view(NP[ty]))
            return pack
        return self._alu(ins, ty, [ty], lambda x: x)

    def op_cvt(self, ins: Instr, index: int) -> Fn:
        p = ins.parts
        types = [x for x in p[1:] if x in NP or x in ("bf16x2", "f16x2", "e4m3x2")]
        mods = [x for x in p[1:] if x not in types]
        dty, sty = types[0], types[1]
        o = ins.operands
        if dty == "bf16x2" and sty == "f32":
            r0, r1 = self.reader(o[1], "f32", ins), self.reader(o[2], "f32", ins)
            wd = self.writer(o[0], "b32", ins)
            return lambda w: wd(w, (nx.f32_to_bf16(r0(w)).astype(np.uint32) << np.uint32(16))
                                | nx.f32_to_bf16(r1(w)).astype(np.uint32))
        if dty == "f16x2" and sty == "e4m3x2":
            return self._alu(ins, "b32", ["b16"], nx.e4m3x2_to_f16x2)
        if dty == "f32" and sty == "bf16":
            return self._alu(ins, "f32", ["b16"], nx.bf16_to_f32)
        if dty == "bf16" and sty == "f32":
            return self._alu(ins, "b16", ["f32"], nx.f32_to_bf16)
        if dty == "f32" and sty == "f16":
            return self._alu(ins, "f32", ["f16"], lambda a: a.astype(np.float32))
        if dty == "f16" and sty == "f32":
            return self._alu(ins, "f16", ["f32"], lambda a: a.astype(np.float16))
        if dty == "f32" and sty == "f32":
            if "sat" in mods:
                return self._alu(ins, "f32", ["f32"], lambda a: np.clip(
                    np.nan_to_num(a, nan=0.0), 0, 1).astype(np.float32))
            mode = next((m for m in ("rni", "rzi", "rmi", "rpi") if m in mods), None)
            if mode:
                fn = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}[mode]
                return self._alu(ins, "f32", ["f32"], lambda a: fn(a).astype(np.float32))
            return self._alu(ins, "f32", ["f32"], lambda a: a)
        ddt, sdt = np.dtype(NP[dty]), np.dtype(NP[sty])
        if ddt.kind == "f" and sdt.kind in "iu":
            mode = next((m for m in ("rn", "rz", "rm", "rp") if m in mods), "rn")
            return self._alu(ins, dty, [sty], lambda a: nx.f32_round(a.astype(np.float64),
                                                                     mode).astype(ddt))
        if ddt.kind in "iu" and sdt.kind == "f":
            mode = next((m for m in ("rni", "rzi", "rmi", "rpi") if m in mods), None)
            if mode is None:
                raise UnsupportedForm("float to int without an integer rounding mode")
            return self._alu(ins, dty, [sty], lambda a: nx.cvt_f32_to_int(a, ddt, mode))
        if ddt.kind in "iu" and sdt.kind in "iu":
            if "sat" in mods:
                raise UnsupportedForm("saturating integer cvt")
            return self._alu(ins, dty, [sty], lambda a: a.astype(ddt))
        raise UnsupportedForm(f"cvt {dty} <- {sty}")

    def _unary_f32(self, ins: Instr, f: Callable) -> Fn:
        flush = "ftz" in ins.parts

        def g(a):  # noqa: ANN001, ANN202
            if flush:
                a = nx.ftz(a)
            with np.errstate(all="ignore"):
                r = f(a.astype(np.float64)).astype(np.float32)
            return nx.ftz(r) if flush else r

        if _type_of(ins.parts) != "f32":
            raise UnsupportedForm("non-f32 transcendental")
        return self._alu(ins, "f32", ["f32"], g)

    def op_ex2(self, ins: Instr, index: int) -> Fn:
        return self._unary_f32(ins, np.exp2)

    def op_lg2(self, ins: Instr, index: int) -> Fn:
        return self._unary_f32(ins, np.log2)

    def op_rcp(self, ins: Instr, index: int) -> Fn:
        return self._unary_f32(ins, lambda a: 1.0 / a)

    def op_sqrt(self, ins: Instr, index: int) -> Fn:
        return self._unary_f32(ins, np.sqrt)

    def op_rsqrt(self, ins: Instr, index: int) -> Fn:
        return self._unary_f32(ins, lambda a: 1.0 / np.sqrt(a))

    def op_tanh(self, ins: Instr, index: int) -> Fn:
        return self._unary_f32(ins, np.tanh)

    def op_sin(self, ins: Instr, index: int) -> Fn:
        return self._unary_f32(ins, np.sin)

    def op_cos(self, ins: Instr, index: int) -> Fn:
        return self._unary_f32(ins, np.cos)

    # ---- control -------------------------------------------------------------------------------
    def op_bra(self, ins: Instr, index: int) -> Fn:
        target = self.k.labels[ins.operands[0][1]]
        if ins.guard is None:
            return lambda w: target
        gm = self.guard_mask(ins)
        bi, ri, _ = self._reg(ins.guard, ins)
        neg = ins.guard_neg

        def bra(w):  # noqa: ANN001, ANN202
            if w.m is None:  # the whole warp: a uniform branch needs no split
                p = w.b[bi][ri]
                n = int(np.count_nonzero(p))
                if n == (0 if neg else LANES):
                    return target
                if n == (LANES if neg else 0):
                    return None
            take = gm(w)
            if not take.any():
                return None
            act = ALL if w.m is None else w.m
            if (take == act).all():
                return target
            w.split(index + 1, act & ~take)
            w.m = take.copy()
            return target

        return bra

    def op_ret(self, ins: Instr, index: int) -> Fn:
        gm = self.guard_mask(ins)

        def ret(w):  # noqa: ANN001, ANN202
            ex = gm(w)
            if not ex.any():
                return None
            w.exit_lanes(ex)
            return EXIT

        return ret

    op_exit = op_ret

    def op_trap(self, ins: Instr, index: int) -> Fn:
        def trap(w):  # noqa: ANN001, ANN202
            raise EmulatorError(f"trap at PTX line {ins.line} ({w.where()}): the kernel "
                                f"faulted on purpose (its watchdog or an unknown opcode)")
        return trap

    def op_nanosleep(self, ins: Instr, index: int) -> Fn:
        return lambda w: YIELD

    def op_fence(self, ins: Instr, index: int) -> Fn:
        return lambda w: None  # the emulator is sequentially consistent

    def op_membar(self, ins: Instr, index: int) -> Fn:
        return lambda w: None
