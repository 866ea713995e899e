"""Cost model of one decode step: per-instruction bytes, latencies and fixed costs, per SM.

It models the kernel that exists (megakernel/kernel/). Each SM streams its queue's weight slabs
from HBM at its share of the copy bandwidth, ahead of its consumers by the L2 lookahead `window`
(kernel/host/limits.py prefetch_window) plus, in the default build, the loader warp's shared-memory
ring `smem_window` (model_spec.build_ring_bytes; the global-memory build has none; a program
without a kernel build is costed with ASSUMED_RING and no sliding lookahead).

Instruction i on SM s:

- start = max(previous instruction done, dependency visible) + `fixed_per_instr`;
- its activations arrive one `mem_latency` (plus bytes at the SM's L2 share) later, at t_act;
  the part of its slab staged in shared memory by then costs nothing, the bytes already in L2
  pass the SM's L2 share after one `l2_latency`, the rest arrive at its HBM share; it needs the
  latest of these and its compute time (mma.sync at `mma_efficiency` of tensor peak, FMA work at
  `fma_efficiency` of FP32 peak);
- done = that + stores / bandwidth; the store fence and the counter add take one latency each,
  and a waiter sees the counter one poll latency later.

`CostParams` holds the parameters and `CITATIONS` the published figure or assumption behind each.
Two evaluations share them: `SimState` places instructions one at a time for the scheduler
(bandwidth from a first-come ledger), replay.py replays the finished program with the bandwidth
shared among the SMs streaming at each moment (the prediction `plan` reports). A prediction
faster than bytes per step / the achievable bandwidth is refused (`TooFastError`). The floor is
bytes per step (weights, KV cache read and written, embedding rows) / copy bandwidth; predicted
efficiency = floor / predicted step time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from megakernel.isa import NO_COUNTER, spec
from megakernel.kernel.host.limits import SMEM_STAGE_BYTES, prefetch_window
from megakernel.program.gpus import GPU

CITATIONS = {
    "mem_latency": "bench/hindcast.py: 250 us / (65 instr x 4) of Hazy Research's B200 breakdown "
                   "('Look Ma, No Bubbles', 2025) x 0.698 fitted to Hazy's measured H100, H200 "
                   "(msaroufim/megakernels-vs-cuda-graphs) and B200 (the post) steps",
    "fixed_per_instr": "bench/hindcast.py: (40 + 80) us / 65 instr of the same breakdown x 0.698 "
                       "(the same fit)",
    "fma_efficiency": "bench/hindcast.py: the breakdown's 200 us of RMSNorm + matvec = the busiest "
                      "B200 SM's FP32 flops of Hazy's schedule at 18.6% of peak",
    "launch": "same post: CUDA-graph launch ~1.3 us on H100",
    "l2_latency": "assumption near Chips and Cheese's ~150 ns B200 L2 hit (2025)",
    "prefetch_window": "kernel.spec.prefetch_window: half of L2 over the arch's SMs",
    "smem_window": "kernel.spec.build_ring_bytes: the build's ring (stages x SMEM_STAGE_BYTES)",
    "prefetch_to_smem": "what-if only: the whole L2 window staged in shared memory",
    "mma_efficiency": "assumption: mma.sync matvec at 50% of dense BF16 peak",
    "fp8_convert": "assumption from the kernel's instruction count (device/memory.py): the FMA "
                   "form spends 1.5 instructions per weight (half a cvt.rn.f16x2.e4m3x2, one "
                   "f16 -> f32) where bf16 spends 1 (its unpack, inside the fitted FMA "
                   "efficiency): +0.5 instruction = +1 flop-equivalent per weight at full issue "
                   "rate; a slower F2FP would make it up to 4; unmeasured until a GPU run "
                   "refits it",
    "fp8_convert_mma": "assumption from the same count: the mma form's B fragments cost 2 "
                       "instructions per weight (half a cvt e4m3x2, one f16 -> f32, half a cvt "
                       "bf16x2.f32) where bf16 loads them as they are: +4 flop-equivalents per "
                       "weight; unmeasured",
}


@dataclass(frozen=True)
class CostParams:
    mem_latency: float = 671e-9
    fixed_per_instr: float = 1.288e-6
    launch: float = 1.3e-6
    l2_latency: float = 200e-9
    prefetch_window: int | None = None  # None: the kernel's window for the GPU's arch
    mma_efficiency: float = 0.5
    fma_efficiency: float = 0.186
    smem_window: int | None = None  # None: the program's build's shared-memory ring
    # what-if only: every prefetched byte staged in shared memory before the wait, so reading
    # them costs nothing on the path after it
    prefetch_to_smem: bool = False
    fp8_convert: float = 1.0  # flop-equivalents per FP8 weight converted, FMA form (CITATIONS)
    fp8_convert_mma: float = 4.0  # the same, mma form


# a program without a kernel build (the hybrid families) is costed with this ring and the
# instruction-reach lookahead of the global-memory build (no loader warp slides it)
ASSUMED_RING = 3 * SMEM_STAGE_BYTES


@dataclass
class Rates:
    """Per-SM rates of one GPU under `CostParams`."""

    bw: float  # bytes/s of HBM per SM
    l2: float  # bytes/s of L2 per SM
    tensor: float  # flop/s per SM
    fp32: float
    window: int  # L2 lookahead window bytes
    smem_window: float  # weight-stream bytes staged in shared memory ahead (inf: what-if)
    lat: float
    fixed: float
    l2_lat: float
    # the loader warp slides the lookahead: it runs `window` bytes past the loader's position,
    # which is `smem_window` past the consumers'; else `window` past the start of the slab the
    # CTA has reached
    sliding: bool = False
    stage_all: bool = False  # what-if (CostParams.prefetch_to_smem): every prefetched byte staged
    fp8_convert: float = 0.0  # CUDA-core flop-equivalents per converted FP8 weight (FMA form)
    fp8_convert_mma: float = 0.0  # the same for the mma form (its B fragments)

    def work(self, ins) -> float:  # noqa: ANN001 (stages.Instr)
        """Seconds of an instruction's own work after its activations arrive: its flops at
        the tensor-core and CUDA-core rates plus its dependent global round trips (the
        handler's loop nest, declared where the layer kind makes the record from the
        handler's index module: `Instr.round_trips`), each one L2 hit latency."""
        convert = self.fp8_convert_mma if ins.tensor_flops else self.fp8_convert
        return (ins.tensor_flops / self.tensor
                + (ins.fp32_flops + ins.converted * convert) / self.fp32
                + ins.round_trips * self.l2_lat)

    def merge(self, ins) -> float:  # noqa: ANN001 (stages.Instr)
        """Seconds from a ticket opcode's last signal to its merge's done signal: the ticket's
        atomic round trip, the partials read, the merge's flops and serial round trips, its
        stores, the fence and the release add."""
        return (self.lat + ins.merge_l2_bytes / self.l2 + ins.merge_flops / self.fp32
                + ins.merge_round_trips * self.l2_lat + ins.merge_store_bytes / self.bw
                + 2 * self.lat)

    @property
    def stage_cap(self) -> float:
        """Most bytes of a slab the consumers find staged in shared memory after a wait."""
        return float("inf") if self.stage_all else self.smem_window

    @property
    def lookahead(self) -> float:
        """Lookahead limit past the consumers' position in the weight stream."""
        return self.window + (self.smem_window if self.sliding else 0.0)

    @classmethod
    def of(cls, gpu: GPU, p: CostParams, build_ring: int | None = None) -> Rates:
        """`build_ring`: the shared-memory ring of the program's kernel build in bytes (0: the
        global-memory build; None: no kernel build, ASSUMED_RING without the loader's sliding
        lookahead). `p.smem_window` overrides the ring."""
        n = gpu.num_sms
        window = prefetch_window(gpu.arch) if p.prefetch_window is None else p.prefetch_window
        default = ASSUMED_RING if build_ring is None else build_ring
        smem = float(default if p.smem_window is None else p.smem_window)
        sliding = build_ring is not None and smem > 0
        return cls(gpu.copy_bw / n, gpu.l2_bw / n, gpu.bf16_tensor_flops * p.mma_efficiency / n,
                   gpu.fp32_flops * p.fma_efficiency / n, int(window), smem, p.mem_latency,
                   p.fixed_per_instr, p.l2_latency, sliding, p.prefetch_to_smem,
                   p.fp8_convert, p.fp8_convert_mma)


def staged_bytes(pre, smem_window: float, fill_time, l2_rate: float):  # noqa: ANN001, ANN201
    """Head of the slab in shared memory when the consumers start (cost.py docstring): the
    prefetched bytes, capped by the ring and by what the loader copied from L2 since the CTA
    reached the instruction. Works on floats and numpy arrays."""
    if smem_window == float("inf"):
        return pre
    return np.minimum(np.minimum(pre, smem_window), np.maximum(fill_time, 0.0) * l2_rate)


class SimState:
    """Per-SM timelines while instructions are placed (by the scheduler) or replayed."""

    def __init__(self, gpu: GPU, params: CostParams | None = None,
                 build_ring: int | None = None) -> None:
        self.params = params or CostParams()
        self.r = Rates.of(gpu, self.params, build_ring)
        n = gpu.num_sms
        self.n = n
        self.free = np.zeros(n)  # compute side free (previous instruction done and fenced)
        self.load_end = np.zeros(n)  # HBM stream finished every byte so far
        self.win = np.zeros(n)  # earliest time the lookahead may request the next slab's bytes
        self.cum = np.zeros(n, dtype=np.int64)  # weight bytes so far (the kernel's stream offset)
        self.streamed = np.zeros(n)  # bytes moved by each SM (for idle fractions)
        self.count = np.zeros(n, dtype=np.int64)
        # per SM: stream offset of each placed instruction's slab and when the CTA reached it
        self._starts: list[list[int]] = [[] for _ in range(n)]
        self._reach: list[list[float]] = [[] for _ in range(n)]
        self.counter_done: dict[int, float] = {}  # counter -> latest signal time so far
        self.ledger = Ledger(gpu.copy_bw, self.r.l2)

    # -- dependency ---------------------------------------------------------------------------
    def visible(self, cid: int) -> float:
        """When a waiter on counter `cid` sees all increments placed so far."""
        if cid == NO_COUNTER:
            return 0.0
        return self.counter_done.get(cid, 0.0) + self.r.lat

    # -- one instruction ----------------------------------------------------------------------
    def _times(self, ins, ready, free, load_end, win):  # noqa: ANN001
        r = self.r
        start = np.maximum(free, ready) + r.fixed
        after = ins.l2_bytes + ins.hbm_bytes
        t_act = start + (r.lat + ins.l2_bytes / r.l2 + ins.hbm_bytes / r.bw if after else 0.0)
        w = ins.w_bytes
        compute = r.work(ins)
        if w:
            kv = spec(ins.op).reach  # prefetched whole when the CTA reaches it
            ls = np.maximum(load_end, free if kv else win)
            ls = np.maximum(ls, self.visible(ins.stream_wait))  # a run-time binding's wait
            ls = ls + np.where(ls > load_end, r.lat, 0.0)  # restart latency after a stall
            pre = np.clip((t_act - ls) * r.bw, 0.0, w if kv else min(w, r.lookahead))
            t_w = np.where(pre < w, t_act + (w - pre) / r.bw, ls + w / r.bw)
            new_load_end = np.maximum(t_w, ls + w / r.bw)
            staged = 0.0 if kv else staged_bytes(pre, r.stage_cap, t_act - free, r.l2)
            t_w = np.maximum(t_w, np.where(pre > staged, t_act + r.l2_lat + (w - staged) / r.l2,
                                           t_act))
        else:
            t_w = t_act
            new_load_end = load_end
        t_c1 = np.maximum(t_w, t_act + compute) + ins.store_bytes / r.bw
        return start, t_act, t_c1, new_load_end

    def probe(self, ins) -> np.ndarray:  # noqa: ANN001
        """Completion time of `ins` on every SM (nothing changes)."""
        ready = self.visible(ins.wait)
        _, _, t_c1, _ = self._times(ins, ready, self.free, self.load_end, self.win)
        return t_c1

    def place(self, ins, s: int) -> float:  # noqa: ANN001
        """Append `ins` to SM `s`; returns its completion time (before the fence).

        Unlike `probe`, the HBM stream draws on the shared bandwidth ledger, so an SM streams
        faster than its even share when others are idle (up to its own cap).
        """
        r = self.r
        ready = self.visible(ins.wait)
        reach = float(self.free[s])  # the CTA reaches ins: lookahead issued, then the wait
        start = max(reach, ready) + r.fixed
        t_act = start
        if ins.l2_bytes or ins.hbm_bytes:
            t_act += r.lat + ins.l2_bytes / r.l2 + ins.hbm_bytes / r.bw
        w = ins.w_bytes
        kv = spec(ins.op).reach
        le = float(self.load_end[s])
        t_w = t_act
        if w:
            ls = max(le, reach if kv else float(self.win[s]))
            ls = max(ls, self.visible(ins.stream_wait))  # a run-time binding's wait
            if ls > le:
                ls += r.lat  # the stream restarts after a stall
            got, t1 = 0.0, ls
            if t_act > ls:
                t1, got = self.ledger.take(ls, w if kv else min(w, r.lookahead), t_act)
            if got < w:
                t_w, _ = self.ledger.take(max(t_act, t1), w - got)
            else:
                t_w = t1
            le = t_w
            staged = 0.0 if kv else float(staged_bytes(got, r.stage_cap, t_act - reach, r.l2))
            if got > staged:
                # the prefetched head is in L2 (beyond the ring): the rest of the slab passes
                # the SM's L2 port after the wait
                t_w = max(t_w, t_act + r.l2_lat + (w - staged) / r.l2)
        compute = r.work(ins)
        t_c1 = max(t_w, t_act + compute) + ins.store_bytes / r.bw
        self.free[s] = t_c1 + r.lat  # fence before the signal
        self.load_end[s] = le
        self._starts[s].append(int(self.cum[s]))
        self._reach[s].append(reach)
        if not kv:
            self.cum[s] += w
        self.win[s] = self._reached_at(s, int(self.cum[s] - r.lookahead))
        self.streamed[s] += ins.w_bytes + ins.hbm_bytes + ins.store_bytes
        self.count[s] += 1
        if ins.signal != NO_COUNTER:
            sig = t_c1 + 2 * r.lat  # stores fenced, then the release add lands
            self.counter_done[ins.signal] = max(self.counter_done.get(ins.signal, 0.0), sig)
            if spec(ins.op).ticket:
                # the last split's CTA merges: ticket (atomic round trip), read the partials,
                # merge, store, fence, release add; max over the group = the last split
                merge = r.merge(ins)
                done = ins.operands["DONE_CID"]
                t = self.counter_done[ins.signal] + merge
                self.counter_done[done] = max(self.counter_done.get(done, 0.0), t)
        ins.sm = s
        ins.t_start, ins.t_end = start, t_c1
        return t_c1

    def _reached_at(self, s: int, offset: int) -> float:
        """When the lookahead of SM s first covered stream offset `offset`: the time the CTA
        reached the first instruction whose slab starts past offset - that is, offset + 1 bytes
        lie below its start + window (the next, unplaced instruction: when the CTA frees)."""
        starts = self._starts[s]
        j = bisect.bisect_right(starts, offset)
        if j >= len(starts):
            return float(self.free[s])
        return self._reach[s][j]

    def step_time(self) -> float:
        """Predicted step: last CTA done + exit atomic + launch."""
        return float(self.free.max()) + self.r.lat + self.params.launch


class Ledger:
    """HBM bandwidth over time, in bins: streams placed earlier take bandwidth first, each at most
    `cap` bytes/s (one SM), all together at most `total` bytes/s."""

    def __init__(self, total: float, cap: float, dt: float = 0.25e-6) -> None:
        self.dt = dt
        self.tot_b = total * dt
        self.cap_b = cap * dt
        self.used = np.zeros(1 << 14)

    def _grow(self, n: int) -> None:
        if n > len(self.used):
            self.used = np.concatenate((self.used, np.zeros(max(n, 2 * len(self.used)))))

    def take(self, t0: float, nbytes: float, t_limit: float = float("inf")) -> tuple[float, float]:
        """Stream up to `nbytes` from t0, stopping at t_limit; -> (end time, bytes got)."""
        dt = self.dt
        b = int(t0 / dt)
        first = 1.0 - (t0 / dt - b)  # fraction of the first bin left
        last = int(t_limit / dt) if t_limit != float("inf") else None
        need, got, chunk = float(nbytes), 0.0, 256
        while True:
            if last is not None and b > last:
                return t_limit, got
            hi = b + chunk if last is None else min(b + chunk, last + 1)
            self._grow(hi + 1)
            avail = np.clip(np.minimum(self.cap_b, self.tot_b - self.used[b:hi]), 0.0, None)
            avail[0] *= first
            if last is not None and hi == last + 1:
                avail[-1] *= min(1.0, t_limit / dt - last)
            cs = np.cumsum(avail)
            if cs[-1] >= need - got:
                k = int(np.searchsorted(cs, need - got))
                before = cs[k - 1] if k else 0.0
                part = need - got - before
                self.used[b : b + k] += avail[:k]
                self.used[b + k] += part
                start_in_bin = (1.0 - first) if k == 0 else 0.0
                frac = part / avail[k] if avail[k] > 0 else 0.0
                span = (first if k == 0 else 1.0) * frac
                return (b + k + start_in_bin + span) * dt, need
            self.used[b:hi] += avail
            got += float(cs[-1])
            b, first = hi, 1.0


class TooFastError(RuntimeError):
    """A predicted step faster than its bytes at the achievable bandwidth: a bug in the model or in
    its parameters, never a result."""


def refuse_too_fast(r: CostReport, g: GPU) -> CostReport:
    """`r`, unless it beats bytes / the GPU's measured-or-cited achievable bandwidth."""
    bound = r.bytes_per_step / g.achievable_bw if g.achievable_bw > 0 else 0.0
    if r.predicted_s < bound * (1 - 1e-6):
        raise TooFastError(
            f"predicted step {r.predicted_s * 1e6:.1f} us on {g.name} is below its bytes "
            f"({r.bytes_per_step / 1e9:.3f} GB) at the achievable bandwidth "
            f"{g.achievable_bw / 1e12:.2f} TB/s ({bound * 1e6:.1f} us)")
    return r


@dataclass
class CostReport:
    gpu: str
    predicted_s: float
    bytes_per_step: int
    floor_s: float  # bytes / copy bandwidth
    spec_floor_s: float  # bytes / HBM spec bandwidth
    copy_bw: float
    hbm_bw: float
    worst_idle: float
    mean_idle: float
    instructions: int

    @property
    def efficiency(self) -> float:
        return self.floor_s / self.predicted_s

    @property
    def spec_efficiency(self) -> float:
        return self.spec_floor_s / self.predicted_s


def step_bytes(instrs) -> int:  # noqa: ANN001
    """HBM bytes the instructions must read: prefetchable bytes (weights, cached KV) and
    embedding rows. What the step writes to its caches and state is added by the caller
    (`written_bytes`)."""
    return sum(ins.w_bytes + ins.hbm_bytes for ins in instrs)


def report(state: SimState, instrs, gpu: GPU, extra_bytes: int = 0) -> CostReport:  # noqa: ANN001
    t = state.step_time()
    nbytes = step_bytes(instrs) + extra_bytes
    own = state.streamed / state.r.bw  # seconds each SM's pipe streams
    idle = 1.0 - own / t
    return refuse_too_fast(CostReport(gpu.name, t, nbytes, nbytes / gpu.copy_bw,
                                      nbytes / gpu.hbm_bw, gpu.copy_bw, gpu.hbm_bw,
                                      float(idle.max()), float(idle.mean()), len(instrs)), gpu)


def written_bytes(prog) -> int:  # noqa: ANN001
    """Bytes one step writes to its KV caches, recurrent states, conv windows and ReplaySSM rings
    (the blocks' byte accounting, program/bytes.py)."""
    from megakernel.program.bytes import step_bytes_by_category

    return int(sum(v for k, v in step_bytes_by_category(prog).items() if k.endswith("_written")))
