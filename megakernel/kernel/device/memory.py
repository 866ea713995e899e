"""Address arithmetic and vector loads/stores on raw global pointers (device code).

The kernel's parameters are plain pointers; instruction operands are element offsets. These
helpers turn (base, offset) into typed pointers and 16-byte vectors. Offsets that can exceed 2^31
elements (weights, KV cache) are carried as Int64.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from megakernel.isa import RECORD_WORDS
from megakernel.kernel.host.limits import VEC

L2_PREFETCH_CHUNK = 32 * 1024  # bytes per cp.async.bulk.prefetch.L2 (prefetch_l2)

# weights are read once per step: do not pollute L1, ask L2 for 256-byte lines
_W_ATOM_KW = dict(
    l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.NO_ALLOCATE,
    l2_prefetch_size=cute.nvgpu.L2PrefetchSize.SIZE_256B,
)


def join64(lo: Int32, hi: Int32) -> Int64:
    """(low word as unsigned, high word) -> a 64-bit element offset."""
    return (Int64(hi) << 32) | (Int64(lo) & Int64(0xFFFFFFFF))


def elem_ptr(base: cute.Pointer, offset, align: int) -> cute.Pointer:
    """`base + offset` elements, as a global pointer assumed `align`-byte aligned."""
    width = base.dtype.width // 8
    addr = base.toint() + Int64(offset) * Int64(width)
    return cute.make_ptr(base.dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


def weight_atom():
    return cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                               **_W_ATOM_KW)


def load_weights8(atom, base: cute.Pointer, offset: Int64):
    """8 bf16 weights at `base + offset` (16-byte aligned) -> fp32 TensorSSA [8]."""
    g = cute.make_tensor(elem_ptr(base, offset, 16), cute.make_layout(VEC))
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.copy(atom, g, r)
    return r.load().to(Float32)


def load_bf16x8(base: cute.Pointer, offset) -> cute.TensorSSA:
    """8 bf16 activations at `base + offset` (16-byte aligned) -> fp32 [8] (L1-cached load)."""
    g = cute.make_tensor(elem_ptr(base, offset, 16), cute.make_layout(VEC))
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(g, r)
    return r.load().to(Float32)


def load_bf16_vec(base: cute.Pointer, offset, n: int):
    """n (2, 4 or 8) consecutive bf16 at `base + offset` (aligned to 2n bytes) -> fp32 [n]."""
    g = cute.make_tensor(elem_ptr(base, offset, 2 * n), cute.make_layout(n))
    r = cute.make_rmem_tensor((n,), BFloat16)
    cute.autovec_copy(g, r)
    return r.load().to(Float32)


def load_bf16_into(dst: cute.Tensor, base: cute.Pointer, offset, n: int) -> None:
    """n (2, 4 or 8) consecutive bf16 at `base + offset` (aligned to 2n bytes) into the bf16
    register tensor `dst` [n], left unconverted: loads in flight hold half the registers."""
    g = cute.make_tensor(elem_ptr(base, offset, 2 * n), cute.make_layout(n))
    cute.autovec_copy(g, dst)


def load_f32_into(dst: cute.Tensor, base: cute.Pointer, offset, n: int) -> None:
    """n consecutive fp32 at `base + offset` (aligned to 4n bytes, as store_f32_vec wrote them)
    into the fp32 register tensor `dst` [n]."""
    g = cute.make_tensor(elem_ptr(base, offset, 4 * n), cute.make_layout(n))
    cute.autovec_copy(g, dst)


def store_f32_vec(base: cute.Pointer, offset, v, n: int) -> None:
    """n consecutive fp32 to `base + offset` (aligned to 4n bytes)."""
    r = cute.make_rmem_tensor((n,), Float32)
    r.store(v)
    g = cute.make_tensor(elem_ptr(base, offset, 4 * n), cute.make_layout(n))
    cute.autovec_copy(r, g)


def load_f32x8(base: cute.Pointer, offset) -> cute.TensorSSA:
    """8 fp32 at `base + offset` (16-byte aligned) -> fp32 [8]."""
    g = cute.make_tensor(elem_ptr(base, offset, 16), cute.make_layout(VEC))
    r = cute.make_rmem_tensor((VEC,), Float32)
    cute.autovec_copy(g, r)
    return r.load()


def store_f32x8(base: cute.Pointer, offset, v) -> None:
    r = cute.make_rmem_tensor((VEC,), Float32)
    r.store(v)
    g = cute.make_tensor(elem_ptr(base, offset, 16), cute.make_layout(VEC))
    cute.autovec_copy(r, g)


def smem_vec8(s: cute.Tensor, offset):
    """View of 8 consecutive elements of a 1-D shared tensor (offset a multiple of 8)."""
    return cute.flat_divide(s, (VEC,))[None, offset // VEC]


def load_smem_bf16x8(s: cute.Tensor, offset):
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    cute.autovec_copy(smem_vec8(s, offset), r)
    return r.load().to(Float32)


def store_smem_bf16x8(s: cute.Tensor, offset, v) -> None:
    """fp32 [8] -> bf16 (round to nearest even) -> shared."""
    r = cute.make_rmem_tensor((VEC,), BFloat16)
    r.store(v.to(BFloat16))
    cute.autovec_copy(r, smem_vec8(s, offset))


def smem_words(s: cute.Tensor) -> cute.Tensor:
    """A 1-D shared bf16 tensor viewed as 32-bit words (pairs of bf16, for mma operands)."""
    return cute.make_tensor(cute.recast_ptr(s.iterator, dtype=Int32),
                            cute.make_layout(cute.size(s) // 2))


def load_smem_words4(w: cute.Tensor, offset, r: cute.Tensor) -> None:
    """4 consecutive 32-bit words (16 bytes, `offset` a multiple of 4) -> rmem Int32 [4] `r`."""
    cute.autovec_copy(cute.flat_divide(w, (4,))[None, offset // 4], r)


def ld(base: cute.Pointer, offset):
    """Scalar global load of `base[offset]`."""
    return cute.make_tensor(elem_ptr(base, offset, base.dtype.width // 8), cute.make_layout(1))[0]


def record_word(queue: cute.Pointer, pc, w: int):
    """Word `w` (fields.py: a field named through the registry) of record `pc` of a queue."""
    return ld(queue, pc * RECORD_WORDS + w)


def st(base: cute.Pointer, offset, value) -> None:
    """Scalar global store `base[offset] = value`."""
    t = cute.make_tensor(elem_ptr(base, offset, base.dtype.width // 8), cute.make_layout(1))
    t[0] = value


@cute.jit
def prefetch_l2(base: cute.Pointer, first: Int64, nbytes: int, tidx: Int32):
    """Ask L2 for `nbytes` (static) from element `first` of `base` (thread 0, in chunks of
    L2_PREFETCH_CHUNK; a 16-byte aligned span only): a recurrent record's states, which predate
    the step, while the CTA waits for its dependency."""
    if tidx == 0:
        addr = base.toint() + first * Int64(base.dtype.width // 8)
        if addr % Int64(16) == Int64(0):
            for off in cutlass.range(0, nbytes, L2_PREFETCH_CHUNK, unroll=1):
                size = cutlass.min(Int32(L2_PREFETCH_CHUNK), Int32(nbytes) - off)
                cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                                     read_only_args=[addr + Int64(off), size])


@cute.jit
def prefetch_l2_at(addr: Int64, nbytes: Int32):
    """One cp.async.bulk.prefetch.L2 of [addr, addr + nbytes) (a multiple of 16 bytes)."""
    cute.arch.inline_ptx("cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                         read_only_args=[addr, nbytes])


@cute.jit
def prefetch_span(addr: Int64, nbytes: Int32):
    """cp.async.bulk.prefetch.L2 of [addr, addr + nbytes) in L2_PREFETCH_CHUNK requests."""
    for off in cutlass.range(0, nbytes, L2_PREFETCH_CHUNK):
        prefetch_l2_at(addr + Int64(off), cutlass.min(Int32(L2_PREFETCH_CHUNK), nbytes - off))


def load_words4(addr: Int64, r: cute.Tensor) -> None:
    """4 32-bit words at global byte address `addr` (16-byte aligned) -> rmem Int32 [4] `r`:
    bf16 pairs as mma operands."""
    g = cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16),
                         cute.make_layout(4))
    cute.autovec_copy(g, r)


def ld_word(addr: Int64) -> Int32:
    """One 32-bit word at global byte address `addr` (4-byte aligned): a bf16 pair."""
    return cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4),
                            cute.make_layout(1))[0]


# a pair of fp32 as bf16 hi + lo words (cvt.rn.bf16x2.f32: element 0 low, 1 high): hi the
# rounded pair, lo the rounded remainders, so hi + lo carries 16 bits of each mantissa
_SPLIT_BF16X2 = """{
.reg .b32 h, t0, t1;
.reg .f32 f0, f1;
cvt.rn.bf16x2.f32 h, {$r1}, {$r0};
shl.b32 t0, h, 16;
and.b32 t1, h, 0xFFFF0000;
mov.b32 f0, t0;
mov.b32 f1, t1;
sub.f32 f0, {$r0}, f0;
sub.f32 f1, {$r1}, f1;
cvt.rn.bf16x2.f32 {$w1}, f1, f0;
mov.b32 {$w0}, h;
}"""


def split_bf16x2(x0: Float32, x1: Float32):
    """(hi, lo) words of the pair (x0, x1): hi = bf16 (x0, x1), lo = bf16 of what hi misses."""
    return cute.arch.inline_ptx(_SPLIT_BF16X2, write_only_types=[Int32, Int32],
                                read_only_args=[x0, x1])


# ---- FP8 (e4m3) weights (fp8_index.py: the byte arithmetic and the host emulation) -------------
# 4 codes of a 32-bit word -> 4 fp32: two hardware conversions cvt.rn.f16x2.e4m3x2 (sm_89+; code
# i of the word is byte i, each cvt puts its low byte in its low half), then f16 -> fp32 (exact:
# every e4m3 value is an f16 one)
_E4M3X4_F32 = """{
.reg .b16 l, h, a0, a1, a2, a3;
.reg .b32 p0, p1;
mov.b32 {l, h}, {$r0};
cvt.rn.f16x2.e4m3x2 p0, l;
cvt.rn.f16x2.e4m3x2 p1, h;
mov.b32 {a0, a1}, p0;
mov.b32 {a2, a3}, p1;
cvt.f32.f16 {$w0}, a0;
cvt.f32.f16 {$w1}, a1;
cvt.f32.f16 {$w2}, a2;
cvt.f32.f16 {$w3}, a3;
}"""
# the same 4 codes as two bf16 pairs (an mma B operand word: element 2i low, 2i + 1 high; exact)
_E4M3X4_BF16X2 = """{
.reg .b16 l, h, a0, a1, a2, a3;
.reg .b32 p0, p1;
.reg .f32 f0, f1, f2, f3;
mov.b32 {l, h}, {$r0};
cvt.rn.f16x2.e4m3x2 p0, l;
cvt.rn.f16x2.e4m3x2 p1, h;
mov.b32 {a0, a1}, p0;
mov.b32 {a2, a3}, p1;
cvt.f32.f16 f0, a0;
cvt.f32.f16 f1, a1;
cvt.f32.f16 f2, a2;
cvt.f32.f16 f3, a3;
cvt.rn.bf16x2.f32 {$w0}, f1, f0;
cvt.rn.bf16x2.f32 {$w1}, f3, f2;
}"""


def fp8_atom():
    """8 e4m3 codes (two 32-bit words) from global memory, with the weights' cache hints."""
    return cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=64,
                               **_W_ATOM_KW)


def load_fp8_words(atom, addr: Int64, r: cute.Tensor) -> None:
    """The 8 codes at global byte address `addr` (8-byte aligned) -> rmem Int32 [2] `r`."""
    g = cute.make_tensor(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=8),
                         cute.make_layout(2))
    cute.copy(atom, g, r)


def load_smem_words2(w: cute.Tensor, offset, r: cute.Tensor) -> None:
    """2 consecutive 32-bit words (8 bytes, `offset` a multiple of 2) -> rmem Int32 [2] `r`."""
    cute.autovec_copy(cute.flat_divide(w, (2,))[None, offset // 2], r)


def e4m3x8_f32(words: cute.Tensor) -> cute.TensorSSA:
    """8 codes (rmem Int32 [2]) -> fp32 [8], in input order (the hardware conversion)."""
    out = cute.make_rmem_tensor((VEC,), Float32)
    for i in range(2):  # (plain Python: unrolled while traced)
        f = cute.arch.inline_ptx(_E4M3X4_F32, write_only_types=[Float32] * 4,
                                 read_only_args=[words[i]])
        for j in range(4):
            out[4 * i + j] = f[j]
    return out.load()


def e4m3x4_bf16x2(word: Int32):
    """4 codes (one word) -> two words of bf16 pairs (codes 0, 1 and 2, 3), exact."""
    return cute.arch.inline_ptx(_E4M3X4_BF16X2, write_only_types=[Int32, Int32],
                                read_only_args=[word])


def ld_f32_at(addr: Int64) -> Float32:
    """Scalar fp32 load at global byte address `addr` (4-byte aligned; L1-cached): a scale."""
    return cute.make_tensor(cute.make_ptr(Float32, addr, cute.AddressSpace.gmem, assumed_align=4),
                            cute.make_layout(1))[0]
