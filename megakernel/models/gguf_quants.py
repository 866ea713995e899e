"""Dequantisation of GGUF tensor data to fp32, in torch, one block type a function.

GGUF (ggml) stores a quantized tensor as a row-major run of fixed-size blocks: each block holds
`block` consecutive elements of a row as small integers plus one or more fp16 scales. The values
are those of ggml's reference dequantisation (`x = d * q` or `x = d * q + m`, computed in fp32);
each function here reads the bytes of whole blocks and returns their elements in fp32, in order.

Layouts (bytes of one block; `d`, `m`, `dmin` fp16; `qs` packed quants):
- Q8_0 (32 elements, 34 B): d, int8 qs[32]; x = d * q.
- Q4_0 (32, 18 B): d, qs[16]; element j < 16 is the low nibble of qs[j], j >= 16 the high nibble
  of qs[j - 16]; x = d * (q - 8).
- Q4_1 (32, 20 B): d, m, qs[16] as Q4_0; x = d * q + m.
- Q5_0 (32, 22 B): d, qh (32 bits: the fifth bit of element j is bit j), qs[16]; x = d * (q - 16).
- Q5_1 (32, 24 B): d, m, qh, qs[16]; x = d * q + m.
- Q4_K (256, 144 B): d, dmin, scales[12] (eight 6-bit scales and mins), qs[128]; sub-block s of 32
  elements: x = d * sc[s] * q - dmin * mn[s]; chunk c of 64 elements takes the low nibbles of
  qs[32c : 32c + 32] then their high nibbles.
- Q5_K (256, 176 B): d, dmin, scales[12], qh[32], qs[128]; as Q4_K with a fifth bit: element l of
  sub-block s has bit s of qh[l].
- Q6_K (256, 210 B): ql[128], qh[64], int8 scales[16], d; each half of 128 elements reads 64 ql,
  32 qh; x = d * scale[16-element group] * (q - 32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["BLOCK_TYPES", "BlockType", "dequantize"]


@dataclass(frozen=True)
class BlockType:
    """A GGUF block type: elements per block, bytes per block and its dequantisation (raw bytes
    of n blocks as uint8 [n, nbytes] -> fp32 [n, block])."""

    name: str
    block: int
    nbytes: int
    fn: Callable[[torch.Tensor], torch.Tensor]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from uint8 [..., 2k] -> fp32 [..., k]."""
    return b.contiguous().view(torch.float16).float()


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8k] bits, bit j of the little-endian word at position j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], -1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * (_low_high(b[:, 2:]) - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * _low_high(b[:, 4:]) + _f16(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _low_high(b[:, 6:]) + 16.0 * _bits(b[:, 2:6]).float()
    return _f16(b[:, :2]) * (q - 16.0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _low_high(b[:, 8:]) + 16.0 * _bits(b[:, 4:8]).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of a Q4_K/Q5_K block -> (scales, mins), eight 6-bit values each:
    j < 4: sc = s[j] & 63, mn = s[j + 4] & 63; j >= 4: the low 4 bits from s[j + 4] (low nibble
    for sc, high for mn), the top 2 from the top bits of s[j - 4] (sc) and s[j] (mn)."""
    lo, hi = s[:, 0:4], s[:, 4:8]
    tail = s[:, 8:12]
    sc = torch.cat([lo & 63, (tail & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _k_dequant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = d * sc * q - dmin * mn over 8 sub-blocks of 32 (q: [n, 8, 32])."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return ((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(b.shape[0], 256)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs[128] -> [n, 8, 32]: chunk c's low nibbles are sub-block 2c, its high ones 2c + 1."""
    qs = qs.reshape(-1, 4, 32)
    return torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_dequant(b, _k_nibbles(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48]  # [n, 32]: bit s of qh[l] is the fifth bit of element l of sub-block s
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = ((qh.unsqueeze(1) >> shifts) & 1).float()  # [n, 8, 32]
    return _k_dequant(b, _k_nibbles(b[:, 48:176]) + 16.0 * high)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, ql row (0: l, 1: l + 32), l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)  # [half, -, l]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # one per 16 elements
    d = _f16(b[:, 208:210])
    # element 32k + l of a half (k = 0..3): low nibble of ql row k % 2 for k < 2, high nibble
    # for k >= 2; its two high bits are bits 2k, 2k + 1 of qh[l]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [n, 2, 4, 32]
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).float() - 32.0
    return (d * scales).repeat_interleave(16, dim=1) * q.reshape(n, 256)


BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("Q8_0", 32, 34, _q8_0),
    BlockType("Q4_0", 32, 18, _q4_0),
    BlockType("Q4_1", 32, 20, _q4_1),
    BlockType("Q5_0", 32, 22, _q5_0),
    BlockType("Q5_1", 32, 24, _q5_1),
    BlockType("Q4_K", 256, 144, _q4_k),
    BlockType("Q5_K", 256, 176, _q5_k),
    BlockType("Q6_K", 256, 210, _q6_k),
)}


def dequantize(raw: torch.Tensor, type_name: str, n_elements: int) -> torch.Tensor:
    """The raw bytes (uint8, any shape) of `n_elements` elements of block type `type_name`
    -> fp32 [n_elements]. ValueError when the byte count is not that of whole blocks."""
    t = BLOCK_TYPES[type_name]
    blocks, rest = divmod(n_elements, t.block)
    flat = raw.reshape(-1)
    if rest or flat.numel() != blocks * t.nbytes:
        raise ValueError(f"{flat.numel()} bytes do not hold {n_elements} {type_name} elements "
                         f"({t.nbytes} bytes per block of {t.block})")
    return t.fn(flat.reshape(blocks, t.nbytes)).reshape(n_elements)
