"""Record words and opcode sets of the device code, from the ISA registry (no DSL).

The kernel reads no record word by number. Every read names its field, and the registry turns the
name into a word index while the kernel is traced (a Python int, so the PTX is what a literal
would give):

    word(Op.QKV, "ROPE_OFF")   an operand of one opcode
    mv("K")                    a shared matvec operand (isa.MATVEC: the same word in every matvec
                               opcode, so the one handler reads any of them)
    slab_word("NROWS")         W_LO, W_HI, NROWS, K of any slab record the build handles (the
                               loader and the lookahead walk the queue without decoding opcodes)
    common("LAYER")            a common field (words 0..5)

`OpTable` holds the opcodes one build handles (those its model's program uses) and the
compile-time opcode sets the device code branches on, from the registry's properties: the slab
opcodes (streamed by the loader and the lookahead), the matvec opcodes by epilogue class, the
ticket opcodes (which signal from their merge). `one_of(op, codes)` makes such a set a
predicate, an OR of equalities: on a traced Int32 in the kernel, on an int in the host mirrors
and the tests.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from pathlib import Path

from megakernel import isa

MATVEC_NAMES = tuple(n for n, _ in isa.MATVEC)
SLAB_NAMES = ("W_LO", "W_HI", "NROWS", "K")
# what the kernel implements: the frame's opcodes the persistent loop runs itself (its own handler
# table, kernel/device/megakernel.py), the other opcodes by the class their declaration names: a
# handler (OpSpec.handler, kernel/device/handler.py) or, for a matvec, an epilogue (OpSpec.matvec,
# kernel/device/epilogue.py)
BUILTIN = ("END", "EMBED", "ARGMAX", "ACCEPT")


class FieldError(ValueError):
    """A registry declaration the device code cannot read with one word per field."""


def word(op: int, name: str) -> int:
    """Record word of field `name` of opcode `op` (KeyError when `op` has no such operand)."""
    return isa.field_index(op, name)


def common(name: str) -> int:
    """Record word of a common field (isa.COMMON_FIELDS)."""
    if name not in isa.COMMON_FIELDS:
        raise KeyError(f"{name!r} is not a common field; common fields: {isa.COMMON_FIELDS}")
    return isa.COMMON_FIELDS.index(name)


def shared_word(ops: Iterable[int], name: str) -> int:
    """The word of `name` in every opcode of `ops` (FieldError unless they all agree)."""
    where = {int(op): word(op, name) for op in ops}
    if len(set(where.values())) != 1:
        raise FieldError(f"operand {name} is not at one word in opcodes "
                         f"{ {isa.spec(op).name: w for op, w in where.items()} }")
    return next(iter(where.values()))


def mv(name: str) -> int:
    """Record word of a shared matvec operand (isa.MATVEC)."""
    if name not in MATVEC_NAMES:
        raise KeyError(f"{name!r} is not a shared matvec operand; those are {MATVEC_NAMES}")
    return shared_word(isa.matvec_ops(), name)


def slab_word(name: str) -> int:
    """Record word of a slab field in every slab opcode a kernel build handles."""
    if name not in SLAB_NAMES:
        raise KeyError(f"{name!r} is not a slab field; those are {SLAB_NAMES}")
    return shared_word(device_ops(slab=True), name)


def device_ops(slab: bool = False) -> tuple[int, ...]:
    """The opcodes the kernel implements (`device=True`), optionally only the slab ones."""
    return tuple(s.code for s in isa.specs() if s.device and (s.slab or not slab))


def one_of(op, codes: Iterable[int]):  # noqa: ANN001, ANN201 (Int32 or int -> Boolean or bool)
    """`op` is one of `codes` (non-empty): an OR of equalities, evaluated when traced."""
    terms = [op == int(c) for c in codes]
    if not terms:
        raise FieldError("an opcode set the device code branches on is empty")
    return functools.reduce(operator.or_, terms)


def none_of(op, codes: Iterable[int]):  # noqa: ANN001, ANN201
    """`op` is none of `codes` (non-empty): an AND of inequalities."""
    terms = [op != int(c) for c in codes]
    if not terms:
        raise FieldError("an opcode set the device code branches on is empty")
    return functools.reduce(operator.and_, terms)


class OpTable:
    """The opcodes one build handles and the compile-time sets the device code branches on."""

    def __init__(self, handled: Iterable[int]):
        self.handled = tuple(sorted(int(c) for c in handled))
        specs = [isa.spec(c) for c in self.handled]
        missing = [s.name for s in specs if not implemented(s)]
        if missing:
            raise FieldError(f"the kernel has no handler for opcodes {missing}")
        self.slab = tuple(s.code for s in specs if s.slab)
        self.matvec = tuple(s.code for s in specs if s.matvec is not None)
        self.ticket = tuple(s.code for s in specs if s.ticket)
        self.own = tuple(s.code for s in specs if s.handler)  # run by handler classes
        self.by_epilogue: dict[str, tuple[int, ...]] = {}
        for s in specs:
            if s.matvec is not None:
                self.by_epilogue[s.matvec] = self.by_epilogue.get(s.matvec, ()) + (s.code,)
        if set(self.slab) != set(self.matvec):  # the loader streams exactly the matvec slabs
            raise FieldError(f"slab opcodes {self.slab} are not the matvec opcodes "
                             f"{self.matvec} (the kernel streams slabs for the matvec handler)")

    @classmethod
    def for_spec(cls, spec) -> OpTable:  # noqa: ANN001 (KernelSpec)
        """A build handles the opcodes its model's program uses (spec.handled_ops, from the
        registry's layer kinds): a dense build compiles no relu^2 epilogue, a Nemotron-H build no
        SwiGLU one."""
        return cls(spec.handled_ops)

    def epilogue(self, path: str) -> tuple[int, ...]:
        """The handled matvec opcodes whose epilogue is class `path` (empty: not compiled in)."""
        return self.by_epilogue.get(path, ())


def implemented(s) -> bool:  # noqa: ANN001 (isa OpSpec)
    """The kernel has code for opcode declaration `s`: the loop's own, or the handler or epilogue
    class it names (a class of that name in that module under megakernel/kernel/device; read as
    text: this module imports no DSL)."""
    return s.name in BUILTIN or class_defined(s.handler) or class_defined(s.matvec)


def class_defined(path: str | None) -> bool:
    """"module.Class" names a class defined in megakernel/kernel/device/module.py."""
    if not path or path.count(".") != 1:
        return False
    module, name = path.split(".")
    src = Path(__file__).parents[1] / "device" / f"{module}.py"
    return src.is_file() and f"\nclass {name}(" in src.read_text()


def handled_by(op: int) -> str:
    """Who runs `op` in the kernel (for the dispatch test and messages)."""
    s = isa.spec(op)
    return "loop" if s.name in BUILTIN else s.handler or s.matvec


def check_registry() -> None:
    """What the device code assumes of the registry (run at import): the shared matvec and slab
    operands each at one word; opcodes sharing an epilogue class have the same operands (the
    epilogue reads its extra operands by one opcode's names)."""
    for name in MATVEC_NAMES:
        mv(name)
    for name in SLAB_NAMES:
        slab_word(name)
    unimplemented = [s.name for s in isa.specs() if s.device and not implemented(s)]
    if unimplemented:
        raise FieldError(f"device opcodes {unimplemented} have no handler class, epilogue or "
                         "loop code")
    for e in {s.matvec for s in isa.specs() if s.matvec is not None}:
        ops = [s for s in isa.specs() if s.matvec == e]
        if len({s.names for s in ops}) > 1:
            raise FieldError(f"opcodes with epilogue {e!r} differ in operands: "
                             f"{[(s.name, s.names) for s in ops]}")


check_registry()
