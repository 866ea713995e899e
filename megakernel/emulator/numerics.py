"""Bit-level numerics the PTX names: bf16/e4m3 conversions, directed rounding, approximations.

Correctly rounded f32 add, sub, mul, div and sqrt are computed in float64 and rounded once to
float32 (exact: 53 >= 2 * 24 + 2); fma rounds the exact float64 product-sum, which can differ from
a true fused result only in a double-rounding tie; directed modes (.rz, .rm, .rp) step the nearest
float32 toward the exact value where they differ.
"""

from __future__ import annotations

import numpy as np

F32_MAX = np.float32(3.4028235e38)


def f32_round(x: np.ndarray, mode: str = "rn") -> np.ndarray:
    """float64 values rounded to float32 in a PTX rounding mode (rn, rz, rm, rp)."""
    f = x.astype(np.float32)
    if mode == "rn":
        return f
    back = f.astype(np.float64)
    if mode == "rz":
        fix = np.abs(back) > np.abs(x)
        return np.where(fix, np.nextafter(f, np.float32(0)), f)
    if mode == "rm":
        return np.where(back > x, np.nextafter(f, np.float32(-np.inf)), f)
    if mode == "rp":
        return np.where(back < x, np.nextafter(f, np.float32(np.inf)), f)
    raise ValueError(mode)


def ftz(x: np.ndarray) -> np.ndarray:
    """Flush float32 subnormals to sign-preserving zero (.ftz)."""
    tiny = np.abs(x) < np.float32(1.1754944e-38)
    return np.where(tiny & (x != 0), np.copysign(np.float32(0), x), x).astype(np.float32)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even; NaN -> canonical quiet NaN 0x7fff (cvt.rn.bf16.f32)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = (b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    out = r.astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FFF), out)


def _e4m3_table() -> np.ndarray:
    t = np.zeros(256, np.float16)
    for v in range(256):
        s, e, m = v >> 7, (v >> 3) & 15, v & 7
        if e == 15 and m == 7:
            x = np.nan
        elif e == 0:
            x = m / 8 * 2.0 ** -6
        else:
            x = (1 + m / 8) * 2.0 ** (e - 7)
        t[v] = -x if s else x
    return t


E4M3_TO_F16 = _e4m3_table()


def e4m3x2_to_f16x2(bits16: np.ndarray) -> np.ndarray:
    """cvt.rn.f16x2.e4m3x2: the low byte becomes the low half (exact)."""
    b = bits16.astype(np.uint32)
    lo = E4M3_TO_F16[b & 0xFF].view(np.uint16).astype(np.uint32)
    hi = E4M3_TO_F16[(b >> 8) & 0xFF].view(np.uint16).astype(np.uint32)
    return (hi << np.uint32(16)) | lo


def cvt_f32_to_int(x: np.ndarray, dtype: np.dtype, mode: str) -> np.ndarray:
    """cvt.{rzi,rni,rmi,rpi}.<int>.f32: rounded, saturated to the type, NaN -> 0."""
    f = {"rzi": np.trunc, "rni": np.rint, "rmi": np.floor, "rpi": np.ceil}[mode](
        x.astype(np.float64))
    info = np.iinfo(dtype)
    f = np.clip(np.nan_to_num(f, nan=0.0), info.min, info.max)
    return f.astype(dtype)
