"""Parse the PTX a build writes (one `.entry`, no calls) into instructions, labels and registers.

Only what our builds emit is accepted; anything else is an error naming the line. Operands are
kept as small tagged tuples for the decoder (decode.py):
  ("reg", name)  ("imm", int)  ("f32", bits)  ("f64", bits)  ("sym", name)  ("sreg", name)
  ("vec", [operands])  ("mem", base_operand, offset)  ("label", name)  ("param", name)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megakernel.emulator.errors import EmulatorError

_REG_DECL = re.compile(r"\.reg\s+\.(\w+)\s+%(\w+?)<(\d+)>;")
_PARAM = re.compile(r"\.param\s+\.(\w+)(?:\s+\.ptr\s+\.global\s+\.align\s+\d+)?\s+(\w+)")
_LABEL = re.compile(r"^(\$?[\w$]+):$")
_SREGS = ("%tid.x", "%tid.y", "%tid.z", "%ntid.x", "%ctaid.x", "%ctaid.y", "%ctaid.z",
          "%nctaid.x", "%nctaid.y", "%nctaid.z", "%laneid", "%warpid", "%globaltimer",
          "%clock", "%clock64", "%smid", "%nsmid", "%lanemask_lt")


@dataclass(frozen=True)
class Instr:
    """One instruction: opcode with its modifiers split (`ld.global.v4.b32` -> ("ld", "global",
    "v4", "b32")), an optional guard predicate, its operands and the PTX line it came from."""

    line: int
    text: str
    parts: tuple[str, ...]
    operands: tuple
    guard: str | None = None  # predicate register name
    guard_neg: bool = False

    @property
    def form(self) -> str:
        return ".".join(self.parts)


@dataclass
class Kernel:
    """The parsed entry: instructions in order, label -> instruction index, register banks."""

    name: str
    params: list[tuple[str, str]]  # (ptx name, ptx type) in order
    regs: dict[str, tuple[str, int]] = field(default_factory=dict)  # prefix -> (type, count)
    code: list[Instr] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)
    shared_symbols: list[str] = field(default_factory=list)


def _split_operands(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _int(tok: str) -> int:
    neg = tok.startswith("-")
    t = tok[1:] if neg else tok
    t = t.rstrip("U")
    v = int(t, 16) if t.lower().startswith("0x") else int(t)
    return -v if neg else v


def parse_operand(tok: str, line: int):  # noqa: ANN201
    tok = tok.strip()
    if tok.startswith("{"):
        return ("vec", [parse_operand(t, line) for t in _split_operands(tok[1:-1])])
    if tok.startswith("["):
        inner = tok[1:-1].strip()
        m = re.fullmatch(r"(.+?)\s*\+\s*(-?\w+)", inner)
        if m and not inner.startswith("-"):
            return ("mem", parse_operand(m.group(1), line), _int(m.group(2)))
        return ("mem", parse_operand(inner, line), 0)
    if tok in _SREGS:
        return ("sreg", tok)
    if tok.startswith("%"):
        return ("reg", tok[1:])
    if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", tok):
        return ("f32", int(tok[2:], 16))
    if re.fullmatch(r"0[dD][0-9a-fA-F]{16}", tok):
        return ("f64", int(tok[2:], 16))
    if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)U?", tok):
        return ("imm", _int(tok))
    if tok == "_":
        return ("sink", None)
    if re.fullmatch(r"\$?[\w$]+", tok):
        return ("sym", tok)
    raise EmulatorError(f"PTX line {line}: cannot parse operand {tok!r}")


def parse(text: str) -> Kernel:
    """The one `.entry` of a build's PTX."""
    lines = text.splitlines()
    entry = None
    shared: list[str] = []
    i = 0
    n = len(lines)
    while i < n:
        s = lines[i].strip()
        if s.startswith(".extern .shared") or s.startswith(".shared"):
            m = re.search(r"(\w+)\[", s)
            if m:
                shared.append(m.group(1))
        if ".entry" in s:
            m = re.search(r"\.entry\s+(\w+)\s*\(", s)
            if not m:
                raise EmulatorError(f"PTX line {i + 1}: cannot parse the .entry")
            entry = m.group(1)
            break
        i += 1
    if entry is None:
        raise EmulatorError("the PTX has no .entry")
    params: list[tuple[str, str]] = []
    i += 1
    while i < n and not lines[i].strip().startswith(")"):
        m = _PARAM.search(lines[i])
        if m:
            params.append((m.group(2), m.group(1)))
        i += 1
    k = Kernel(entry, params, shared_symbols=shared)
    depth = 0
    started = False
    scopes: list[dict[str, str]] = []  # inline-asm blocks: their local registers, renamed
    for j in range(i, n):
        raw = lines[j]
        s = raw.split("//", 1)[0].strip()
        if not s:
            continue
        if s == "{":
            depth += 1
            if started:
                scopes.append({})
            started = True
            continue
        if s == "}":
            depth -= 1
            if started and depth == 0:
                break
            scopes.pop()
            continue
        if not started or s.startswith("."):
            m = _REG_DECL.match(s)
            if m:
                k.regs[m.group(2)] = (m.group(1), int(m.group(3)))
            elif s.startswith(".reg") and scopes:
                _local_regs(k, scopes[-1], s, j + 1)
            elif s.startswith(".reg"):
                raise EmulatorError(f"PTX line {j + 1}: unsupported register declaration {s!r}")
            continue
        m = _LABEL.match(s)
        if m:
            k.labels[m.group(1)] = len(k.code)
            continue
        ins = _parse_instr(s, j + 1)
        if scopes:
            ins = _rename(ins, scopes)
        k.code.append(ins)
    else:
        if depth:
            raise EmulatorError("the PTX entry's body is not closed")
    for ins in k.code:
        for op in ins.operands:
            if op[0] == "sym" and ins.parts[0] in ("bra",) and op[1] not in k.labels:
                raise EmulatorError(f"PTX line {ins.line}: branch to unknown label {op[1]}")
    return k


def _local_regs(k: Kernel, scope: dict[str, str], s: str, line: int) -> None:
    """`.reg .b16 l, h;` in an inline-asm block: each name gets a fresh register of its own."""
    m = re.fullmatch(r"\.reg\s+\.(\w+)\s+(.+);", s)
    if not m:
        raise EmulatorError(f"PTX line {line}: unsupported register declaration {s!r}")
    ty = m.group(1)
    prefix = f"_{ty}_local"
    _, count = k.regs.get(prefix, (ty, 0))
    for name in (x.strip() for x in m.group(2).split(",")):
        scope[name] = f"{prefix}{count}"
        count += 1
    k.regs[prefix] = (ty, count)


def _rename(ins: Instr, scopes: list[dict[str, str]]) -> Instr:
    def look(name: str) -> str | None:
        for sc in reversed(scopes):
            if name in sc:
                return sc[name]
        return None

    def sub(op):  # noqa: ANN001, ANN202
        if op[0] == "sym" and look(op[1]):
            return ("reg", look(op[1]))
        if op[0] == "vec":
            return ("vec", [sub(x) for x in op[1]])
        if op[0] == "mem":
            return ("mem", sub(op[1]), op[2])
        return op

    guard = look(ins.guard) if ins.guard and look(ins.guard) else ins.guard
    return Instr(ins.line, ins.text, ins.parts, tuple(sub(o) for o in ins.operands), guard,
                 ins.guard_neg)


def _parse_instr(s: str, line: int) -> Instr:
    if not s.endswith(";"):
        raise EmulatorError(f"PTX line {line}: expected ';' at the end of {s!r}")
    s = s[:-1].strip()
    guard, neg = None, False
    if s.startswith("@"):
        g, s = s.split(None, 1)
        neg = g.startswith("@!")
        guard = g[2:] if neg else g[1:]
        guard = guard.lstrip("%")
    parts = s.split(None, 1)
    op = parts[0]
    ops = _split_operands(parts[1]) if len(parts) > 1 else []
    return Instr(line, s, tuple(op.split(".")), tuple(parse_operand(o, line) for o in ops),
                 guard, neg)


def forms(text: str) -> dict[str, int]:
    """Distinct instruction forms (opcode with its modifiers) and their static counts."""
    out: dict[str, int] = {}
    for ins in parse(text).code:
        out[ins.form] = out.get(ins.form, 0) + 1
    return out
