"""Cross-CTA dependencies: counters with acquire/release, epochs, end-of-step housekeeping.

Protocol (isa.py): a consumer's thread 0 spins with `ld.acquire.gpu` on its counter until
`counter - (epoch * WAIT_TOTAL + WAIT_TARGET)` (wrapping int32) is >= 0, backing off with
`nanosleep`, then the CTA barrier publishes the acquire to every thread. The other threads' plain
(L1-cached) activation loads after that barrier cannot hit stale L1 lines: a GPU-scope acquire
(load or acq_rel atomic) compiles to a strong load followed by `CCTL.IVALL`, which invalidates the
SM's whole L1 (checked on the SASS by tests/kernel/test_kernel_build.py). A producer's CTA barrier
orders all threads' stores before thread 0's `fence.acq_rel.gpu` + `red.release.gpu.add`.
Counters are never reset: targets grow with the epoch, which the last CTA to finish bumps.

Watchdog: a wait that has not been met after `WAIT_TIMEOUT_NS` of `%globaltimer` executes `trap`,
so a deadlock (a counter that never reaches its target) ends the launch with CUDA's "illegal
instruction" error instead of hanging the GPU. No correct step waits anywhere near that long.

`named`: the consumer thread count when a loader warp is present (pipeline.py): the CTA barriers
are then named barrier 1 over the consumer warps; 0 = `__syncthreads`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from megakernel import isa

SLEEP_MIN_NS = 32
SLEEP_MAX_NS = 512
WAIT_TIMEOUT_NS = 10_000_000_000  # 10 s: a decode step takes milliseconds
CONSUMER_BARRIER_ID = 1  # named barrier of the consumer warps (0 = __syncthreads)


def cta_sync(named_threads: int) -> None:
    """Barrier over the consumer threads: `__syncthreads` without a loader warp (0), else named
    barrier 1 over `named_threads` (plain Python: chosen when the kernel is traced)."""
    if named_threads:
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER_ID, number_of_threads=named_threads)
    else:
        cute.arch.sync_threads()


@cute.jit
def nanosleep(ns: Int32):
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[ns])


@cute.jit
def read_epoch(counters: cute.Pointer) -> Int32:
    """Steps completed before this launch (read once by thread 0 at kernel start)."""
    return cute.arch.load(counters + isa.EPOCH, Int32, sem="acquire", scope="gpu")


@cute.jit
def wait_counter(counters: cute.Pointer, cid: Int32, target: Int32, tidx: Int32,
                 named: cutlass.Constexpr[int] = 0):
    """Block the CTA until counters[COUNTER_BASE + cid] has reached `target` (cid < 0: no wait)."""
    if tidx == 0:
        spin_counter(counters, cid, target)
    cta_sync(named)


@cute.jit
def spin_counter(counters: cute.Pointer, cid: Int32, target: Int32):
    """One thread: spin (acquire, backing off, with the watchdog) until counters[COUNTER_BASE +
    cid] has reached `target` (cid < 0: no wait). The consumers' thread 0 in wait_counter; the
    loader warp before it reads an expert record's run-time binding (pipeline.py)."""
    if cid >= 0:
        flag = counters + (cid + isa.COUNTER_BASE)
        v = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
        if v - target < 0:
            t0 = cute.arch.globaltimer()
            ns = Int32(SLEEP_MIN_NS)
            while v - target < 0:
                nanosleep(ns)
                ns = cutlass.min(ns * 2, Int32(SLEEP_MAX_NS))
                v = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
                if cute.arch.globaltimer() - t0 > Int64(WAIT_TIMEOUT_NS):
                    cute.arch.inline_ptx("trap;")  # deadlock: fail the launch, do not hang


@cute.jit
def signal_counter(counters: cute.Pointer, cid: Int32, tidx: Int32,
                   named: cutlass.Constexpr[int] = 0):
    """After every thread's stores: counters[COUNTER_BASE + cid] += 1, release (cid < 0: none)."""
    cta_sync(named)
    if tidx == 0:
        if cid >= 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.red(counters + (cid + isa.COUNTER_BASE), Int32(1), op="add", dtype="s32",
                          sem="release", scope="gpu")


@cute.jit
def finish_step(counters: cute.Pointer, epoch: Int32, num_ctas: Int32, tidx: Int32,
                named: cutlass.Constexpr[int] = 0):
    """Count this CTA out; the last one of the step publishes epoch + 1 for the next launch."""
    cta_sync(named)
    if tidx == 0:
        old = cute.arch.atomic_add(counters + isa.EXIT, Int32(1), sem="acq_rel", scope="gpu")
        if old == epoch * num_ctas + (num_ctas - 1):
            cute.arch.store(counters + isa.EPOCH, epoch + 1, sem="release", scope="gpu")
