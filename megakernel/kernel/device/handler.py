"""The device handlers' interface: what the persistent loop (megakernel.py) hands a record to.

An opcode that is not a matvec names its handler class in its ISA declaration (`OpSpec.handler`,
"module.Class" under megakernel.kernel.device); a build makes one instance per class for the
opcodes it handles (`handlers_for`), and the loop calls, for a record of one of the instance's
`ops`,

    h.prefetch(op, s)   before the record's dependency wait (what may start early: an L2
                        prefetch of the record's state or cache); nothing by default
    h.run(op, s)        the record's work, after the wait

with `s` a `Step`: the record and everything a handler may read or write, one struct in place of
a long argument list. A new opcode adds its declaration and its handler's methods; the loop does
not change.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import cutlass.cute as cute
from cutlass import Int32

from megakernel import isa


@dataclass
class Step:
    """One record's context on the consumer warps (values traced in the kernel)."""

    rec: cute.Tensor  # the record's 16 words (registers)
    layer: Int32
    epoch: Int32  # this launch's epoch (thread 0's copy; counters count epochs)
    counters: cute.Pointer
    weights: cute.Pointer  # bf16 weight arena
    f32: cute.Pointer
    bf16: cute.Pointer
    i32: cute.Pointer
    k_cache: cute.Pointer
    v_cache: cute.Pointer
    state: cute.Pointer  # fp32 recurrent state arena
    s_max: Int32
    sQ: cute.Tensor  # fp32 [NW, D] per-warp query (attention)
    sO: cute.Tensor  # fp32 [NW, D] per-warp partial output (attention)
    sML: cute.Tensor  # fp32 [NW, 2] per-warp (m, l)
    sFlag: cute.Tensor  # int32 broadcast word
    sRstd: cute.Tensor  # fp32 per activation row
    sScratch: cute.Tensor  # fp32 span of the handlers' scratch (spec.recurrent_smem_bytes)
    tidx: Int32
    warp: Int32
    lane: Int32


class Handler:
    """Base of the handler classes: the build's opcodes of the class (`ops`, set by
    handlers_for) and a prefetch that does nothing."""

    ops: tuple[int, ...] = ()

    def prefetch(self, op: Int32, s: Step) -> None:
        """Before the dependency wait: nothing unless the handler overrides it."""

    def run(self, op: Int32, s: Step) -> None:
        raise NotImplementedError(f"{type(self).__name__} runs no opcode")


def handler_class(path: str) -> type:
    """"module.Class" under megakernel.kernel.device -> the class."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(f"megakernel.kernel.device.{module}"), name)


def handlers_for(spec: Any, handled: tuple[int, ...]) -> list[Handler]:  # noqa: ANN401
    """One instance per handler class of the `handled` opcodes that name one (OpSpec.handler),
    in opcode order, each with its `ops`."""
    return instances_for(handled, "handler", Handler, spec)


def instances_for(handled: tuple[int, ...], prop: str, base: type, arg: Any) -> list:  # noqa: ANN401
    """One instance, made with `arg`, of each class that the `handled` opcodes' declarations
    name in property `prop` (OpSpec.handler or OpSpec.matvec), in opcode order, each with its
    `ops`; TypeError when a class is not a `base`."""
    by_class: dict[str, list[int]] = {}
    for code in handled:
        path = getattr(isa.spec(code), prop)
        if path:
            by_class.setdefault(path, []).append(code)
    out = []
    for path, codes in by_class.items():
        obj = handler_class(path)(arg)
        if not isinstance(obj, base):
            raise TypeError(f"{path} (the {prop} of {[isa.spec(c).name for c in codes]}) is not "
                            f"a kernel.{base.__module__.rpartition('.')[2]}.{base.__name__}")
        obj.ops = tuple(codes)
        out.append(obj)
    return out
