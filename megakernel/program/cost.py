"""Cost model of one decode step: per-instruction bytes, latencies and fixed costs, per SM.

It models the kernel that exists (megakernel/kernel/). Weight staging, per CTA:
- the default build (kernel/pipeline.py): a loader warp streams the CTA's weight slabs into a
  ring of `smem_window` bytes of shared memory (spec.build_ring_bytes: the deepest ring of 32 KiB
  stages the shared-memory budget leaves, 192 KiB at B = 1) across the consumers' dependency
  waits, and before each tile extends the L2 lookahead (cp.async.bulk.prefetch.L2) to `window`
  bytes past its own position: the HBM stream may run `smem_window + window` bytes past the
  consumers, sliding with them within slabs (spec.loader_lookahead_plan). An ATTN_PARTIAL's
  consumers prefetch its cached keys/values when the CTA reaches it;
- the global-memory build (smem_stages = 0): the consumers extend the lookahead when the CTA
  reaches instruction i, before its dependency wait, to `window` bytes past the start of slab i
  (spec.lookahead_plan); the rest of a slab is fetched when it is consumed;
- programs without a kernel build (the hybrid families): costed like the global build's lookahead
  with ASSUMED_RING of staging.

Parameters (`CostParams`), each from a published figure or stated as an assumption:
- `mem_latency` 700 ns, `fixed_per_instr` 1.34 us, `fma_efficiency` 0.186: calibrated on
  published measurements of Hazy Research's Llama-3.2-1B megakernel (bench/hindcast.py). Their
  "Look Ma, No Bubbles" (2025) B200 breakdown of a 600 us step, divided over the ~65 instructions
  per SM their scheduler issues (HazyResearch/Megakernels @7309cec; not ~125, as v0.1-v0.3
  assumed), gives 250 us / (65 x 4 latencies) = 962 ns per load or store on a dependency path,
  (40 us warp sync + 80 us setup) / 65 = 1.85 us per instruction, and 200 us of RMSNorm + matvec
  = the busiest SM's CUDA-core flops at 18.6% of FP32 peak. Their schedule replayed under this
  model with those figures is 13-18% slow, so the latency and the fixed cost are scaled by one
  factor fitted to the measured steps, 973 us on H100 and 760 us on H200
  (msaroufim/megakernels-vs-cuda-graphs, llama/docs/RESULTS.md) and ~680 us on B200 (the post):
  0.727 on all three (0.66-0.76 over the folds; fit on two GPUs, the third is predicted within
  +2%, +6% and -9%). One reading of the factor: the breakdown divides per-SM time by 65
  instructions, while the step's critical path crosses about 6 dependency edges per layer
  (QKV, attention partials, reduction, O-proj, up/gate, down), ~97 in all; 65/97 = 0.67.
  A dependency edge is 4 latencies: producer's stores + release add (2 stores), consumer's
  acquire poll + activation load (2 loads).
- `launch` 1.3 us: CUDA-graph kernel launch on H100 (same post).
- `l2_latency` 200 ns: first bytes of a prefetched slab (an L2 hit). Assumption: Chips and
  Cheese measure ~150 ns for a B200 L2 hit within a partition, more across the die boundary
  ("Nvidia's B200: Keeping the CUDA Juggernaut Rolling", 2025); no H100/H200 figure is used.
- `prefetch_window` None: the kernel's lookahead window for the GPU's arch
  (kernel.spec.prefetch_window: 192 KiB on sm_90a, 432 KiB on sm_100a, sized so that all SMs'
  windows fill at most half of L2); an int overrides it for what-ifs.
- `smem_window` None: bytes of the weight stream the loader warp stages in shared memory ahead
  of the consumers (the program's build's ring; 0 = the global-memory build, no loader); an int
  overrides it. The staged head of slab i when its consumers start is
  min(bytes prefetched into L2 by then, smem_window, (t_act - reach) x L2 share); reading it
  costs nothing, the rest of the slab passes the SM's L2 port after the wait.
- `prefetch_to_smem` False: a what-if switch for a kernel that would stage every prefetched byte
  (the whole L2 window) in shared memory before the wait; plan always reports False.
- `mma_efficiency` 0.5: fraction of dense BF16 tensor peak that warp-level mma.sync matvecs reach
  (assumption; compute only matters at large batch). `fma_efficiency` (above) is the fraction of
  FP32 peak that CUDA-core work reaches (FMA matvecs at B*T < 8, norms, attention, merges).
- bandwidth per SM = the GPU's copy bandwidth / SMs (gpus.py: the cited achievable read bandwidth,
  3.89 TB/s on H200, until a run measures a copy) (every SM streams at once in the steady state);
  activation reads and prefetched weight reads come from L2 at the L2 bandwidth / SMs (gpus.py
  cites both). Prefetched bytes still cross HBM: a prefetch only moves the fetch earlier, and it
  takes its share of the copy bandwidth like a demand load.

Timeline of one instruction i on SM s:
- the SM's HBM stream fetches, in queue order, the weight bytes below its lookahead limit: in the
  default build (consumer position) + smem_window + window, the consumer position advancing
  through a slab as its consumers read it (`Rates.lookahead`); in the global build (start of
  slab ci) + window, ci being the instruction the CTA has reached, and all of slab ci once the
  CTA consumes it (demand loads); an ATTN_PARTIAL's cached K/V are fetched from the moment the
  CTA reaches it;
- start = max(previous instruction done, dependency visible) + fixed cost;
- activations arrive one load latency (+ bytes / L2 share) later (t_act); the bytes of slab i that
  had arrived in L2 by then need no HBM time, the rest arrives at the SM's HBM share; when part
  of the slab was prefetched, reading starts one L2 latency after t_act and the whole slab passes
  the SM's L2 share (prefetched and demand bytes share the port); the instruction needs the
  latest of these and the compute time;
- done = that + stores / bandwidth; the CTA fences its stores (one latency) and adds to the
  counter (one more); a waiter sees it one poll latency later.

Two evaluations share these parameters: `SimState` places instructions one at a time for the
scheduler (bandwidth from a first-come ledger, each SM capped at its L2 share), and replay.py
replays the finished program with the bandwidth shared fairly among the SMs streaming at each
moment; the replay's step time is the prediction `plan` reports.

A prediction below bytes per step / the achievable bandwidth (the measured copy bandwidth, else
the cited read bandwidth, gpus.GPU.achievable_bw) is refused with `TooFastError`: no parameter
may buy a step faster than the memory can deliver its bytes.

The floor is bytes per step / copy bandwidth, where bytes = weights read + KV cache read + KV
written + embedding rows; the spec floor uses the HBM spec bandwidth instead. Predicted efficiency
= floor / predicted step time. An SM's idle fraction is the share of the step in which its memory
pipe is not streaming its own bytes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from megakernel.isa import NO_COUNTER, spec
from megakernel.kernel.spec import SMEM_STAGE_BYTES, prefetch_window
from megakernel.program.gpus import GPU

CITATIONS = {
    "mem_latency": "bench/hindcast.py: 250 us / (65 instr x 4) of Hazy Research's B200 breakdown "
                   "('Look Ma, No Bubbles', 2025) x 0.727 fitted to Hazy's measured H100, H200 "
                   "(msaroufim/megakernels-vs-cuda-graphs) and B200 (the post) steps",
    "fixed_per_instr": "bench/hindcast.py: (40 + 80) us / 65 instr of the same breakdown x 0.727 "
                       "(the same fit)",
    "fma_efficiency": "bench/hindcast.py: the breakdown's 200 us of RMSNorm + matvec = the busiest "
                      "B200 SM's FP32 flops of Hazy's schedule at 18.6% of peak",
    "launch": "same post: CUDA-graph launch ~1.3 us on H100",
    "l2_latency": "assumption near Chips and Cheese's ~150 ns B200 L2 hit (2025)",
    "prefetch_window": "kernel.spec.prefetch_window: half of L2 over the arch's SMs",
    "smem_window": "kernel.spec.build_ring_bytes: the build's ring (stages x SMEM_STAGE_BYTES)",
    "prefetch_to_smem": "what-if only: the whole L2 window staged in shared memory",
    "mma_efficiency": "assumption: mma.sync matvec at 50% of dense BF16 peak",
}


@dataclass(frozen=True)
class CostParams:
    mem_latency: float = 700e-9
    fixed_per_instr: float = 1.34e-6
    launch: float = 1.3e-6
    l2_latency: float = 200e-9
    prefetch_window: int | None = None  # None: the kernel's window for the GPU's arch
    mma_efficiency: float = 0.5
    fma_efficiency: float = 0.186
    smem_window: int | None = None  # None: the program's build's shared-memory ring
    # what-if only: every prefetched byte staged in shared memory before the wait, so reading
    # them costs nothing on the path after it
    prefetch_to_smem: bool = False


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
                   p.fixed_per_instr, p.l2_latency, sliding, p.prefetch_to_smem)


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
        compute = ins.tensor_flops / r.tensor + ins.fp32_flops / r.fp32
        if w:
            kv = spec(ins.op).reach  # prefetched whole when the CTA reaches it
            ls = np.maximum(load_end, free if kv else win)
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
        compute = ins.tensor_flops / r.tensor + ins.fp32_flops / r.fp32
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
                merge = (r.lat + ins.merge_l2_bytes / r.l2 + ins.merge_flops / r.fp32
                         + ins.merge_store_bytes / r.bw + 2 * r.lat)
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
