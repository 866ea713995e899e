"""Fluid replay of a finished program: HBM bandwidth shared fairly among the SMs streaming.

The scheduler's placement model (cost.SimState) hands bandwidth out first-come first-served in
placement order, which favours earlier stages. This replay runs the final queues through an
event-driven fluid model instead, with the same parameters (cost.CostParams, gpus.GPU):

- every SM has one HBM stream. It fetches the weight bytes of its queue in order, up to the
  kernel's L2 lookahead limit. Default build (a loader warp and a shared-memory ring,
  Rates.sliding): (consumer position) + ring + window, where the consumer position is the start
  of the reached slab until its consumers start, then advances through the slab at the SM's L2
  share (the loader refilling the ring; at most the compute rate) but never past the bytes that
  have arrived; a stream held at that limit moves as fast as its consumer. Global build: (stream
  offset of the slab of the instruction the CTA has reached) + window, or the end of that slab
  once the CTA consumes it (the demand loads past the window).
  When the CTA reaches an ATTN_PARTIAL its cached keys/values are fetched first (prefetch_kv).
  A slab bound at run time (Instr.stream_wait: an expert slot's, bound by the layer's router)
  is not fetched before that counter is visible: the loader and its lookahead wait for it.
  All streams that can move share the copy bandwidth equally, each at most its cap (the L2 share,
  as in SimState; a stream held at its sliding limit, its consumer's rate) with the capped ones'
  leftover shared by the rest: prefetched bytes cost HBM bandwidth like any other;
- an SM's compute side walks its queue: wait for the counter to become visible, then the fixed
  cost and the activation load (one latency + bytes / L2 share), then consume the slab: when part
  of it is already in L2, reading starts one L2 latency later and the whole slab passes the SM's
  L2 share (prefetched and demand bytes use the same port), the rest arriving from HBM as it
  comes (at least the compute time); the head held in the shared-memory ring (cost.staged_bytes)
  costs nothing after the wait and is left out of the L2 pass; then store (bytes / bandwidth
  share) and fence (one latency); the release add lands one latency later and a waiter sees it
  one poll latency after;
- the last split of each (sequence, kv head) merges: its ticket returns one latency after its
  add, then the merge reads the partials, computes and stores, and the done counter's add lands.

The result is the predicted step time reported by `plan` (cost.CostReport). Between events the
rates are constant, so the replay is exact for this model.
"""

from __future__ import annotations

import heapq

import numpy as np

from megakernel.isa import NO_COUNTER, spec
from megakernel.program.cost import (
    CostParams,
    CostReport,
    Rates,
    refuse_too_fast,
    staged_bytes,
    step_bytes,
    written_bytes,
)

_WAIT, _SETUP, _CONSUME, _STORE, _DONE = range(5)
# columns of a replay trace (replay's `trace`): the times of kernel.spec.TIMELINE_FIELDS
TRACE_FIELDS = ("wait_start", "wait_end", "finish", "load_start", "load_end")
_TW0, _TW1, _TFIN, _TL0, _TL1 = range(5)


def _fair_rates(active: np.ndarray, cap: np.ndarray, total: float) -> np.ndarray:
    """Share `total` bytes/s equally among the active streams, each at most its cap (water
    filling: capped streams take their cap, the others split what is left)."""
    rate = np.zeros(len(cap))
    idx = np.nonzero(active)[0]
    if not len(idx):
        return rate
    order = idx[np.argsort(cap[idx], kind="stable")]
    left, k = total, len(order)
    for j, s in enumerate(order):
        rate[s] = min(cap[s], left / (k - j))
        left -= rate[s]
    return rate
_EPS = 0.5  # bytes: below this a stream or a window counts as done or full


def replay(prog, params: CostParams | None = None,  # noqa: ANN001
           trace: list[np.ndarray] | None = None) -> CostReport:
    """Predicted step of `prog` under fair bandwidth sharing (see the module docstring).

    `trace`: an empty list to receive, per SM, a [queue length, 5] array of the seconds at which
    each instruction reached its wait, saw its dependency, finished (signal issued), and its
    weight slab (or an ATTN_PARTIAL's cached K/V) started and finished arriving (TRACE_FIELDS;
    NaN where none): the predicted timeline (megakernel/measure/timeline.py)."""
    params = params or CostParams()
    gpu = prog.gpu
    r = Rates.of(gpu, params, getattr(prog, "ring_bytes", None))
    n = prog.num_sms
    queues = [[prog.instrs[i] for i in q] for q in prog.queues]
    qlen = np.array([len(q) for q in queues])
    totals = [c.total for c in prog.counters]
    seen = [0] * len(totals)
    visible = [np.inf] * len(totals)
    last_land = [0.0] * len(totals)
    waiting_on: dict[int, list[int]] = {}
    wake: list[tuple[float, int]] = []

    reach = [[spec(i.op).reach for i in q] for q in queues]
    kvb = [[float(i.w_bytes) if r else 0.0 for i, r in zip(q, rq, strict=True)]
           for q, rq in zip(queues, reach, strict=True)]
    wbytes = [[0.0 if r else float(i.w_bytes) for i, r in zip(q, rq, strict=True)] + [0.0]
              for q, rq in zip(queues, reach, strict=True)]
    wstart = [np.concatenate(([0.0], np.cumsum(w))) for w in wbytes]  # slab stream offsets
    # per SM and instruction: the counter its weight stream waits for (-1: none; a padding column
    # past the queue), and the counters' visibility with a last entry for -1 (always visible)
    gate = np.full((n, int(qlen.max(initial=0)) + 1), NO_COUNTER, dtype=np.int64)
    for s, q in enumerate(queues):
        gate[s, : len(q)] = [i.stream_wait for i in q]
    gate_seen = np.full(len(totals) + 1, np.inf)
    gate_seen[-1] = -np.inf
    lq = np.zeros(n, dtype=np.int64)  # instruction whose weight bytes the stream fetches
    lrem = np.array([w[0] for w in wbytes])  # its bytes still to fetch
    wpos = np.zeros(n)  # weight bytes fetched so far (the stream offset)
    kvrem = np.zeros(n)  # cached K/V of the reached ATTN_PARTIAL still to fetch
    limit = np.array([float(r.window)] * n)  # lookahead limit (stream offset), instruction-reach
    # the sliding lookahead (r.sliding): limit = consumer position + ring + window
    cpos = np.zeros(n)  # consumer position in the weight stream (bytes read by the CTA)
    cend = np.zeros(n)  # end of the slab being consumed
    crate = np.zeros(n)  # consumer read rate while consuming (L2 port or compute bound)
    ci = np.zeros(n, dtype=np.int64)  # instruction of the compute side
    phase = np.full(n, _WAIT)
    phase_end = np.full(n, np.inf)
    consume_min = np.zeros(n)
    reached = np.zeros(n)  # when the compute side reached its instruction (ring freed)
    streamed = np.zeros(n)
    t = 0.0
    tr = [np.full((int(k), len(TRACE_FIELDS)), np.nan) for k in qlen]
    if trace is not None:
        trace[:] = tr

    def skip_empty(s: int) -> None:
        while lq[s] < qlen[s] and lrem[s] <= _EPS:
            lq[s] += 1
            lrem[s] = wbytes[s][lq[s]]

    def enter_wait(s: int) -> None:
        if ci[s] >= qlen[s]:
            phase[s], phase_end[s] = _DONE, np.inf
            return
        i = ci[s]
        ins = queues[s][i]
        if not r.sliding:
            limit[s] = max(limit[s], wstart[s][i] + r.window)  # the lookahead, before the wait
        reached[s] = t
        kvrem[s] = kvb[s][i]
        tr[s][i, _TW0] = t
        phase[s], phase_end[s] = _WAIT, np.inf
        if ins.wait == NO_COUNTER or visible[ins.wait] <= t:
            start_setup(s)
        elif visible[ins.wait] == np.inf:
            waiting_on.setdefault(ins.wait, []).append(s)
        else:
            heapq.heappush(wake, (visible[ins.wait], s))

    def start_setup(s: int) -> None:
        ins = queues[s][ci[s]]
        tr[s][ci[s], _TW1] = t
        dur = r.fixed
        if ins.l2_bytes or ins.hbm_bytes:
            dur += r.lat + ins.l2_bytes / r.l2 + ins.hbm_bytes / r.bw
        phase[s], phase_end[s] = _SETUP, t + dur

    def signal(cid: int, land: float) -> None:
        seen[cid] += 1
        last_land[cid] = max(last_land[cid], land)
        if seen[cid] == totals[cid]:
            visible[cid] = last_land[cid] + r.lat  # the waiter's poll
            gate_seen[cid] = visible[cid]
            for w in waiting_on.pop(cid, []):
                heapq.heappush(wake, (visible[cid], w))

    def step_sm(s: int) -> None:
        """Handle SM s's due phase change at time t."""
        ins = queues[s][ci[s]]
        if phase[s] == _SETUP:
            i = ci[s]
            if kvb[s][i]:
                total, left = kvb[s][i], kvrem[s]
            else:
                total = wbytes[s][i]
                left = 0.0 if lq[s] > i else (lrem[s] if lq[s] == i else total)
            pre = total - left  # already in L2: read at the L2 share after one L2 latency
            if not r.sliding:
                limit[s] = max(limit[s], wstart[s][i] + wbytes[s][i])  # demand loads: the slab
            phase[s] = _CONSUME
            compute = r.work(ins)
            consume_min[s] = t + compute
            staged = 0.0 if kvb[s][i] else float(staged_bytes(pre, r.stage_cap,
                                                                   t - reached[s], r.l2))
            if r.sliding and wbytes[s][i]:  # the ring's head is read, the rest follows
                cpos[s] = wstart[s][i] + staged
                cend[s] = wstart[s][i] + wbytes[s][i]
                crate[s] = min(r.l2, wbytes[s][i] / compute) if compute > 0 else r.l2
            if pre - staged > _EPS:  # the slab beyond the smem ring passes the SM's L2 port
                consume_min[s] = max(consume_min[s], t + r.l2_lat + (total - staged) / r.l2)
            phase_end[s] = consume_min[s] if left <= _EPS else np.inf
        elif phase[s] == _CONSUME:
            if crate[s]:
                cpos[s], crate[s] = cend[s], 0.0
            phase[s] = _STORE
            phase_end[s] = t + ins.store_bytes / r.bw + r.lat  # stores, then the fence
            streamed[s] += ins.store_bytes + ins.hbm_bytes
        elif phase[s] == _STORE:
            tr[s][ci[s], _TFIN] = t
            land = t + r.lat  # the release add lands
            if ins.signal != NO_COUNTER:
                last = spec(ins.op).ticket and seen[ins.signal] + 1 == totals[ins.signal]
                signal(ins.signal, land)
                if last:  # ticket returns, merge, store, fence, done add lands
                    signal(ins.operands["DONE_CID"], land + r.merge(ins))
            ci[s] += 1
            enter_wait(s)

    for s in range(n):
        skip_empty(s)
        enter_wait(s)
    while True:
        kv_on = kvrem > _EPS
        lim = cpos + r.lookahead if r.sliding else limit
        room = np.where(kv_on, kvrem, np.minimum(lrem, lim - wpos))
        gated = gate_seen[gate[np.arange(n), lq]] > t  # binding not visible yet
        streaming = (lq < qlen) & (lrem > _EPS) & ~gated
        # the consumer of a sliding build: reading ahead of the arrivals (free) or right behind
        # them (coupled to its stream)
        reading = (crate > 0) & (cpos < cend - _EPS)
        c_free = reading & (wpos - cpos > _EPS)
        # a stream at its sliding limit moves as fast as its consumer frees the window
        at_limit = r.sliding & ~kv_on & streaming & (room <= _EPS) & c_free
        active = kv_on | (streaming & (room > _EPS)) | at_limit
        cap = np.where(at_limit, np.minimum(crate, r.l2), r.l2)
        rate = _fair_rates(active, cap, gpu.copy_bw)
        c_rate = np.where(c_free, crate, np.where(reading & ~kv_on, np.minimum(crate, rate), 0.0))
        t_next = float(phase_end.min())
        opens = gate_seen[gate[np.arange(n), lq]][gated & (lq < qlen)]
        if opens.size:
            t_next = min(t_next, float(opens.min()))  # a gated stream may start (inf: unknown)
        if wake:
            t_next = min(t_next, wake[0][0])
        on = active & (rate > 0)
        if on.any():
            grow = rate - np.where(r.sliding & ~kv_on, c_rate, 0.0)  # closing on the limit
            with np.errstate(divide="ignore", invalid="ignore"):
                dt = np.where(kv_on, kvrem / rate, lrem / rate)
                dt = np.where(~kv_on & ~at_limit & (grow > 0), np.minimum(dt, room / grow), dt)
            t_next = min(t_next, t + float(np.min(dt[on])))
        if r.sliding and reading.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                gap_close = np.where(c_free & (c_rate > rate), (wpos - cpos) / (c_rate - rate),
                                     np.inf)
                to_end = np.where(c_rate > 0, (cend - cpos) / c_rate, np.inf)
            t_next = min(t_next, t + float(np.min(np.minimum(gap_close, to_end)[reading])))
        if t_next == np.inf:
            break
        if on.any():
            dt = t_next - t
            c_in = np.where(r.sliding & ~kv_on, c_rate, 0.0) * dt  # the limit moved on meanwhile
            most = np.where(kv_on, kvrem,
                            np.minimum(lrem, np.where(at_limit, np.inf, room + c_in)))
            moved = np.where(on, np.minimum(rate * dt, most), 0.0)
            if trace is not None:  # first bytes of a slab (or of the reached K/V) moving
                for s in np.nonzero(moved > 0)[0].tolist():
                    i = ci[s] if kv_on[s] else lq[s]
                    if np.isnan(tr[s][i, _TL0]):
                        tr[s][i, _TL0] = t
            kvrem -= np.where(kv_on, moved, 0.0)
            lrem -= np.where(kv_on, 0.0, moved)
            wpos += np.where(kv_on, 0.0, moved)
            streamed += moved
        if r.sliding:
            cpos = np.where(reading, np.minimum(cpos + c_rate * (t_next - t),
                                                np.minimum(wpos, cend)), cpos)
        t = t_next
        for s in np.nonzero(kv_on & (kvrem <= _EPS))[0].tolist():
            kvrem[s] = 0.0
            tr[s][ci[s], _TL1] = t
            if phase[s] == _CONSUME and kvb[s][ci[s]]:
                phase_end[s] = max(t, consume_min[s])  # the last keys/values arrived
        for s in np.nonzero(active & ~kv_on & (lrem <= _EPS))[0].tolist():
            done_i = lq[s]
            lrem[s] = 0.0
            tr[s][done_i, _TL1] = t
            skip_empty(s)
            if phase[s] == _CONSUME and ci[s] == done_i:
                phase_end[s] = max(t, consume_min[s])  # the last bytes arrived
        while wake and wake[0][0] <= t:
            _, s = heapq.heappop(wake)
            if phase[s] == _WAIT:
                start_setup(s)
        due = np.nonzero(phase_end <= t)[0]
        while len(due):
            for s in due.tolist():
                step_sm(s)
            due = np.nonzero(phase_end <= t)[0]
    if not (phase == _DONE).all():
        stuck = [s for s in range(n) if phase[s] != _DONE]
        raise RuntimeError(f"replay deadlocked: SMs {stuck[:8]} never finish")
    step = t + r.lat + params.launch  # exit atomic, launch
    nbytes = step_bytes(prog.instrs) + written_bytes(prog)
    idle = 1.0 - np.minimum(1.0, streamed / (r.bw * step))
    return refuse_too_fast(CostReport(gpu.name, step, nbytes, nbytes / gpu.copy_bw,
                                      nbytes / gpu.hbm_bw, gpu.copy_bw, gpu.hbm_bw,
                                      float(idle.max()), float(idle.mean()), len(prog.instrs)),
                           gpu)
