"""Index arithmetic of FP8 (e4m3) weight slabs (docs/FP8.md, "The packed layout" and "Kernel"),
no DSL: the loader (pipeline.py), both L2 lookaheads and the GEMV (matvec.py) call these on
Int32/Int64, the emulation (tests/kernel/test_kernel_fp8_emulation.py) on int, against
program/pack.PackedWeights.slab on packed FP8 weights.

The arena stays addressed in bf16 elements. An FP8 matrix [R, K] at entry offset `off` holds its
R*K codes row-major from byte 2*off, and a record's W is the byte of its slab's first code / 2,
W = off + ROW0*K/2 (ROW0*K is even). So the loader's byte address of a slab stays 2*W and only
the bytes per weight change (`slab_byte`). Scales: C fp32 per matrix row (C = 1 for channel
granularity, ceil(K/128) for block), rows in reverse order before the codes, row r's C scales
ascending at bytes [2*off - 4C(r + 1), 2*off - 4C r) (`scale_byte`): a record finds them from
its own W, ROW0 and K.

Conversion (memory.py): the GEMV loads 8 codes (one 8-byte vector: the 8 consecutive inputs of
one 16-byte bf16 lane vector) as two 32-bit words and converts each with two PTX
`cvt.rn.f16x2.e4m3x2` (sm_89+), code i of a word being its byte i (little-endian loads: the
lower address is the lower byte, which the cvt puts in the lower half). e4m3 values are exact in
f16, fp32 and bf16, so the FMA form widens them to fp32 and the mma form repacks them as the bf16
pairs of its B operand (`cvt.rn.bf16x2.f32`, exact) with the same word order as a bf16 tile.
"""

from __future__ import annotations

import math

from megakernel.kernel.host.limits import MMA_K_ALIGN

SCALE_CHUNK = 128  # inputs per block scale (models/fp8.Fp8Format.block[1])
SCALE_BYTES = 4  # fp32
CHUNK_STEPS = SCALE_CHUNK // MMA_K_ALIGN  # mma K-steps (32 inputs) per block scale
FP8_K_ALIGN = 16  # an FP8 K in steps of 16: 16-byte bulk copies of rows and K-chunks
GRANULARITIES = ("channel", "block")


def weight_bytes(fp8: bool) -> int:
    """Bytes of one weight in a slab: 1 (e4m3) or 2 (bf16)."""
    return 1 if fp8 else 2


def chunk_inputs(granularity: str) -> int:
    """Inputs per scale as a build constant: 0 for channel (one scale per row, whatever K is),
    SCALE_CHUNK for block."""
    return SCALE_CHUNK if granularity == "block" else 0


def scale_chunks(k, chunk: int):  # noqa: ANN001, ANN201 (int or Int32)
    """C: scales per row of K inputs (`chunk` from chunk_inputs; models/fp8.Fp8Format.chunks)."""
    return (k + chunk - 1) // chunk if chunk else 1


def scale_chunk_of(col, chunk: int):  # noqa: ANN001, ANN201
    """Scale index c of input `col` of a row (0 for channel)."""
    return col // chunk if chunk else 0


def slab_byte(w, row, col, k, wbytes):  # noqa: ANN001, ANN201
    """Arena byte of element (row, col) of the slab whose record W is `w` (row local to the
    slab), for weights of `wbytes` bytes: 2W + (row K + col) wbytes (bf16: the element
    W + row K + col; fp8: the code's own byte)."""
    return 2 * w + (row * k + col) * wbytes


def matrix_byte(w, row0, k):  # noqa: ANN001, ANN201
    """Byte 2*off of an FP8 matrix's first code, from a record's W and ROW0 (W = off + ROW0 K/2)."""
    return 2 * w - row0 * k


def scale_byte(w, row0, k, chunks, row, c):  # noqa: ANN001, ANN201
    """Arena byte of scale c of slab row `row` (matrix row ROW0 + row) of an FP8 slab whose
    record is (W, ROW0, K), C = `chunks` scales per row."""
    return (matrix_byte(w, row0, k) - SCALE_BYTES * chunks * (row0 + row + 1)
            + SCALE_BYTES * c)


def scale_run(w, row0, nrows, k, chunks):  # noqa: ANN001, ANN201
    """(first byte, bytes) of every scale of a slab's NROWS rows: one contiguous run (rows are
    reversed, so it starts at the last row's), 16-byte aligned for NROWS a multiple of 4."""
    return scale_byte(w, row0, k, chunks, nrows - 1, 0), SCALE_BYTES * chunks * nrows


def qkv_bias_index(w, row0, k, qkv_rows: int, row):  # noqa: ANN001, ANN201
    """Arena element of the bias of packed QKV row ROW0 + row when the layer's QKV matrix is
    FP8: the bf16 bias [QKV_ROWS] directly follows the R*K codes, at off + QKV_ROWS*K/2 (the
    bf16 twin is dense_index.qkv_bias_index)."""
    return w - row0 * k // 2 + qkv_rows * k // 2 + row0 + row


def mma_warp_steps(steps, num_warps: int, chunk_steps: int):  # noqa: ANN001, ANN201
    """K-steps (32 inputs) per warp when the mma GEMV cuts a tile's `steps` over the warps:
    ceil(steps / NW), rounded up to whole scale chunks (`chunk_steps` steps; 1 when no chunk
    boundary matters) so that a block-scaled warp slice starts at a chunk boundary."""
    per = (steps + num_warps - 1) // num_warps
    return (per + chunk_steps - 1) // chunk_steps * chunk_steps


def fp8_operand_byte(row, step, t, row_bytes):  # noqa: ANN001, ANN201
    """Byte in a ring stage of the 8 codes lane (g, t) converts for K-step `step` of tile row
    `row` (rows `row_bytes` apart): inputs 8t .. 8t + 7 of the step, the ones the bf16 form's
    words [4t, 4t + 4) hold (dense_index.mma_operand_word)."""
    return row * row_bytes + step * MMA_K_ALIGN + 8 * t


# ---- the conversion, on the host (PTX ISA: cvt.rn.f16x2.e4m3x2; e4m3 is OCP e4m3fn) ----------
def e4m3_value(code: int) -> float:
    """The value of an e4m3 code (sign, 4-bit exponent of bias 7, 3-bit mantissa; S.1111.111 is
    NaN, no infinities): what the hardware conversion yields, exactly."""
    code = int(code)  # (a numpy byte would wrap in the exponent arithmetic)
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return s * m * 2.0 ** -9
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def word_codes(word: int) -> list[int]:
    """The 4 codes of a 32-bit word as the device converts them: code i = byte i (the two cvt
    take the low, then the high 16 bits; each puts its low byte in its low half)."""
    return [(word >> (8 * i)) & 0xFF for i in range(4)]


def word_of(codes) -> int:  # noqa: ANN001
    """A little-endian 32-bit load of 4 consecutive code bytes."""
    return sum(int(c) << (8 * i) for i, c in enumerate(codes))
