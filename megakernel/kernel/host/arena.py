"""Span arithmetic of the packed weight arena (program/pack.py lays it out): every entry starts on
a multiple of ALIGN elements, an FP8 matrix carries its scale block before its bytes. The MoE
expert stride (moe_index.x_stride) is two such spans, so the layout and the kernel's expert
addressing agree by construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megakernel.models.fp8 import Fp8Format

ALIGN = 64  # elements (128 bytes): bulk copies and 16-byte vector loads need 16-byte alignment


def align(n: int) -> int:
    """n rounded up to ALIGN elements."""
    return -(-n // ALIGN) * ALIGN


def scale_span(rows: int, chunks: int) -> int:
    """Arena elements of an fp8 matrix's scale block: rows * C fp32."""
    return 2 * rows * chunks


def matrix_span(shape: tuple[int, int], quant: Fp8Format | None) -> int:
    """Arena elements a packed matrix takes from an aligned start to the next aligned start (its
    scale block included): what places expert x + 1 after expert x (moe_index.x_stride)."""
    r, k = shape
    if quant is None:
        return align(r * k)
    return align(scale_span(r, quant.chunks(k))) + align(-(-r * k // 2))
