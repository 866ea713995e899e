"""The megakernel instruction set: the record format (records.py), the opcode registry
(registry.py), which the layer kinds fill with their opcodes, and the instructions before they
are encoded (stages.py: the stages of work the layer kinds emit and the compiler schedules).
This is the contract between the program compiler, the verifier, the cost model, the CPU
executor, the runtime and the CuTe DSL kernel; `table_markdown()` prints it.

Buffers and rounding points are documented by the layer kinds that declare them
(megakernel/layers/) and summarised in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from megakernel.isa.records import (
    COMMON_FIELDS,
    COMMON_WORDS,
    COUNTER_BASE,
    EPOCH,
    EXIT,
    FLAG_ADVANCE,
    FLAG_FEEDBACK,
    FORMAT_VERSION,
    GATEUP_BLOCK,
    MAX_ROWS,
    NO_COUNTER,
    OPERAND_WORDS,
    RECORD_WORDS,
    ROW_ALIGN,
    SUPPORTED_HEAD_DIMS,
    WIDE,
    as_tensor,
    join64,
    split64,
)
from megakernel.isa.registry import (
    FRAME_STEPS,
    MATVEC,
    Op,
    OpCode,
    OpSpec,
    decode,
    describe,
    encode,
    frame_ops,
    register,
    spec,
    specs,
    step_end,
    step_ops,
    step_start,
)

__all__ = [
    "COMMON_FIELDS", "COMMON_WORDS", "COUNTER_BASE", "EPOCH", "EXIT", "FLAG_ADVANCE", "FRAME_STEPS",
    "FLAG_FEEDBACK", "FORMAT_VERSION", "GATEUP_BLOCK", "MATVEC", "MAX_ROWS", "NO_COUNTER",
    "OPERAND_WORDS", "RECORD_WORDS", "ROW_ALIGN", "SUPPORTED_HEAD_DIMS", "WIDE", "Op", "OpCode",
    "OpSpec", "as_tensor", "decode", "describe", "encode", "field_index", "frame_ops", "join64",
    "register", "spec", "specs", "split64", "step_end", "step_ops",
    "step_start", "table_markdown", "slab_ops", "matvec_ops",
]


def field_index(op: int, name: str) -> int:
    """Word index of operand `name` of opcode `op` (common fields included)."""
    return spec(op).index(name)


def slab_ops() -> tuple[OpCode, ...]:
    """Opcodes whose record names a weight slab the loader streams."""
    return tuple(s.op for s in specs() if s.slab)


def matvec_ops() -> tuple[OpCode, ...]:
    """Opcodes run by the parametrised matvec handler."""
    return tuple(s.op for s in specs() if s.matvec is not None)


def table_markdown() -> str:
    """The opcode/operand table as markdown (for docs and `plan --isa`)."""
    lines = [f"ISA format version {FORMAT_VERSION}, {RECORD_WORDS} int32 words per record", ""]
    lines += ["| word | common field |", "|---|---|"]
    lines += [f"| {i} | {n} |" for i, n in enumerate(COMMON_FIELDS)]
    for s in specs():
        props = [p for p in ("slab", "reach", "ticket", "device") if getattr(s, p)]
        if s.matvec:
            props.append(f"matvec epilogue {s.matvec}")
        if s.step:
            props.append(f"frame: {s.step} steps" + (", ends the step" if s.ends_step else "")
                         + (f", waits on {s.waits_on}" if s.waits_on else ""))
        lines += ["", f"**{s.code} {s.name}** ({s.kind}; {', '.join(props) or 'no properties'}):"
                  f" {s.doc}", ""]
        lines += [f"- word {COMMON_WORDS + i} `{n}`: {doc}"
                  for i, (n, doc) in enumerate(s.operands)]
        if s.notes:
            lines += ["", s.notes]
    return "\n".join(lines)
