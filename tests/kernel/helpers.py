"""Shared by the kernel tests of the hybrid slices: one preset built on both weight paths for both
archs, the resource rules every build must meet, and the host emulation of the delta-rule
handlers (GDN, KDA) with the comparisons against the executor."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.kernel.config import spec as spec_mod
from megakernel.kernel.host import limits
from megakernel.kernel.host.gdn_index import L2NORM_EPS, LANES, SOFTPLUS_LINEAR
from megakernel.kernel.host.limits import NUM_THREADS
from megakernel.models import preset

# B = 1 on the default pipeline, B = 4 on the global-memory path
VARIANT_BUILDS = [(1, None), (4, 0)]


def variant_builds(kernel_build: Callable, name: str, **variant) -> dict:  # noqa: ANN003
    """(arch, batch, smem_stages) -> (arch dir, manifest) of preset `name` (session cache;
    `variant`: other make_spec switches, e.g. replay_window)."""
    return {(arch, b, st): kernel_build(preset(name), arch, b, 1, smem_stages=st, **variant)
            for arch in ARCHS for b, st in VARIANT_BUILDS}


def specs_within_budgets(builds: dict) -> dict:
    """Assert every build has no spills, no local memory, registers within the budget and a real
    cubin; return each build's KernelSpec (from its manifest) for the caller's own checks."""
    out = {}
    for key, (d, m) in builds.items():
        r = m["resources"]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (key, r)
        assert r["local_bytes"] == 0 and r["local_stores"] == 0 and r["local_loads"] == 0, r
        assert 0 < r["registers"] <= limits.REGISTER_BUDGET, (key, r["registers"])
        assert (d / "megakernel.cubin").stat().st_size > 10_000
        out[key] = spec_mod.KernelSpec.from_dict(m["spec"])
    return out


# ---- host emulation of the delta-rule handlers (kernel/device/gdn.py, kernel/device/kda.py) ------
# numpy walks of the device loop nests with the kernels' own index helpers (gdn_index.py,
# kda_index.py), in float32 as the device computes; `channel` mirrors the handlers' CHANNEL (KDA's
# per-channel decay) and `unit` the record's key head / head.
F = np.float32
NT, NW = NUM_THREADS, NUM_THREADS // LANES


def silu(x):  # noqa: ANN001, ANN201
    return F(x / (F(1.0) + np.exp(F(-x), dtype=F)))


def sigmoid(x):  # noqa: ANN001, ANN201
    return F(F(1.0) / (F(1.0) + np.exp(F(-x), dtype=F)))


def softplus(x):  # noqa: ANN001, ANN201
    return x if x > SOFTPLUS_LINEAR else F(np.log1p(np.exp(x, dtype=F), dtype=F))


def emulate_conv_norms(g, d: dict, unit: int, W: np.ndarray, F32: np.ndarray, S: np.ndarray  # noqa: ANN001
                       ) -> np.ndarray:
    """Phase 1 (conv, a thread per channel; the window updated in S) and the l2 norms (a warp per
    (token, q or k)): a fresh scratch span (NaN elsewhere) with x filled."""
    b, proj, st0, T, sm = d["B_IDX"], d["PROJ_OFF"], d["STATE"], g.tokens, g.smem()
    sS = np.full(sm["words"], np.nan, dtype=F)
    for tidx in range(NT):
        for c in range(tidx, g.ch, NT):
            chan = g.channel(c, unit)
            u = [S[st0 + g.window(b, chan, j)] for j in range(g.win)]
            u += [F32[proj + g.proj(b, t, chan)] for t in range(T)]
            taps = d["CONV_W"] + chan * g.conv_k
            for t in range(T):
                acc = F(0.0)
                for j in range(g.conv_k):
                    acc = F(acc + F(u[t + j] * W[taps + j]))
                sS[sm["x"] + t * g.ch + c] = silu(acc)
            for j in range(g.win):
                S[st0 + g.window(b, chan, j)] = u[T + j]
    for warp in range(NW):
        for p in range(warp, 2 * T, NW):
            t = p // 2
            base = sm["x"] + t * g.ch + (p - 2 * t) * g.dk
            v = sS[base : base + g.dk]
            scale = F(1.0) / np.sqrt(F((v * v).sum(dtype=F) + F(L2NORM_EPS)), dtype=F)
            if p - 2 * t == 0:
                scale = F(scale * F(g.dk ** -0.5))
            sS[base : base + g.dk] = v * scale
    return sS


def _tile_registers(g, d: dict, unit: int, it: int, S: np.ndarray) -> tuple[np.ndarray, dict]:  # noqa: ANN001
    """State tile `it` of the record in registers [warp][lane][RPW]; lane -> (r, j, live)."""
    b, st0 = d["B_IDX"], d["STATE"]
    regs = np.zeros((NW, LANES, g.rpw), dtype=F)
    cols = {}
    for warp in range(NW):
        for lane in range(LANES):
            r, j = g.tile_column(it, min(lane, g.cw - 1))
            cols[lane] = (r, j, lane < g.cw)
            for rr in range(g.rpw):
                regs[warp, lane, rr] = S[st0 + g.state(b, unit * g.rep + r, warp * g.rpw + rr, j)]
    return regs, cols


def _store_tile(g, d: dict, unit: int, regs: np.ndarray, cols: dict, S: np.ndarray) -> None:  # noqa: ANN001
    for warp in range(NW):
        for lane in range(LANES):
            r, j, live = cols[lane]
            if live:
                for rr in range(g.rpw):
                    S[d["STATE"] + g.state(d["B_IDX"], unit * g.rep + r, warp * g.rpw + rr,
                                           j)] = regs[warp, lane, rr]


def emulate_states(g, d: dict, unit: int, S: np.ndarray, sS: np.ndarray,  # noqa: ANN001
                   channel: bool = False) -> None:
    """The recurrent handler's k.q and phase 3 (the states through registers, the partial buffers
    alternating); `channel`: the rows decayed by e^{g[t][row]} first, scalar decay 1."""
    T, sm = g.tokens, g.smem()
    for t in range(T):
        base = sm["x"] + t * g.ch
        sS[sm["kq"] + t] = (sS[base + g.dk : base + 2 * g.dk] * sS[base : base + g.dk]).sum(
            dtype=F)
    buf = 0
    for it in range(g.rep * g.tiles):
        regs, cols = _tile_registers(g, d, unit, it, S)
        for t in range(T):
            xt = sm["x"] + t * g.ch
            for warp in range(NW):  # partials, then the barrier
                rows = slice(warp * g.rpw, (warp + 1) * g.rpw)
                if channel:
                    dec = np.exp(sS[sm["g"] + g.decay(t, rows.start) :
                                    sm["g"] + g.decay(t, rows.stop)], dtype=F)
                    regs[warp] = regs[warp] * dec
                for lane in range(LANES):
                    col = min(lane, g.cw - 1)
                    pk = (regs[warp, lane] * sS[xt + g.dk + rows.start : xt + g.dk + rows.stop]
                          ).sum(dtype=F)
                    pq = (regs[warp, lane] * sS[xt + rows.start : xt + rows.stop]).sum(dtype=F)
                    sS[sm["part"] + g.part(buf, warp, 0, col)] = pk
                    sS[sm["part"] + g.part(buf, warp, 1, col)] = pq
            for warp in range(NW):
                for lane in range(LANES):
                    col = min(lane, g.cw - 1)
                    r, j, live = cols[lane]
                    tk = sum(F(sS[sm["part"] + g.part(buf, w, 0, col)]) for w in range(NW))
                    tq = sum(F(sS[sm["part"] + g.part(buf, w, 1, col)]) for w in range(NW))
                    a = F(1.0) if channel else np.exp(sS[sm["g"] + t * g.rep + r], dtype=F)
                    u = F(sS[sm["beta"] + t * g.rep + r]
                          * F(sS[xt + 2 * g.dk + r * g.dv + j] - F(a * tk)))
                    if warp == 0 and live:
                        sS[sm["o"] + (t * g.rep + r) * g.dv + j] = F(a * tq) + F(
                            sS[sm["kq"] + t] * u)
                    for rr in range(g.rpw):
                        i = warp * g.rpw + rr
                        regs[warp, lane, rr] = F(a * regs[warp, lane, rr]) + F(
                            sS[xt + g.dk + i] * u)
            buf = 1 - buf
        _store_tile(g, d, unit, regs, cols, S)


def emulate_replay_states(g, d: dict, unit: int, I32: np.ndarray, S: np.ndarray,  # noqa: ANN001
                          sS: np.ndarray, channel: bool = False) -> None:
    """The ReplaySSM handler's r1-r3 (gdn_index.py; kda_index.py with `channel`) and the count."""
    b, kh, st0, T, sm = d["B_IDX"], unit, d["STATE"], g.tokens, g.smem()
    count = d["COUNT_OFF"] + g.count(b, kh)
    n = int(I32[count])
    assert 0 <= n < g.replay_window
    # r1: a thread per (entry, element): committed from the ring, new ones appended to it
    for idx in range((n + T) * g.dk):
        e, i = divmod(idx, g.dk)
        at = st0 + g.ring_k(b, e, kh, i)
        if e >= n:
            S[at] = sS[sm["x"] + (e - n) * g.ch + g.dk + i]
        sS[sm["keys"] + g.key(e, i)] = S[at]
    if channel:
        for idx in range((n + T) * g.d):
            e, i = divmod(idx, g.d)
            at = st0 + g.ring_g(b, e, kh, i)
            if e >= n:
                S[at] = sS[sm["g"] + g.decay(e - n, i)]
            sS[sm["gs"] + g.gs_c(e, i)] = S[at]
    else:
        for idx in range((n + T) * g.rep):
            e, r = divmod(idx, g.rep)
            at = st0 + g.ring_g(b, e, kh * g.rep + r)
            if e >= n:
                S[at] = sS[sm["g"] + (e - n) * g.rep + r]
            sS[sm["gs"] + g.gs(r, e)] = S[at]
    # r2: a warp per (entry, token, k or q); with `channel` the decays and decayed vectors
    for e in range(n + T):
        key = sS[sm["keys"] + g.key(e, 0) : sm["keys"] + g.key(e, g.dk)]
        for t in range(T):
            for which in range(2):
                base = sm["x"] + t * g.ch + (1 - which) * g.dk
                x = sS[base : base + g.dk]
                if channel:
                    seg = np.zeros(g.d, dtype=F)
                    for ee in range(e + 1, n + t + 1):
                        seg = seg + sS[sm["gs"] + g.gs_c(ee, 0) : sm["gs"] + g.gs_c(ee + 1, 0)]
                    x = np.exp(seg, dtype=F) * key * x
                    sS[sm["dots"] + g.dot(t, which, e)] = x.sum(dtype=F)
                else:
                    sS[sm["dots"] + g.dot(t, which, e)] = (key * x).sum(dtype=F)
    gs = (lambda e: sS[sm["gs"] + g.gs_c(e, 0) : sm["gs"] + g.gs_c(e + 1, 0)]) if channel else None
    if channel:
        for e in range(n + T):
            seg = np.zeros(g.d, dtype=F)
            for ee in range(e + 1, n + T):
                seg = seg + gs(ee)
            rows = sm["keys"] + g.key(e, 0)
            sS[sm["kf"] + g.gs_c(e, 0) : sm["kf"] + g.gs_c(e + 1, 0)] = np.exp(seg, dtype=F) * sS[
                rows : rows + g.d]
        seg = np.zeros(g.d, dtype=F)
        for ee in range(n + T):
            seg = seg + gs(ee)
        sS[sm["tot"] : sm["tot"] + g.d] = np.exp(seg, dtype=F)
        for t in range(T):
            seg = np.zeros(g.d, dtype=F)
            for ee in range(n + t + 1):
                seg = seg + gs(ee)
            xt = sm["x"] + t * g.ch
            for which, src in ((0, xt), (1, xt + g.dk)):
                sS[sm["kc"] + g.kc(t, which, 0) : sm["kc"] + g.kc(t, which, g.d)] = (
                    np.exp(seg, dtype=F) * sS[src : src + g.d])
    fold = n + T >= g.replay_window
    # r3: per column tile
    for it in range(g.rep * g.tiles):
        regs, cols = _tile_registers(g, d, kh, it, S)
        for warp in range(NW):
            for lane in range(LANES):
                col = min(lane, g.cw - 1)
                for t in range(T):
                    xt = sm["x"] + t * g.ch
                    kt, qt = ((sm["kc"] + g.kc(t, 1, 0), sm["kc"] + g.kc(t, 0, 0)) if channel
                              else (xt + g.dk, xt))
                    rows = warp * g.rpw
                    sS[sm["part"] + g.part(t, warp, 0, col)] = (
                        regs[warp, lane] * sS[kt + rows : kt + rows + g.rpw]).sum(dtype=F)
                    sS[sm["part"] + g.part(t, warp, 1, col)] = (
                        regs[warp, lane] * sS[qt + rows : qt + rows + g.rpw]).sum(dtype=F)
        for lane in range(LANES):  # warp 0 solves its columns
            col = min(lane, g.cw - 1)
            r, j, live = cols[lane]
            h = kh * g.rep + r
            for e in range(n):
                sS[sm["ut"] + g.ut(e, col)] = S[st0 + g.ring_u(b, e, h, j)]
            for t in range(T):
                tk = sum(F(sS[sm["part"] + g.part(t, w, 0, col)]) for w in range(NW))
                tq = sum(F(sS[sm["part"] + g.part(t, w, 1, col)]) for w in range(NW))
                p, seg, au, ao = n + t, F(0.0), F(0.0), F(0.0)
                for e in range(p - 1, -1, -1):
                    c = sS[sm["ut"] + g.ut(e, col)]
                    if not channel:
                        seg = F(seg + sS[sm["gs"] + g.gs(r, e + 1)])
                        c = F(np.exp(seg, dtype=F) * c)
                    au = F(au + F(c * sS[sm["dots"] + g.dot(t, 0, e)]))
                    ao = F(ao + F(c * sS[sm["dots"] + g.dot(t, 1, e)]))
                a = F(1.0) if channel else np.exp(F(seg + sS[sm["gs"] + g.gs(r, 0)]), dtype=F)
                xt = sm["x"] + t * g.ch
                u = F(sS[sm["beta"] + t * g.rep + r]
                      * F(sS[xt + 2 * g.dk + r * g.dv + j] - F(F(a * tk) + au)))
                sS[sm["ut"] + g.ut(p, col)] = u
                if live:
                    sS[sm["o"] + (t * g.rep + r) * g.dv + j] = F(F(a * tq) + ao) + F(
                        sS[sm["dots"] + g.dot(t, 1, p)] * u)
                    S[st0 + g.ring_u(b, p, h, j)] = u
        if not fold:
            continue
        for warp in range(NW):
            for lane in range(LANES):
                col = min(lane, g.cw - 1)
                r = cols[lane][0]
                if channel:
                    rows = slice(warp * g.rpw, (warp + 1) * g.rpw)
                    reg = sS[sm["tot"] + rows.start : sm["tot"] + rows.stop] * regs[warp, lane]
                    for e in range(n + T):
                        kf = sm["kf"] + g.gs_c(e, rows.start)
                        reg = reg + sS[kf : kf + g.rpw] * sS[sm["ut"] + g.ut(e, col)]
                else:
                    gsr = sS[sm["gs"] + g.gs(r, 0) : sm["gs"] + g.gs(r, n + T)]
                    tot = F(0.0)
                    for e in range(n + T):
                        tot = F(tot + gsr[e])
                    reg = regs[warp, lane] * np.exp(tot, dtype=F)
                    seg = F(0.0)
                    for e in range(n + T - 1, -1, -1):
                        c = F(np.exp(seg, dtype=F) * sS[sm["ut"] + g.ut(e, col)])
                        rows = sm["keys"] + g.key(e, warp * g.rpw)
                        reg = reg + sS[rows : rows + g.rpw] * c
                        seg = F(seg + gsr[e])
                regs[warp, lane] = reg
        _store_tile(g, d, kh, regs, cols, S)
    I32[count] = 0 if fold else n + T


def emulate_norm_out(g, d: dict, unit: int, W: np.ndarray, sS: np.ndarray, out: np.ndarray,  # noqa: ANN001
                   eps: float, gate: Callable[[int, int, int], float]) -> None:
    """Phase 4: a warp per (token, value head): RMSNorm(o) * w * gate(t, h, j) to ssm_out."""
    b, sm = d["B_IDX"], g.smem()
    for p in range(g.tokens * g.rep):
        t = p // g.rep
        h = unit * g.rep + p - t * g.rep
        o = sS[sm["o"] + p * g.dv : sm["o"] + (p + 1) * g.dv]
        assert np.isfinite(o).all(), "a column of o was never written"
        rstd = F(1.0) / np.sqrt(F(F((o * o).sum(dtype=F)) / F(g.dv)) + F(eps), dtype=F)
        for j in range(g.dv):
            out[d["OUT_OFF"] + g.out(b, t, h, j)] = F(o[j] * rstd * W[d["NORM_W"] + j]) * gate(
                t, h, j)


def last_records(prog, layer: int, op: int) -> list[dict]:  # noqa: ANN001
    """The decoded records of opcode `op` of layer `layer` in the program."""
    recs = [isa.decode(r) for q in prog.records().tolist() for r in q if r[0] != isa.Op.END]
    return [d for d in recs if d["OPCODE"] == op and d["LAYER"] == layer]


def assert_bf16_close(out: np.ndarray, ex, r) -> None:  # noqa: ANN001
    """The emulated bf16 region `r` (fp32 values) within one bf16 ulp of the executor's, or
    within fp32 rounding of the largest value (an element cancelled to near zero)."""
    got = torch.from_numpy(out[r.offset : r.offset + r.numel]).to(torch.bfloat16).float()
    want = ex.bf16[r.offset : r.offset + r.numel].float()
    assert torch.isfinite(got).all() and want.abs().max() > 0.01
    ulp = 2.0 ** -7 * want.abs()  # one bf16 ulp (8 significant bits)
    bad = (got - want).abs() > ulp.clamp_min(1e-6 * float(want.abs().max()))
    assert not bool(bad.any()), (got[bad], want[bad], want.abs().max())
