"""The opcode registry: every opcode declared once, by the layer kind that owns it.

An `OpSpec` holds an opcode's number, name, operands (name, doc), documentation and properties.
Every consumer reads it: the compiler and the executor encode and decode records by operand name,
the verifier and the cost model read the properties, the runtime checks records with them, and the
kernel build turns them into compile-time tables (which opcodes carry a weight slab the loader
streams, which handler runs an opcode) and reads record words by operand name.

Properties:
    slab        the record names a weight slab (W, ROW0, NROWS, K): NROWS rows of K bf16 starting at
                element W of the weight arena, which the loader streams before the wait (a slab
                opcode is a matvec opcode, so these are at the same words in every one)
    matvec      the epilogue class of an opcode run by the parametrised matvec handler,
                "module.Class" in megakernel.kernel.device (kernel/device/epilogue.py; its
                operands start with `MATVEC`, so the handler reads them at fixed words)
    reach       bytes the record reads that do not depend on the step (cached keys/values, a
                recurrent state) are fetched when the CTA reaches it, before the wait
    ticket      SIGNAL_CID is a ticket: the last of its signallers runs a merge and then signals
                the counter in operand DONE_CID
    device      the CuTe DSL kernel implements it (a build refuses programs with other opcodes)
    handler     the device handler class of a device opcode that is not a matvec, "module.Class"
                in megakernel.kernel.device (kernel/device/handler.py); a device opcode with
                neither (the frame's END, EMBED, ARGMAX, ACCEPT) runs in the persistent loop itself

The frame's opcodes (the embedding, the LM head, the step's end, the device drafter) declare
their place in a step, so that no consumer names them:
    step        the sorts of step that have it (FRAME_STEPS): every step, a plain step's end, a
                speculative step's end, the device n-gram drafter's (frame_ops, step_ops)
    starts_step it starts the step: the first block's first opcodes wait on it (the embedding)
    ends_step   it ends the step: merges the LM head's partial argmaxes into the tokens (the
                executor's exactly-once check and the compiler's LM-tile count read it)
    waits_on    the frame opcode whose signal its records wait on (the verifier's dataflow)
    covers      what its records of a step cover together, exactly once (the verifier's
                coverage): (extent, lo, hi) with extent "rows" (the step's activation rows),
                "batch" (its sequences) or "one" (one record), each record [d[lo], d[hi])
    check       its record check against a build, (decoded record, KernelSpec) -> why not ('')
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from megakernel.isa.records import (
    COMMON_FIELDS,
    COMMON_WORDS,
    INT32_MAX,
    INT32_MIN,
    NO_COUNTER,
    OPERAND_WORDS,
    RECORD_WORDS,
    WIDE,
    join64,
    split64,
)

# The operands every matvec opcode starts with (the handler reads them at these words).
MATVEC: tuple[tuple[str, str], ...] = (
    ("W_LO", "weights: element offset of the slab's first element, low 32 bits (unsigned)"),
    ("W_HI", "weights: high 32 bits of that offset"),
    ("ROW0", "first packed row of the slab within its matrix"),
    ("NROWS", "rows in the slab (multiple of ROW_ALIGN)"),
    ("K", "row length = input features"),
    ("NORM_OFF", "weights: RMSNorm weight [K] of the prologue (-1: input is already bf16)"),
    ("IN_OFF", "input: f32 h [N, K] when NORM_OFF >= 0, else bf16 [N, K]"),
    ("OUT_OFF", "output base (see the opcode)"),
)


class OpCode(int):
    """An opcode number that knows its name (compares and hashes as the int)."""

    name: str

    def __new__(cls, code: int, name: str) -> OpCode:
        obj = super().__new__(cls, code)
        obj.name = name
        return obj

    @property
    def value(self) -> int:
        return int(self)

    def __repr__(self) -> str:
        return f"<Op.{self.name}: {int(self)}>"

    def __str__(self) -> str:
        return f"Op.{self.name}"

    def __reduce__(self):  # noqa: ANN204 (pickling: by name, through the registry)
        return (_by_code, (int(self),))


# the sorts of step a frame opcode belongs to (OpSpec.step; frame_ops)
FRAME_STEPS = ("all", "plain", "speculative", "ngram")


@dataclass(frozen=True)
class OpSpec:
    code: int
    name: str
    kind: str  # the layer kind that owns it ("frame": embedding, LM head, argmax, END)
    doc: str
    operands: tuple[tuple[str, str], ...]
    notes: str = ""  # longer semantics for the ISA table
    slab: bool = False
    matvec: str | None = None  # the epilogue class, "module.Class" in megakernel.kernel.device
    reach: bool = False
    ticket: bool = False
    device: bool = False
    handler: str | None = None  # the device handler class, "module.Class" (as matvec)
    # the frame's opcodes (kind "frame"): the steps that have one (FRAME_STEPS), whether it ends
    # the step, the frame opcode it waits on, and its record check against a build
    step: str = ""
    starts_step: bool = False
    ends_step: bool = False
    waits_on: str | None = None
    covers: tuple[str, str, str] | None = None  # (extent, first operand, end operand)
    check: Callable[[dict, Any], str] | None = None  # (decoded record, KernelSpec) -> why not
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(n for n, _ in self.operands))
        if len(self.operands) > OPERAND_WORDS:
            raise ValueError(f"{self.name}: {len(self.operands)} operands > {OPERAND_WORDS}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"{self.name}: duplicate operand names")
        if self.matvec is not None and self.operands[: len(MATVEC)] != MATVEC:
            raise ValueError(f"{self.name}: a matvec opcode's operands start with MATVEC")
        if self.slab and self.matvec is None:  # the loader reads W, NROWS, K at MATVEC's words
            raise ValueError(f"{self.name}: a slab opcode is a matvec opcode (operands MATVEC)")
        if self.handler is not None and (not self.device or self.matvec is not None):
            raise ValueError(f"{self.name}: a handler class is for device opcodes that are not "
                             "matvecs (those run on their epilogue)")
        if self.ticket and "DONE_CID" not in self.names:
            raise ValueError(f"{self.name}: a ticket opcode names DONE_CID")
        if self.covers is not None and (self.covers[0] not in ("rows", "batch", "one") or any(
                n not in self.names for n in self.covers[1:] if self.covers[0] != "one")):
            raise ValueError(f"{self.name}: covers {self.covers} (rows/batch with two operands, "
                             "or one)")
        if self.step not in ("", *FRAME_STEPS) or (self.step and self.kind != "frame"):
            raise ValueError(f"{self.name}: step {self.step!r} (a frame opcode's: one of "
                             f"{FRAME_STEPS})")

    @property
    def op(self) -> OpCode:
        return _CODES[self.code]

    @functools.cached_property
    def name_set(self) -> frozenset[str]:
        return frozenset(self.names)

    @functools.cached_property
    def fields(self) -> tuple[str, ...]:
        """Every word's name, in order: the common fields then the operands."""
        return COMMON_FIELDS + self.names

    @functools.cached_property
    def wide(self) -> tuple[tuple[str, str, str], ...]:
        """(name, low word, high word) of the 64-bit operands this opcode has."""
        return tuple((w, lo, hi) for w, (lo, hi) in WIDE.items() if lo in self.name_set)

    def index(self, name: str) -> int:
        """Word index of operand `name` (common fields included)."""
        if name in COMMON_FIELDS:
            return COMMON_FIELDS.index(name)
        if name not in self.names:
            raise KeyError(f"opcode {self.name} has no operand {name!r}; operands: "
                           f"{list(self.names)}")
        return COMMON_WORDS + self.names.index(name)


_SPECS: dict[int, OpSpec] = {}
_NAMES: dict[str, int] = {}
_CODES: dict[int, OpCode] = {}
_LOADED = False


def register(spec: OpSpec) -> OpCode:
    """Add an opcode (at import of its layer kind's module); returns its OpCode."""
    old = _SPECS.get(spec.code)
    if old is not None and old != spec:
        raise ValueError(f"opcode {spec.code} registered twice ({old.name}, {spec.name})")
    if _NAMES.get(spec.name, spec.code) != spec.code:
        raise ValueError(f"opcode name {spec.name} registered twice")
    _SPECS[spec.code] = spec
    _NAMES[spec.name] = spec.code
    _CODES.setdefault(spec.code, OpCode(spec.code, spec.name))
    return spec.op


def load_all() -> None:
    """Import every layer kind (and so register every opcode)."""
    global _LOADED
    if not _LOADED:
        from megakernel.layers import all_kinds

        all_kinds()
        _LOADED = True


def frame_ops(step: str) -> tuple[OpCode, ...]:
    """The frame opcodes a step of this sort has, by number: "all" (every step: END, EMBED, the
    LM head), "plain" (a plain step's end), "speculative" (a verify step's end, which accepts the
    drafts), "ngram" (the device drafter of a speculative step)."""
    if step not in FRAME_STEPS:
        raise ValueError(f"no frame step {step!r}; one of {FRAME_STEPS}")
    return tuple(s.op for s in specs() if s.step == step)


def step_end(step: str) -> OpCode:
    """The opcode that ends a step of this sort ("plain" or "speculative")."""
    ends = [op for op in frame_ops(step) if spec(op).ends_step]
    if len(ends) != 1:
        raise ValueError(f"a {step} step has {len(ends)} ending opcodes, not one")
    return ends[0]


def step_start() -> OpCode:
    """The opcode every step starts with, which the first block waits on (the embedding)."""
    (op,) = (op for op in frame_ops("all") if spec(op).starts_step)
    return op


def step_ops(drafts: int = 0, ngram: int = 0) -> tuple[OpCode, ...]:
    """The frame opcodes of a plain step, or of a speculative one (`drafts` >= 1; the device
    drafter's with `ngram` >= 1)."""
    steps = ("all", "speculative" if drafts else "plain") + (("ngram",) if drafts and ngram
                                                               else ())
    return tuple(op for s in steps for op in frame_ops(s))


def specs() -> list[OpSpec]:
    """Every opcode, by number."""
    load_all()
    return [_SPECS[c] for c in sorted(_SPECS)]


def spec(op: int) -> OpSpec:
    """The declaration of opcode `op`."""
    s = _SPECS.get(op)  # an OpCode or an int hashes as its code
    if s is None:
        load_all()
        s = _SPECS.get(int(op))
    if s is None:
        raise ValueError(f"unknown opcode {int(op)}")
    return s


def _by_code(code: int) -> OpCode:
    return spec(code).op


class _Ops:
    """`Op.NAME` -> OpCode, `Op(code)` -> OpCode, `iter(Op)`: the registered opcodes."""

    def __getattr__(self, name: str) -> OpCode:
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in _NAMES:
            load_all()
        if name not in _NAMES:
            raise AttributeError(f"no opcode named {name!r}")
        op = _CODES[_NAMES[name]]
        setattr(self, name, op)  # an opcode, once registered, stays: later reads skip this
        return op

    def __call__(self, code: int) -> OpCode:
        return spec(code).op

    def __iter__(self) -> Iterator[OpCode]:
        return iter([s.op for s in specs()])

    def __contains__(self, x: object) -> bool:
        return isinstance(x, int) and int(x) in {s.code for s in specs()}


Op = _Ops()


# ---- records -------------------------------------------------------------------------------------
def encode(op: int, *, wait: tuple[int, int, int] | None = None, signal: int = NO_COUNTER,
           layer: int = -1, **operands: int) -> list[int]:
    """One record. `wait` = (counter, local target, per-step total); operands by name; a 64-bit
    operand (records.WIDE: `W`, `STATE`) may be given whole."""
    s = spec(op)
    for wide, lo, hi in s.wide:
        if wide in operands:
            operands[lo], operands[hi] = split64(operands.pop(wide))
    if operands.keys() != s.name_set:
        unknown = sorted(set(operands) - set(s.names))
        if unknown:
            raise KeyError(f"opcode {s.name} has no operands {unknown}; operands: "
                           f"{list(s.names)}")
        missing = sorted(set(s.names) - set(operands))
        raise KeyError(f"opcode {s.name} is missing operands {missing}")
    cid, target, total = wait if wait is not None else (NO_COUNTER, 0, 0)
    rec = [int(op), cid, target, total, signal, layer] + [int(operands[n]) for n in s.names]
    if min(rec) < INT32_MIN or max(rec) > INT32_MAX:
        i, v = next((i, v) for i, v in enumerate(rec) if not INT32_MIN <= v <= INT32_MAX)
        name = (COMMON_FIELDS + s.names)[i]
        raise OverflowError(f"field {name}={v} of {s.name} does not fit in int32")
    return rec + [0] * (RECORD_WORDS - len(rec))


def decode(rec) -> dict:  # noqa: ANN001 (a sequence of 16 ints or an int32 tensor row)
    """A record as {field: value}; OPCODE is an OpCode; 64-bit operands are added whole."""
    words = rec if isinstance(rec, list) else [int(x) for x in rec]
    if len(words) != RECORD_WORDS:
        raise ValueError(f"a record has {RECORD_WORDS} words, got {len(words)}")
    s = spec(words[0])
    out = dict(zip(s.fields, words, strict=False))
    out["OPCODE"] = s.op
    for wide, lo, hi in s.wide:
        out[wide] = join64(out[lo], out[hi])
    return out


def describe(rec) -> str:  # noqa: ANN001
    """Human-readable one-liner of a record, for error messages and dumps."""
    d = decode(rec)
    op = d.pop("OPCODE")
    wide = {w for pair in WIDE.values() for w in pair}
    parts = [f"{k}={v}" for k, v in d.items() if k not in wide]
    return f"{op.name}(" + ", ".join(parts) + ")"
