"""Timeline stamps of the timeline build (KernelSpec.timeline): %globaltimer per instruction.

Only that build calls these (every call site sits under `cutlass.const_expr(spec.timeline)`), so
the default build is unchanged. The records [num_sms, queue_len, TIMELINE_WORDS] int64 lie in the
tail of the program buffer, right after the instruction records (spec.timeline_offset); the
fields and their writers are documented at spec.TIMELINE_FIELDS, the host side is
megakernel/measure/timeline.py.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64

from megakernel.isa import RECORD_WORDS
from megakernel.kernel.device.memory import st
from megakernel.kernel.host.limits import TIMELINE_WORDS, timeline_word


def cta_records(program: cute.Pointer, num_ctas: Int32, queue_len: Int32,
                bidx: Int32) -> cute.Pointer:
    """int64 pointer to CTA `bidx`'s timeline records (64-byte aligned: RECORD_WORDS int32 and
    TIMELINE_WORDS int64 are both 64 bytes)."""
    words = Int64(num_ctas) * Int64(queue_len) * Int64(RECORD_WORDS)  # int32 records
    mine = Int64(bidx) * Int64(queue_len) * Int64(TIMELINE_WORDS)  # int64 records before ours
    addr = program.toint() + words * Int64(4) + mine * Int64(8)
    return cute.make_ptr(Int64, addr, cute.AddressSpace.gmem, assumed_align=16)


def stamp(tl: cute.Pointer, pc: Int32, name: str) -> None:
    """Record `name` (a spec.TIMELINE_FIELDS time) of queue position pc: %globaltimer in ns."""
    st(tl, pc * TIMELINE_WORDS + timeline_word(name), Int64(cute.arch.globaltimer()))


def put(tl: cute.Pointer, pc: Int32, name: str, value) -> None:  # noqa: ANN001 (a DSL integer)
    """Record a non-time field (the opcode) of queue position pc."""
    st(tl, pc * TIMELINE_WORDS + timeline_word(name), Int64(value))
