"""The matvec epilogues' interface: what the GEMV (matvec.py) hands a row chunk's results to.

A matvec opcode names its epilogue class in its ISA declaration (`OpSpec.matvec`, "module.Class"
under megakernel.kernel.device), as other opcodes name their handler class; a build makes one
instance per class for the opcodes it handles (`epilogues_for`), and the matvec calls, for a record
of one of the instance's `ops`,

    e.begin_pass(op, c)   before the row chunks of a pass over activation rows n0 .. n0 + NO
    e.run(op, c)          on each row chunk's accumulators (sAcc, K-slices summed by acc_value)
    e.end_pass(op, c)     after them

with `c` a `Chunk`: the record, the chunk's place and everything an epilogue may read or write,
one struct in place of a long argument list. A new matvec opcode adds its declaration and, when
no existing epilogue fits, an epilogue class; the GEMV does not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass.cute as cute
from cutlass import Int32

from megakernel.kernel.device.handler import instances_for


@dataclass(frozen=True)
class Chunk:
    """One row chunk of a matvec record on the consumer warps (values traced in the kernel); at
    begin_pass / end_pass the chunk fields (rc0, nr, ksplit, nrp) are 0. Frozen, and an epilogue
    stores into its tensors through locals (`sBest = c.sBest; sBest[i] = v`): the tracer rebinds
    the names a staged region assigns, and `c.sBest[i] = v` inside one would rebind the shared
    struct's fields to values of that region."""

    rec: cute.Tensor  # the record's 16 words (registers)
    layer: Int32
    row0: Int32  # the slab's first row in its matrix
    rc0: Int32  # the chunk's first row in the slab
    nr: Int32  # rows of the chunk
    n0: Int32  # the pass's first activation row
    ksplit: Int32  # K-slices summed per result (acc_value)
    nrp: Int32  # row pitch of sAcc
    out_off: Int32  # the record's OUT_OFF
    weights: cute.Pointer  # bf16 weight arena
    f32: cute.Pointer
    bf16: cute.Pointer
    i32: cute.Pointer
    k_cache: cute.Pointer
    v_cache: cute.Pointer
    s_max: Int32
    len_off: Int32  # i32 offset of lengths [B]
    slot: Int32  # an expert record's work-list slot (moe.py; 0 otherwise)
    work_off: Int32
    live: Int32  # live activation rows of the pass (N, or an expert slot's pair rows)
    sAcc: cute.Tensor  # fp32 [ksplit][NO][nrp] results
    sBest: cute.Tensor  # fp32 (max, index) per activation row (LM head)
    tidx: Int32
    warp: Int32
    lane: Int32


class Epilogue:
    """Base of the epilogue classes: the build's opcodes of the class (`ops`, set by
    epilogues_for), the matvec whose shapes and accumulators it reads (`mv`), pass hooks that
    do nothing."""

    ops: tuple[int, ...] = ()

    def __init__(self, mv: Any):  # noqa: ANN401 (matvec.Matvec)
        self.mv = mv

    def begin_pass(self, op: Int32, c: Chunk) -> None:
        """Before a pass's row chunks: nothing unless the epilogue overrides it."""

    def run(self, op: Int32, c: Chunk) -> None:
        raise NotImplementedError(f"{type(self).__name__} finishes no matvec")

    def end_pass(self, op: Int32, c: Chunk) -> None:
        """After a pass's row chunks: nothing unless the epilogue overrides it."""

    @classmethod
    def has(cls, hook: str) -> bool:
        """The class overrides pass hook `hook` (the matvec compiles in only those)."""
        return getattr(cls, hook) is not getattr(Epilogue, hook)


def epilogues_for(mv: Any, handled: tuple[int, ...]) -> list[Epilogue]:  # noqa: ANN401
    """One instance per epilogue class of the `handled` matvec opcodes (OpSpec.matvec), in
    opcode order, each with its `ops`."""
    return instances_for(handled, "matvec", Epilogue, mv)
