"""The compiler's intermediate form: stages of work units, instructions, counters, regions. The
layer kinds build their stages from it and the compiler (megakernel.program) schedules them.

A step is a list of `Stage`s in execution order. Each stage has work units (a head, a (sequence,
kv head, split), 16 rows of a matrix...) and makes the instruction for a unit or a contiguous range
of units; every instruction waits for the whole stage that produces its input (one counter) and
signals its own stage's counter. The scheduler (program/schedule.py) cuts divisible stages into
one slab per SM and places every instruction with the cost model in the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megakernel.common.errors import UserError
from megakernel.isa.records import NO_COUNTER


class PlanError(UserError, ValueError):
    """A model/batch/GPU combination the program (or the kernel) cannot serve."""


class ProgramError(ValueError):
    """The program violates an invariant (named in the message)."""


@dataclass
class Instr:
    """One instruction before encoding, with the quantities the cost model needs."""

    op: int  # an isa OpCode
    layer: int
    operands: dict[str, int]
    wait: int = NO_COUNTER
    signal: int = NO_COUNTER
    # counter the loader's weight stream waits for before the slab (a run-time binding: an
    # expert slot's, the layer's router counter); NO_COUNTER: weights never wait
    stream_wait: int = NO_COUNTER
    stage: int = -1
    # cost attributes (bytes, flops); see cost.py
    w_bytes: int = 0  # streamed before the wait may be met (weights, cached KV, recurrent state)
    l2_bytes: int = 0  # activations read after the wait (L2 hits)
    hbm_bytes: int = 0  # other HBM reads after the wait (embedding rows)
    store_bytes: int = 0
    tensor_flops: float = 0.0
    fp32_flops: float = 0.0
    converted: int = 0  # FP8 weights the GEMV converts in registers (CostParams.fp8_convert)
    # dependent global round trips of the handler's loop nest after the wait (a warp issues in
    # order: a loop whose trip uses its own load pays one per trip), counted by a function next
    # to the handler's index arithmetic (e.g. kernel/dense_index.attn_round_trips)
    round_trips: int = 0
    # a ticket opcode (ATTN_PARTIAL): the merge the last signaller runs
    merge_l2_bytes: int = 0
    merge_store_bytes: int = 0
    merge_flops: float = 0.0
    merge_round_trips: int = 0
    # placement
    sm: int = -1
    pos: int = -1


@dataclass
class Counter:
    name: str
    total: int = 0  # increments per step (= number of signalling instructions)


@dataclass(frozen=True)
class Region:
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Stage:
    name: str
    op: int
    layer: int
    units: int
    divisible: bool  # a contiguous unit range may become one instruction (matvec rows)
    make: Callable[[int, int], Instr]  # [u0, u1) -> instruction
    unit_rows: int = 0  # rows per unit (divisible stages)


class Counters:
    """Counters by name, numbered in order of first use."""

    def __init__(self) -> None:
        self.list: list[Counter] = []
        self.ids: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = len(self.list)
            self.list.append(Counter(name))
        return self.ids[name]
