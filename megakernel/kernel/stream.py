"""HBM read-stream kernel: the megakernel's loader pattern with nothing else, to measure what the
cost model assumes a CTA per SM can pull from HBM with cp.async.bulk into a shared-memory ring.

One CTA per SM streams a contiguous share of a buffer, `chunks` stages of `stage_bytes` each:

    loader (warp 0, lane 0)                 consumer (warp 1)
    wait empty[s] parity ((j / S) & 1) ^ 1  wait full[s] parity (j / S) & 1
    arrive.expect_tx(full[s], stage_bytes)  each lane xors one word of stage s into its result
    cp.async.bulk G2S -> stage s, full[s]   __syncwarp; lane 0 arrives on empty[s]

the same ring protocol, mbarrier waits (with the watchdog) and bulk copy as kernel/pipeline.py.
Lane l of chunk j reads word `l * (W / 32) + j % (W / 32)` of the stage (W words per stage): the
words touched spread over the whole stage and rotate with j, so a copy that moved only part of a
stage (or nothing) gives another result. The CTA's 32 lane results are xor-reduced and stored as
one word, out[cta]; megakernel.measure.stream_reference is the host's twin of that reduction.

    python -m megakernel.kernel.stream --out DIR [--arch sm_90a,sm_100a]

writes DIR/<arch>/{stream.cubin, stream.ptx, manifest.json} (megakernel.measure launches it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Int32, Int64, Uint8

from megakernel.arch import ARCHS
from megakernel.kernel import limits
from megakernel.kernel.dense_index import ring_slot
from megakernel.kernel.limits import SMEM_STAGE_BYTES
from megakernel.kernel.pipeline import bulk_g2s, mbar_wait

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


# ---- AOT build ----------------------------------------------------------------------------------
def build_stream(out_dir: str | Path, arch: str, stage_bytes: int = SMEM_STAGE_BYTES,
                 stages: int = STREAM_STAGES) -> dict:
    """Compile the stream kernel for `arch` into out_dir/<arch>/ and return its manifest; refuses
    (BuildError) a build with spills or local memory or a PTX entry other than PARAMS."""
    import torch  # noqa: F401  (the DSL imports it lazily on first compile; pay it up front)
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    from megakernel.kernel.build import BuildError, compile_kernel, dsl_version
    from megakernel.kernel.tools import parse_ptx_entry, resource_report

    if arch not in ARCHS:
        raise BuildError(f"unsupported arch {arch!r}; supported: {', '.join(ARCHS)}")
    k = HbmStream(stage_bytes, stages)
    dest = Path(out_dir) / arch
    dest.mkdir(parents=True, exist_ok=True)
    ptr = make_ptr(Int32, 256, cute.AddressSpace.gmem, assumed_align=16)
    args = [ptr, ptr, Int32(1), Int32(1), make_fake_stream()]
    with tempfile.TemporaryDirectory(prefix="mk-stream-") as dump:
        ptx_src, cubin_src, seconds = compile_kernel(k, args, arch, dump)
        shutil.copyfile(ptx_src, dest / PTX_NAME)
        shutil.copyfile(cubin_src, dest / CUBIN_NAME)
    entry = parse_ptx_entry((dest / PTX_NAME).read_text())
    kinds = tuple("ptr" if p.is_pointer else "i32" for p in entry.params)
    if kinds != tuple(kind for _, kind in PARAMS):
        raise BuildError(f"stream PTX entry takes {kinds}, the launcher passes {PARAMS}")
    res = resource_report(str(dest / CUBIN_NAME), str(dest / PTX_NAME), arch, entry.name)
    if res["spill_stores"] or res["spill_loads"] or res["local_bytes"] or res["local_stores"] \
            or res["local_loads"]:
        raise BuildError(f"stream kernel for {arch} spills or uses local memory: {res}")
    manifest = {
        "kernel": KERNEL_NAME,
        "arch": arch,
        "symbol": entry.name,
        "cubin": CUBIN_NAME,
        "ptx": PTX_NAME,
        "cubin_sha256": hashlib.sha256((dest / CUBIN_NAME).read_bytes()).hexdigest(),
        "block": [STREAM_THREADS, 1, 1],
        "dynamic_smem_bytes": k.smem_bytes,
        "stage_bytes": stage_bytes,
        "stages": stages,
        "params": [{"name": n, "kind": kind} for n, kind in PARAMS],
        "dsl_version": dsl_version(),
        "resources": res,
        "compile_seconds": round(seconds, 3),
    }
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="AOT-build the HBM read-stream kernel")
    ap.add_argument("--out", required=True, help="output directory (DIR/<arch>/...)")
    ap.add_argument("--arch", default=",".join(ARCHS))
    args = ap.parse_args(argv)
    for a in (x.strip() for x in args.arch.split(",") if x.strip()):
        m = build_stream(args.out, a)
        r = m["resources"]
        print(f"{a:8s} stream: regs {r['registers']}  spills {r['spill_stores']}/"
              f"{r['spill_loads']} B  local {r['local_bytes']} B  smem "
              f"{m['dynamic_smem_bytes']} B  compile {m['compile_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
