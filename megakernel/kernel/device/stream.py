"""HBM read-stream kernel: the megakernel's loader pattern with nothing else, to measure what the
cost model assumes a CTA per SM can pull from HBM with cp.async.bulk into a shared-memory ring.

One CTA per SM streams a contiguous share of a buffer, `chunks` stages of `stage_bytes` each:

    loader (warp 0, lane 0)                 consumer (warp 1)
    wait empty[s] parity ((j / S) & 1) ^ 1  wait full[s] parity (j / S) & 1
    arrive.expect_tx(full[s], stage_bytes)  each lane xors one word of stage s into its result
    cp.async.bulk G2S -> stage s, full[s]   __syncwarp; lane 0 arrives on empty[s]

the same ring protocol, mbarrier waits (with the watchdog) and bulk copy as
kernel/device/pipeline.py. Lane l of chunk j reads word `l * (W / 32) + j % (W / 32)` of the stage
(W words per stage): the words touched spread over the whole stage and rotate with j, so a copy that
moved only part of a stage (or nothing) gives another result. The CTA's 32 lane results are
xor-reduced and stored as one word, out[cta]; megakernel.measure.bandwidth.stream_reference is the
host's twin of that reduction. Its AOT build is megakernel.kernel.toolchain.stream_build.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Int32, Int64, Uint8

from megakernel.kernel.device.pipeline import bulk_g2s, mbar_wait
from megakernel.kernel.host import limits
from megakernel.kernel.host.dense_index import ring_slot
from megakernel.kernel.host.limits import SMEM_STAGE_BYTES

STREAM_STAGES = 6  # the megakernel's ring at B = 1 (spec.make_spec)
STREAM_THREADS = 64  # warp 0 loads, warp 1 consumes
CUBIN_NAME, PTX_NAME, MANIFEST_NAME = "stream.cubin", "stream.ptx", "manifest.json"
KERNEL_NAME = "hbm_stream"
# the launch ABI, in order (checked against the PTX .entry by build_stream)
PARAMS = (("src", "ptr"), ("out", "ptr"), ("chunks", "i32"))


class HbmStream:
    """Static config: bytes per stage (a multiple of 128, <= 1 MiB - 1 for the mbarrier's
    transaction count) and stages in the ring."""

    def __init__(self, stage_bytes: int = SMEM_STAGE_BYTES, stages: int = STREAM_STAGES):
        if stage_bytes % 128 or not 0 < stage_bytes < (1 << 20):
            raise ValueError(f"stage_bytes must be a multiple of 128 below 1 MiB, got "
                             f"{stage_bytes}")
        if stages < 2:
            raise ValueError(f"a ring needs >= 2 stages, got {stages}")
        self.stage_bytes, self.S = stage_bytes, stages
        self.W = stage_bytes // 4  # int32 words per stage
        self.ring_bytes = stages * stage_bytes
        self.smem_bytes = self.ring_bytes + 8 * 2 * stages  # ring, then full[S], empty[S]
        if self.smem_bytes > limits.SMEM_BUDGET:
            raise ValueError(f"{stages} x {stage_bytes} B stages need {self.smem_bytes} B of "
                             f"shared memory > budget {limits.SMEM_BUDGET}")

    @cute.jit
    def __call__(self, src: cute.Pointer, out: cute.Pointer, chunks: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):
        self.kernel(src, out, chunks).launch(
            grid=[num_ctas, 1, 1], block=[STREAM_THREADS, 1, 1], smem=self.smem_bytes,
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Pointer, out: cute.Pointer, chunks: Int32):
        """src: int32 [num_ctas * chunks * W] (this CTA's share: `chunks` stages from
        bidx * chunks); out: int32 [num_ctas]."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        S, W = self.S, self.W

        smem = cutlass.memory.SmemAllocator()
        raw = smem.allocate_tensor(Uint8, cute.make_layout(self.smem_bytes), byte_alignment=128)
        ring = cute.recast_ptr(raw.iterator, dtype=Int32)  # [S][W]
        mbar = cute.recast_ptr(raw.iterator + self.ring_bytes, dtype=Int64)  # full[S], empty[S]
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(mbar + s, 1)  # full[s]: the loader's expect_tx
                cute.arch.mbarrier_init(mbar + S + s, 1)  # empty[s]: the consumer warp
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        base = src.toint() + Int64(bidx) * Int64(chunks) * Int64(self.stage_bytes)
        if warp == 0:
            if lane == 0:
                for j in cutlass.range(chunks):
                    s, _, empty_parity = ring_slot(j, S)
                    mbar_wait(mbar + S + s, empty_parity)
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, self.stage_bytes)
                    bulk_g2s((ring + s * W).toint(), base + Int64(j) * Int64(self.stage_bytes),
                             Int32(self.stage_bytes), mbar + s)
        else:
            acc = Int32(0)
            for j in cutlass.range(chunks):
                s, full_parity, _ = ring_slot(j, S)
                mbar_wait(mbar + s, full_parity)
                word = s * W + lane * (W // 32) + j % (W // 32)
                acc = acc ^ cute.make_tensor(ring + word, cute.make_layout(1))[0]
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.mbarrier_arrive(mbar + S + s)
            for k in cutlass.range_constexpr(5):
                acc = acc ^ cute.arch.shuffle_sync_bfly(acc, offset=16 >> k)
            if lane == 0:
                cute.make_tensor(out + bidx, cute.make_layout(1))[0] = acc
