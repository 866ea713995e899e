"""The record format: fixed-width int32 records, the common words, counters and epochs.

An instruction is `RECORD_WORDS` (16) int32 words. Words 0..5 are common to every opcode:

    0 OPCODE       the opcode (isa.registry)
    1 WAIT_CID     counter to wait on before reading any activation (-1: no wait)
    2 WAIT_TARGET  increments of WAIT_CID this step that must be visible (local to the step)
    3 WAIT_TOTAL   increments WAIT_CID receives per step (for the epoch, below)
    4 SIGNAL_CID   counter to add 1 to after all of this instruction's stores (-1: none)
    5 LAYER        decoder layer (-1 for instructions outside the layers); a layer's slot in a
                   per-kind cache (its KV cache slot) follows from it and the model's structure

Words 6..15 are operands whose meaning depends on the opcode (isa.registry). A program is an int32
tensor `[num_sms, max_queue, 16]`; CTA `i` walks row `i` until it meets opcode END (0), so queues
are padded with zero records. The grid is exactly `num_sms` CTAs, all co-resident.

Counters and epochs (no host work between steps): `counters` is int32 `[COUNTER_BASE +
num_counters]`, zeroed once when the buffers are allocated and never again by the host. Word
`EPOCH` (0) holds the number of completed steps; word `EXIT` (1) counts CTAs that finished.
Program counter `c` lives at `COUNTER_BASE + c`. Each program counter receives the same number of
increments every step (`WAIT_TOTAL`), so at the start of step `e` its value is `e * WAIT_TOTAL`;
targets are `e * WAIT_TOTAL + WAIT_TARGET` in wrapping int32 arithmetic and counters never need a
reset. When a CTA has run its queue it does `old = atomic_add(counters[EXIT], 1)`; the CTA that gets
`old == e * num_sms + num_sms - 1` stores `e + 1` to `EPOCH`.

Offsets that can pass 2^31 elements travel as two words, low (unsigned, stored as int32) and high:
a weight slab (`W_LO`, `W_HI`) and a recurrent layer's block of the state arena (`STATE_LO`,
`STATE_HI`). `encode` takes them as one 64-bit operand (`W=...`, `STATE=...`); `decode` adds it
back.
"""

from __future__ import annotations

import torch

FORMAT_VERSION = 3  # 3: one ISA for every family (the records of dense programs are format 2's)
RECORD_WORDS = 16
COMMON_WORDS = 6
OPERAND_WORDS = RECORD_WORDS - COMMON_WORDS
COMMON_FIELDS = ("OPCODE", "WAIT_CID", "WAIT_TARGET", "WAIT_TOTAL", "SIGNAL_CID", "LAYER")
NO_COUNTER = -1

# counters[] words before the program counters
EPOCH = 0
EXIT = 1
COUNTER_BASE = 2

GATEUP_BLOCK = 16  # rows per gate (or up) block in an interleaved gate/up matrix
ROW_ALIGN = 16  # every matvec slab is a multiple of this many rows
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_ROWS = 256  # N = B * T activation rows per step that a program may have

# ARGMAX flags
FLAG_ADVANCE = 1  # lengths[b] += T
FLAG_FEEDBACK = 2  # tokens_in[n] = tokens_out[n] (T == 1 only): the next step needs no host input

# 64-bit operands: name -> (low word, high word)
WIDE = {"W": ("W_LO", "W_HI"), "STATE": ("STATE_LO", "STATE_HI")}

# header word holding a 64-bit value: name -> (low, high) keys
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def split64(x: int) -> tuple[int, int]:
    """A non-negative offset < 2^63 as (low, high) int32 words (low reinterpreted as signed)."""
    if x < 0:
        raise ValueError(f"offset must be non-negative, got {x}")
    lo, hi = x & 0xFFFFFFFF, x >> 32
    return (lo - (1 << 32) if lo >= 1 << 31 else lo), hi


def join64(lo: int, hi: int) -> int:
    return (lo & 0xFFFFFFFF) | (hi << 32)


def as_tensor(queues: list[list[list[int]]]) -> torch.Tensor:
    """Per-SM queues -> int32 [num_sms, max_len + 1, RECORD_WORDS], END-padded."""
    width = max((len(q) for q in queues), default=0) + 1
    out = torch.zeros(len(queues), width, RECORD_WORDS, dtype=torch.int32)
    for i, q in enumerate(queues):
        if q:
            out[i, : len(q)] = torch.tensor(q, dtype=torch.int32)
    return out
