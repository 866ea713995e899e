"""The megakernel instruction set: fixed-width int32 records, the buffers they name, the counters.

This module is the contract between the program compiler (host), the CPU executor and the CuTe DSL
kernel. Everything the device needs to interpret a program is described here; change it only
together with `FORMAT_VERSION`.

Records
-------
An instruction is `RECORD_WORDS` (16) int32 words. Words 0..5 are common to every opcode:

    0 OPCODE       one of `Op`
    1 WAIT_CID     counter to wait on before reading any activation (-1: no wait)
    2 WAIT_TARGET  increments of WAIT_CID this step that must be visible (local to the step)
    3 WAIT_TOTAL   increments WAIT_CID receives per step (for the epoch, below)
    4 SIGNAL_CID   counter to add 1 to after all of this instruction's stores (-1: none)
    5 LAYER        decoder layer (-1 for instructions outside the layers)

Words 6..15 are operands whose meaning depends on the opcode; `OPERANDS` is the table. A program
is an int32 tensor `[num_sms, max_queue, 16]`; CTA `i` walks row `i` until it meets opcode
`END` (0), so queues are padded with zero records. The grid is exactly `num_sms` CTAs, all
co-resident (they spin on each other).

Format history: 1 = first version; 2 = ATTN_REDUCE folded into the last ATTN_PARTIAL of each
(sequence, kv head) (opcode 4 reserved), ATTN_PARTIAL gains OUT_OFF and DONE_CID.

Execution of one record by one CTA:
1. (may start before step 2) stream the weight slab, if the opcode has one, into shared memory:
   weights never depend on activations, so the loader runs ahead of the wait ("no bubbles").
   The same holds for an ATTN_PARTIAL's cached keys/values below lengths[b]: only the T new
   positions depend on this step's QKV.
2. wait: spin with acquire loads until `counter[WAIT_CID] - (epoch * WAIT_TOTAL + WAIT_TARGET)`,
   computed in wrapping int32 arithmetic, is >= 0.
3. read activations, compute, store (fp32 or bf16, at the rounding points below).
4. all threads' stores done (CTA barrier), then one thread adds 1 to `counter[SIGNAL_CID]` with
   release semantics (`red.release.gpu.add`).

Counters and epochs (no host work between steps)
------------------------------------------------
`counters` is int32 `[COUNTER_BASE + num_counters]`, zeroed once when the buffers are allocated and
never again by the host. Word `EPOCH` (0) holds the number of completed steps; word `EXIT` (1)
counts CTAs that finished. Program counter `c` lives at `COUNTER_BASE + c` (instruction fields hold
`c`, not the word index). Each program counter receives the same number of increments every step
(`WAIT_TOTAL`), so at the start of step `e` its value is `e * WAIT_TOTAL`; targets are therefore
`e * WAIT_TOTAL + WAIT_TARGET` and counters never need a reset. Every CTA reads `EPOCH` once when it
starts. When it has run its queue it does `old = atomic_add(counters[EXIT], 1)`; the CTA that gets
`old == e * num_sms + num_sms - 1` (wrapping int32) is the last one, and it stores `e + 1` to
`EPOCH`. The bump happens after every CTA has read the epoch, and the next launch (same stream) sees
it. Why epochs rather than a device-side reset: a reset needs the last CTA to rewrite every counter
(serial work at the end of every step, on the critical path) and an extra fence; with epochs the
only end-of-step work is one atomic per CTA. Wrap-around compares keep this correct past 2^31.

Buffers (the buffer plan)
-------------------------
The kernel gets one pointer per arena; instruction operands are element offsets into them.

    weights   bf16  packed weight arena (megakernel.program.pack); offsets may exceed 2^31, so
                    slab offsets are split into W_LO (low 32 bits, unsigned) and W_HI words.
                    Norm vectors are packed first, so their offsets fit in one int32 word.
    f32       fp32  h residual [N, H] | attention partial o [S, N, Hq, D] | partial (m, l)
                    [S, N, Hq, 2] | logits [N, V] | partial argmax [n_lm_tiles, N, 2]
                    (value, index as an exact float) | rope cos, sin tables [S_max, D/2] each
                    (constants written by the host, not scratch)
    bf16      bf16  q [N, Hq, D] | attention output [N, Hq * D] | MLP activation [N, I]
    i32       int32 tokens_in [N] | tokens_out [N] | lengths [B]
    k, v      bf16  KV cache [L, B, Hkv, S_max, D] each (the reference's layout)
    counters  int32 as above

N = B * T activation rows; row n is token t = n % T of sequence b = n // T. S = attention splits.
`Program.header` holds every size and base offset; operands repeat the offsets an opcode needs.

Positions: token t of sequence b sits at position p = lengths[b] + t. The QKV epilogue writes k, v
of row n at cache position p; attention for that query covers keys 0..p. lengths are read at run
time, so one program serves every ragged length pattern with lengths[b] + T <= S_max (the host
checks this before a step).

Attention splits: the keys 0 .. ctx-1 of sequence b (ctx = lengths[b] + T) are divided into
`n_splits` ranges [floor(s * ctx / S), floor((s + 1) * ctx / S)); split s of query token t covers
that range clipped to keys <= lengths[b] + t (possibly empty: then m = -inf, l = 0, o = 0). The
partial is unnormalised: m = max score, l = sum exp(score - m), o = sum exp(score - m) * v. Scores
are (q . k) / sqrt(D) in fp32. The merge combines splits 0..S-1 in order with M = max m,
out = sum(o_s * exp(m_s - M)) / sum(l_s * exp(m_s - M)), rounded to bf16.

Split-KV merge (format 2): after storing its partial, an ATTN_PARTIAL CTA adds 1 to SIGNAL_CID
(its (b, g) ticket counter, S increments per step) with an acq_rel atomic that returns the old
value. The CTA that gets old == epoch * S + S - 1 (wrapping int32) was the last of the S splits:
its acquire makes the other partials visible, so it merges splits 0..S-1 of (b, g) in order
(formula above), stores the bf16 output rows of heads g*G .. g*G+G-1 for all T tokens, and then
adds 1 to DONE_CID with release semantics. Consumers of the attention output wait on DONE_CID
(B * Hkv increments per step). The merged value does not depend on which split merges. This saves
a dependency hop per layer compared with format 1's separate ATTN_REDUCE.

bf16 rounding points (identical in the reference's "bf16" mode): residual h stays fp32; RMSNorm in
fp32 times the bf16 weight, rounded to bf16 = matvec input; matvec accumulates in fp32; q/k get
(qwen3) per-head RMSNorm in fp32, then RoPE in fp32 with the fp32 cos/sin table, then round to bf16
(q to the q buffer, k to the cache); v rounded into the cache; attention in fp32, output rounded to
bf16; silu(gate) * up in fp32, rounded to bf16; o_proj/down results added to h in fp32; logits fp32;
argmax picks the lowest index among equal maxima.

Packed weight matrices (see pack.py): every matrix is row-major [rows, K] bf16, so a slab of rows
[ROW0, ROW0 + NROWS) is one contiguous run starting at element `base + ROW0 * K`; the instruction's
W_LO/W_HI already point at the slab's first element. Row orders:
- QKV of a layer: for each kv head g: the q heads g*G .. g*G+G-1 (G = Hq / Hkv), then k head g, then
  v head g; each head is D consecutive rows in the original order. A QKV slab is whole heads of one
  group, so qk-norm and RoPE run in the epilogue. Packed row r is head slot r // D of the layer;
  slot j = slot - g * (G + 2) of group g is q head g*G + j for j < G, k for j == G, v for
  j == G + 1.
- gate/up of a layer: blocks of `GATEUP_BLOCK` rows alternate, [gate rows 16j .. 16j+15, up rows
  16j .. 16j+15] for j = 0 .. I/16 - 1; a slab covers whole blocks, and its output columns are
  ROW0 / 2 .. (ROW0 + NROWS) / 2 - 1 of the activation.
- o_proj, down, lm_head (the embedding matrix when tied): the original rows.
"""

from __future__ import annotations

from enum import IntEnum

import torch

FORMAT_VERSION = 2
RECORD_WORDS = 16
COMMON_WORDS = 6
NO_COUNTER = -1

# counters[] words before the program counters
EPOCH = 0
EXIT = 1
COUNTER_BASE = 2

GATEUP_BLOCK = 16  # rows per gate (or up) block in the interleaved gate/up matrix
ROW_ALIGN = 16  # every matvec slab is a multiple of this many rows
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_ROWS = 256  # N = B * T activation rows per step that a program may have

# ARGMAX flags
FLAG_ADVANCE = 1  # lengths[b] += T
FLAG_FEEDBACK = 2  # tokens_in[n] = tokens_out[n] (T == 1 only): the next step needs no host input


class Op(IntEnum):
    END = 0
    EMBED = 1
    QKV = 2
    ATTN_PARTIAL = 3
    # 4 is reserved (ATTN_REDUCE in format 1; the merge now ends the last ATTN_PARTIAL)
    OPROJ = 5
    GATEUP = 6
    DOWN = 7
    LMHEAD = 8
    ARGMAX = 9


MATVEC_OPS = (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN, Op.LMHEAD)

# Matvec records share words 6..13; words 14, 15 are per-opcode.
_MATVEC = (
    ("W_LO", "weights: element offset of the slab's first element, low 32 bits (unsigned)"),
    ("W_HI", "weights: high 32 bits of that offset"),
    ("ROW0", "first packed row of the slab within its matrix"),
    ("NROWS", "rows in the slab (multiple of ROW_ALIGN)"),
    ("K", "row length = input features"),
    ("NORM_OFF", "weights: RMSNorm weight [K] of the prologue (-1: input is already bf16)"),
    ("IN_OFF", "input: f32 h [N, K] when NORM_OFF >= 0, else bf16 [N, K]"),
    ("OUT_OFF", "output base (see the opcode)"),
)

OPERANDS: dict[Op, tuple[tuple[str, str], ...]] = {
    Op.END: (),
    Op.EMBED: (
        ("W_LO", "weights: embedding matrix [V, H] base, low 32 bits"),
        ("W_HI", "high 32 bits"),
        ("N0", "first activation row"),
        ("N1", "one past the last activation row"),
        ("K", "hidden size H"),
        ("TOK_OFF", "i32: tokens_in [N]"),
        ("OUT_OFF", "f32: h [N, H]; h[n] = fp32(embedding[tokens_in[n]])"),
    ),
    Op.QKV: _MATVEC
    + (
        ("QK_NORM_OFF", "weights: q_norm [D] then k_norm [D] (-1: no qk-norm)"),
        ("ROPE_OFF", "f32: cos [S_max, D/2] then sin [S_max, D/2]"),
    ),
    # QKV: OUT_OFF = bf16 q [N, Hq, D]; k, v rows go to the cache at (LAYER, b, g, lengths[b] + t).
    Op.ATTN_PARTIAL: (
        ("B_IDX", "sequence b"),
        ("KV_HEAD", "kv head g (serves q heads g*G .. g*G+G-1)"),
        ("SPLIT", "split s"),
        ("N_SPLITS", "S"),
        ("Q_OFF", "bf16: q [N, Hq, D]"),
        ("PO_OFF", "f32: partial o [S, N, Hq, D]"),
        ("PML_OFF", "f32: partial (m, l) [S, N, Hq, 2]"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("OUT_OFF", "bf16: attention output [N, Hq * D] (written by the merge)"),
        ("DONE_CID", "counter the merging CTA adds 1 to after storing the merged output"),
    ),
    # ATTN_PARTIAL: SIGNAL_CID is the (b, g) ticket counter; see "Split-KV merge" above.
    Op.OPROJ: _MATVEC,  # OUT_OFF = f32 h [N, H]: h[n, ROW0 + r] += acc (fp32)
    Op.GATEUP: _MATVEC,  # OUT_OFF = bf16 act [N, I]: act[n, ROW0/2 + c] = bf16(silu(g) * u)
    Op.DOWN: _MATVEC,  # OUT_OFF = f32 h [N, H]: h[n, ROW0 + r] += acc (fp32)
    Op.LMHEAD: _MATVEC
    + (
        ("TILE", "partial-argmax slot of this slab"),
        ("PARG_OFF", "f32: partial argmax [n_lm_tiles, N, 2] = (max logit, its vocab index)"),
    ),
    # LMHEAD: OUT_OFF = f32 logits [N, V]; slot TILE gets the slab's max and lowest index of it.
    Op.ARGMAX: (
        ("N_TILES", "partial-argmax slots"),
        ("PARG_OFF", "f32: partial argmax [n_tiles, N, 2]"),
        ("OUT_OFF", "i32: tokens_out [N]"),
        ("TOK_OFF", "i32: tokens_in [N]"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("FLAGS", "FLAG_ADVANCE | FLAG_FEEDBACK"),
    ),
}

OP_DOC: dict[Op, str] = {
    Op.END: "end of this CTA's queue",
    Op.EMBED: "gather embedding rows of tokens_in[N0:N1] into h (fp32)",
    Op.QKV: "RMSNorm(h) -> slab of fused QKV -> (qwen3) q/k norm -> RoPE -> q buffer, k/v cache",
    Op.ATTN_PARTIAL: "split-KV attention of one (sequence, kv head, split): T tokens, G q heads;"
    " the last split to finish merges all S into the bf16 attention output",
    Op.OPROJ: "slab of o_proj on the attention output, added into h",
    Op.GATEUP: "RMSNorm(h) -> slab of interleaved gate/up -> silu(gate) * up (bf16)",
    Op.DOWN: "slab of down_proj on the MLP activation, added into h",
    Op.LMHEAD: "final RMSNorm(h) -> vocab slab of the LM head -> logits + partial argmax",
    Op.ARGMAX: "merge partial argmaxes -> tokens_out; optionally advance lengths, feed tokens back",
}

COMMON_FIELDS = ("OPCODE", "WAIT_CID", "WAIT_TARGET", "WAIT_TOTAL", "SIGNAL_CID", "LAYER")
_NAMES = {op: tuple(n for n, _ in ops) for op, ops in OPERANDS.items()}
_FIELDS = {op: COMMON_FIELDS + names for op, names in _NAMES.items()}


def field_index(op: Op, name: str) -> int:
    """Word index of operand `name` of opcode `op` (common fields included)."""
    if name in COMMON_FIELDS:
        return COMMON_FIELDS.index(name)
    names = [n for n, _ in OPERANDS[op]]
    if name not in names:
        raise KeyError(f"opcode {op.name} has no operand {name!r}; operands: {names}")
    return COMMON_WORDS + names.index(name)


def split64(x: int) -> tuple[int, int]:
    """A non-negative offset < 2^63 as (low, high) int32 words (low reinterpreted as signed)."""
    if x < 0:
        raise ValueError(f"offset must be non-negative, got {x}")
    lo, hi = x & 0xFFFFFFFF, x >> 32
    return (lo - (1 << 32) if lo >= 1 << 31 else lo), hi


def join64(lo: int, hi: int) -> int:
    return (lo & 0xFFFFFFFF) | (hi << 32)


def encode(
    op: Op,
    *,
    wait: tuple[int, int, int] | None = None,
    signal: int = NO_COUNTER,
    layer: int = -1,
    **operands: int,
) -> list[int]:
    """One record. `wait` = (counter, local target, per-step total); operands by name.

    W_LO/W_HI may be given as one `W` (a 64-bit element offset).
    """
    if "W" in operands:
        operands["W_LO"], operands["W_HI"] = split64(operands.pop("W"))
    names = _NAMES[op]
    if len(operands) != len(names) or not all(n in operands for n in names):
        unknown = sorted(set(operands) - set(names))
        if unknown:
            raise KeyError(f"opcode {op.name} has no operands {unknown}; operands: {list(names)}")
        raise KeyError(f"opcode {op.name} is missing operands {sorted(set(names) - set(operands))}")
    cid, target, total = wait if wait is not None else (NO_COUNTER, 0, 0)
    rec = [int(op), cid, target, total, signal, layer]
    rec += [int(operands[n]) for n in names]
    for i, v in enumerate(rec):
        if not -(1 << 31) <= v < (1 << 31):
            name = (COMMON_FIELDS + names)[i]
            raise OverflowError(f"field {name}={v} of {op.name} does not fit in int32")
    rec += [0] * (RECORD_WORDS - len(rec))
    return rec


def decode(rec) -> dict[str, int]:
    """A record (sequence of 16 ints) as {field: value}; adds `W` (64-bit) for slab opcodes."""
    words = rec if isinstance(rec, list) else [int(x) for x in rec]
    if len(words) != RECORD_WORDS:
        raise ValueError(f"a record has {RECORD_WORDS} words, got {len(words)}")
    op = Op(words[0])
    out = dict(zip(_FIELDS[op], words, strict=False))
    out["OPCODE"] = op
    if "W_LO" in out:
        out["W"] = join64(out["W_LO"], out["W_HI"])
    return out


def describe(rec) -> str:
    """Human-readable one-liner of a record, for error messages and dumps."""
    d = decode(rec)
    op = d.pop("OPCODE")
    parts = [f"{k}={v}" for k, v in d.items() if k not in ("W_LO", "W_HI")]
    return f"{op.name}(" + ", ".join(parts) + ")"


def table_markdown() -> str:
    """The opcode/operand table as markdown (for docs and `plan --isa`)."""
    lines = [f"ISA format version {FORMAT_VERSION}, {RECORD_WORDS} int32 words per record", ""]
    lines += ["| word | common field |", "|---|---|"]
    lines += [f"| {i} | {n} |" for i, n in enumerate(COMMON_FIELDS)]
    for op in Op:
        lines += ["", f"**{op.value} {op.name}**: {OP_DOC[op]}", ""]
        for i, (n, doc) in enumerate(OPERANDS[op]):
            lines.append(f"- word {COMMON_WORDS + i} `{n}`: {doc}")
    return "\n".join(lines)


def as_tensor(queues: list[list[list[int]]]) -> torch.Tensor:
    """Per-SM queues -> int32 [num_sms, max_len + 1, RECORD_WORDS], END-padded."""
    width = max((len(q) for q in queues), default=0) + 1
    out = torch.zeros(len(queues), width, RECORD_WORDS, dtype=torch.int32)
    for i, q in enumerate(queues):
        if q:
            out[i, : len(q)] = torch.tensor(q, dtype=torch.int32)
    return out


assert all(len(v) <= RECORD_WORDS - COMMON_WORDS for v in OPERANDS.values())
