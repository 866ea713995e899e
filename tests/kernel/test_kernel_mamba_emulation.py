"""A numpy emulation of the MAMBA_CORE device handler (kernel/mamba2.py), run with the kernel's
own index helpers (kernel/host/mamba_index.py), against the CPU executor's step.

The emulation walks the handler's phases with its thread mapping (a thread per conv channel and
per (token, head) gate, the heads' D and A in shared memory, a warp per token for B . C, state
rows on LPR lanes with RPT rows per thread in row tiles, the segmented shuffle reductions as
butterflies, the output norm's sum of squares by thread, warp and then the warps' partials in
order through shared memory) over flat
fp32 arrays laid out as the state arena, proj, ssm_out and the shared scratch span, in float32 as
the device code computes. The executor runs the same program step; its proj (the last Mamba2
layer's), the state block of that layer before the step, and its outputs after it are the ground
truth: new conv window and states within fp32 rounding, ssm_out within one bf16 ulp. Shapes:
nemotron-h-tiny (R = 4, N = 16: two rows per warp pass) at B = 2, T = 1 and 4, and two other
head shapes (SHAPES: N = 128 with four row tiles and a 3-tap conv; N = 8, four rows per pass).

MAMBA_REPLAY (kernel/device/mamba_replay.py) the same way, step after step with L = 4 from staggered
ring positions: the ring's B and dt, B . C per (token, entry) as warp reductions, the segment
sums, the entries' x spread over a row's lanes in registers (entry), the fold taking each x_e
from the lane that holds it (entry_lane); the whole state block (window, S_c, ring x, B, dt),
the layer's ring_count and ssm_out against the executor's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.common.errors import SpecError
from megakernel.executor import Executor, executor_gpu
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host.gdn_index import SOFTPLUS_LINEAR
from megakernel.kernel.host.limits import NUM_THREADS
from megakernel.kernel.host.mamba_index import LANES, MambaShape, check_mamba
from megakernel.layers import kind
from megakernel.layers.mamba2 import Mamba2Config
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights

F = np.float32
NT, NW = NUM_THREADS, NUM_THREADS // LANES
LANE = np.arange(LANES)


def silu(x):  # noqa: ANN001, ANN201
    return (x / (F(1.0) + np.exp(-x, dtype=F))).astype(F)


def butterfly(v: np.ndarray, group: int) -> np.ndarray:
    """warp_reduction_sum over groups of `group` lanes along the last axis (32 lanes)."""
    off = group // 2
    while off:
        v = (v + v[..., LANE ^ off]).astype(F)
        off //= 2
    return v


def emulate_conv_gates(m: MambaShape, d: dict, W: np.ndarray, F32: np.ndarray,
                       S: np.ndarray) -> np.ndarray:
    """Mamba2.conv and .gates of one record: the scratch span (x, dt, da written; the rest NaN),
    the window in S updated."""
    b, j, proj, prm = d["B_IDX"], d["GROUP"], d["PROJ_OFF"], d["PARAM_OFF"]
    st0, T, sm, cw = d["STATE"], m.tokens, m.smem(), d["CONV_W"]
    sS = np.full(sm["words"], np.nan, dtype=F)  # the scratch span
    # phase 1: conv, a thread per channel (tidx strided), then the gates
    for tidx in range(NT):
        for c in range(tidx, m.ch, NT):
            chan = m.channel(c, j)
            u = [S[st0 + m.window(b, chan, k)] for k in range(m.win)]
            u += [F32[proj + m.proj(b, t, m.x_col(chan))] for t in range(T)]
            bias = W[cw + m.conv_dim * m.conv_k + chan]
            for t in range(T):
                acc = F(0.0)
                for k in range(m.conv_k):
                    acc = F(acc + F(u[t + k] * W[cw + chan * m.conv_k + k]))
                sS[sm["x"] + t * m.ch + c] = silu(F(acc + bias))
            for k in range(m.win):
                S[st0 + m.window(b, chan, k)] = u[T + k]
    for idx in range(T * m.rep):
        t = idx // m.rep
        h = j * m.rep + idx - t * m.rep
        aa = F(F32[proj + m.proj(b, t, m.dt_col(h))] + F32[prm + 2 * m.heads + h])
        sp = aa if aa > SOFTPLUS_LINEAR else F(np.log1p(np.exp(aa, dtype=F), dtype=F))
        a = F(-np.exp(F32[prm + h], dtype=F))  # A = -exp(A_log)
        sS[sm["dt"] + idx] = sp
        sS[sm["da"] + idx] = np.exp(F(a * sp), dtype=F)
        if idx < m.rep:  # token 0's items: the heads' A and D
            sS[sm["a"] + idx] = a
            sS[sm["d"] + idx] = F32[prm + m.heads + h]
    return sS


def emulate_output(m: MambaShape, d: dict, W: np.ndarray, F32: np.ndarray, sS: np.ndarray,
                   out: np.ndarray, eps: float) -> None:
    """Mamba2.output: thread tidx takes the columns out_col(tidx, i); per token the gated group
    RMSNorm of y into out (bf16 as fp32), the sum of g^2 over a thread's columns in order, the
    warp's butterfly, then the warps' partials (ss in the scratch span) in warp order."""
    b, j, proj, sm = d["B_IDX"], d["GROUP"], d["PROJ_OFF"], m.smem()
    nw = m.num_warps
    for t in range(m.tokens):
        y = sS[sm["y"] + t * m.rows : sm["y"] + (t + 1) * m.rows]
        assert np.isfinite(y).all(), "a row of y was never written"
        z = np.array([F32[proj + m.proj(b, t, m.z_col(j, c))] for c in range(m.rows)], dtype=F)
        g = F(y * silu(z))
        part = np.zeros(m.threads, dtype=F)
        for tidx in range(m.threads):
            for i in range(m.out_cols):
                c = m.out_col(tidx, i)
                if c < m.rows:
                    part[tidx] = F(part[tidx] + F(g[c] * g[c]))
        sS[sm["ss"] + t * nw : sm["ss"] + (t + 1) * nw] = butterfly(
            part.reshape(nw, LANES), LANES)[:, 0]
        ss = F(0.0)
        for q in range(nw):
            ss = F(ss + sS[sm["ss"] + t * nw + q])
        rstd = F(1.0) / np.sqrt(F(F(ss / F(m.rows)) + F(eps)), dtype=F)
        for c in range(m.rows):
            out[d["OUT_OFF"] + m.out(b, t, j, c)] = F(F(g[c] * rstd)
                                                       * W[d["NORM_W"] + j * m.rows + c])


def tile_regs(m: MambaShape, it: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows [NW, 32, RPT], columns [1, 32, CPL]) of the state values the threads hold in row
    tile `it` (registers [warp][lane][RPT][CPL])."""
    warp, lane = np.arange(NW)[:, None], LANE[None, :]
    rows = np.stack([np.broadcast_to(m.row(it, warp, lane, k), (NW, LANES))
                     for k in range(m.rpt)], -1)
    return rows, np.stack([m.col(lane, c) for c in range(m.cpl)], -1)


def lpr_reduce(m: MambaShape, v: np.ndarray) -> np.ndarray:
    """warp_reduction_sum over a row's LPR lanes of v [NW, 32, RPT]."""
    return np.moveaxis(butterfly(np.moveaxis(v, 1, -1), m.lpr), -1, 1)


def emulate_core(m: MambaShape, d: dict, W: np.ndarray, F32: np.ndarray, S: np.ndarray,
                 out: np.ndarray, eps: float) -> None:
    """One MAMBA_CORE record, as kernel/mamba2.py runs it: W bf16 weights (as fp32), F32 the
    fp32 arena, S the state arena (updated), out the bf16 arena as fp32 (written)."""
    b, j, st0, T, sm = d["B_IDX"], d["GROUP"], d["STATE"], m.tokens, m.smem()
    sS = emulate_conv_gates(m, d, W, F32, S)
    # B . C: a warp per token, lanes strided over n
    for t in range(T):
        base = sm["x"] + t * m.ch + m.rows
        part = np.zeros(LANES, dtype=F)
        for n in range(m.state_size):
            part[n % LANES] = F(part[n % LANES] + F(sS[base + n] * sS[base + m.state_size + n]))
        sS[sm["bc"] + t] = butterfly(part, LANES)[0]
    # phase 2: states, per row tile; registers [warp][lane][RPT][CPL]
    lane = LANE[None, :]
    D = sS[sm["d"] : sm["d"] + m.rep]  # from gates
    for it in range(m.tiles):
        rows, cols = tile_regs(m, it)
        addr = st0 + m.state(b, j, rows[..., None], cols[:, :, None, :])  # [NW, 32, RPT, CPL]
        regs = S[addr].astype(F)
        head = rows // m.head_dim
        for t in range(T):
            xt = sm["x"] + t * m.ch
            cc = sS[xt + m.rows + m.state_size + cols][:, :, None, :]  # C of the columns
            bb = sS[xt + m.rows + cols][:, :, None, :]
            sc = F(0.0)
            for c in range(m.cpl):  # the lane's columns in order
                sc = (sc + regs[..., c] * cc[..., c]).astype(F)
            sc = lpr_reduce(m, sc)
            xv = sS[xt + rows]
            dt, da = sS[sm["dt"] + t * m.rep + head], sS[sm["da"] + t * m.rep + head]
            y = F(da * sc) + F(F(dt * sS[sm["bc"] + t]) * xv)
            y = F(y + F(D[head] * xv))
            lead = (lane % m.lpr == 0)[..., None] & np.ones_like(rows, dtype=bool)
            sS[sm["y"] + t * m.rows + rows[lead]] = y[lead]
            regs = F(da[..., None] * regs) + F(xv[..., None] * F(dt[..., None] * bb))
        S[addr] = regs
    emulate_output(m, d, W, F32, sS, out, eps)


def emulate_replay(m: MambaShape, window: int, d: dict, W: np.ndarray, F32: np.ndarray,
                   S: np.ndarray, I32: np.ndarray, out: np.ndarray, eps: float) -> None:
    """One MAMBA_REPLAY record, as kernel/device/mamba_replay.py runs it (S: the state arena with
    the ring, I32: the i32 arena with ring_count; both updated)."""
    b, j, st0, T, sm = d["B_IDX"], d["GROUP"], d["STATE"], m.tokens, m.smem()
    N, R, cap, cnt = m.state_size, m.rep, m.cap, d["COUNT_OFF"] + m.count(b, j)
    n = int(I32[cnt])
    assert 0 <= n < window and n + T <= cap
    sS = emulate_conv_gates(m, d, W, F32, S)
    ne = n + T
    # r1: the committed entries' B, dt from the ring, the new ones appended
    for idx in range(ne * N):
        e, c = divmod(idx, N)
        if e < n:
            v = S[st0 + m.ring_b(b, e, j, c)]
        else:
            v = sS[sm["x"] + (e - n) * m.ch + m.rows + c]
            S[st0 + m.ring_b(b, e, j, c)] = v
        sS[sm["bs"] + idx] = v
    for idx in range(ne * R):
        e, r = divmod(idx, R)
        if e < n:
            v = S[st0 + m.ring_dt(b, e, j, r)]
        else:
            v = sS[sm["dt"] + idx - n * R]
            S[st0 + m.ring_dt(b, e, j, r)] = v
        sS[sm["dtr"] + idx] = v
        sS[sm["lam"] + idx] = F(sS[sm["a"] + r] * v)
    for idx in range(T * m.rows):
        t, row = divmod(idx, m.rows)
        S[st0 + m.ring_x(b, n + t, j, row)] = sS[sm["x"] + t * m.ch + row]
    # r2: a warp per (t, e), lanes strided over n
    for t in range(T):
        cc = sm["x"] + t * m.ch + m.rows + N
        for e in range(ne):
            part = np.zeros(LANES, dtype=F)
            for c in range(N):
                part[c % LANES] = F(part[c % LANES] + F(sS[sm["bs"] + e * N + c] * sS[cc + c]))
            sS[sm["dots"] + t * cap + e] = butterfly(part, LANES)[0]

    # r3: the segment sums in entry order
    def lam_sum(first: int, last: int, r: int) -> np.float32:
        s = F(0.0)
        for q in range(first, last + 1):
            s = F(s + sS[sm["lam"] + q * R + r])
        return s

    for t in range(T):
        for e in range(ne):
            for r in range(R):
                cf = F(0.0)
                if e <= n + t:
                    cf = F(sS[sm["dtr"] + e * R + r] * np.exp(lam_sum(e + 1, n + t, r), dtype=F))
                    cf = F(cf * sS[sm["dots"] + t * cap + e])
                sS[sm["coef"] + (t * cap + e) * R + r] = cf
        for r in range(R):
            sS[sm["decay"] + t * R + r] = np.exp(lam_sum(0, n + t, r), dtype=F)
    for e in range(ne):
        for r in range(R):
            sS[sm["wf"] + e * R + r] = F(sS[sm["dtr"] + e * R + r]
                                         * np.exp(lam_sum(e + 1, ne - 1, r), dtype=F))
    # r4: the committed state in row tiles; lane l of a row holds x_e[row] of its entries
    # e = entry(l, i) = l mod LPR + LPR i in registers xe [NW, 32, RPT, ENTRIES]
    fold = ne >= window
    lane = LANE[None, :, None]
    D = sS[sm["d"] : sm["d"] + R]  # from gates
    for it in range(m.tiles):
        rows, cols = tile_regs(m, it)
        addr = st0 + m.state(b, j, rows[..., None], cols[:, :, None, :])
        regs = S[addr].astype(F)
        head = rows // m.head_dim
        xe = np.zeros(rows.shape + (m.entries,), dtype=F)  # load_entries, 0 past n + T
        for i in range(m.entries):
            e = np.broadcast_to(m.entry(lane, i), rows.shape)
            old, new = e < n, (e >= n) & (e < ne)
            xe[..., i][old] = S[st0 + m.ring_x(b, e[old], j, rows[old])]
            xe[..., i][new] = sS[sm["x"] + (e[new] - n) * m.ch + rows[new]]
        part = []
        for t in range(T):
            cc = sS[sm["x"] + t * m.ch + m.rows + N + cols][:, :, None, :]
            sc = F(0.0)
            for c in range(m.cpl):
                sc = (sc + regs[..., c] * cc[..., c]).astype(F)
            part.append(F(sS[sm["decay"] + t * R + head] * sc))
        for i in range(m.entries):  # the lane's entries in order
            e = np.broadcast_to(m.entry(lane, i), rows.shape)
            live = e < ne
            for t in range(T):
                cf = np.zeros(rows.shape, dtype=F)
                cf[live] = sS[sm["coef"] + (t * cap + e[live]) * R + head[live]]
                part[t] = np.where(live, F(part[t] + F(cf * xe[..., i])), part[t])
        for t in range(T):
            y = lpr_reduce(m, part[t])
            y = F(y + F(D[head] * sS[sm["x"] + t * m.ch + rows]))
            lead = np.broadcast_to(lane % m.lpr == 0, rows.shape)
            sS[sm["y"] + t * m.rows + rows[lead]] = y[lead]
        if fold:
            regs = F(sS[sm["decay"] + (T - 1) * R + head][..., None] * regs)
            for i in range(m.entries):
                for e in range(i * m.lpr, min(ne, (i + 1) * m.lpr)):
                    xv = xe[..., i][:, m.entry_lane(LANE, e)]  # the shuffle from its lane
                    w = sS[sm["wf"] + e * R + head][..., None]
                    bb = sS[sm["bs"] + e * N + cols][:, :, None, :]
                    regs = F(regs + F(xv[..., None] * F(w * bb)))
            S[addr] = regs
    I32[cnt] = 0 if fold else ne
    emulate_output(m, d, W, F32, sS, out, eps)


SHAPES = {  # nemotron-h-tiny with other Mamba2 heads
    # N = 128: four columns per lane, R P = 128 rows in four tiles of 32; G = 1; a 3-tap conv
    "wide": Mamba2Config(4, 32, 128, 1, 3),
    # N = 8: four rows per warp pass (8-lane reductions), one tile; R = 2
    "narrow": Mamba2Config(4, 16, 8, 2, 4),
}


def model_config(model: str):  # noqa: ANN201 (ModelConfig)
    if model in SHAPES:
        return dataclasses.replace(preset("nemotron-h-tiny"), mamba2=SHAPES[model],
                                   name=f"nemotron-h-mamba-{model}")
    return preset(model)


def last_mamba_records(prog, layer: int, op: int = isa.Op.MAMBA_CORE) -> list[dict]:
    recs = [isa.decode(r) for q in prog.records().tolist() for r in q if r[0] != isa.Op.END]
    return [d for d in recs if d["OPCODE"] == op and d["LAYER"] == layer]


def assert_ssm_out(prog, ex: Executor, out: np.ndarray) -> None:
    """The emulated ssm_out within one bf16 ulp of the executor's."""
    r = prog.buffers.bf16["ssm_out"]
    got = torch.from_numpy(out[r.offset : r.offset + r.numel]).to(torch.bfloat16).float()
    want = ex.bf16[r.offset : r.offset + r.numel].float()
    assert torch.isfinite(got).all() and want.abs().max() > 0.01
    ulp = 2.0 ** -7 * want.abs().clamp_min(1e-30)  # one bf16 ulp (8 significant bits)
    assert bool(((got - want).abs() <= ulp).all()), float((got - want).abs().max())


@pytest.mark.parametrize("model,batch,tokens", [
    ("nemotron-h-tiny", 2, 1), ("nemotron-h-tiny", 2, 4), ("wide", 1, 2), ("narrow", 2, 3)])
def test_mamba_core_emulation_matches_the_executor(model, batch, tokens):
    cfg = model_config(model)
    spec = make_spec(cfg, batch, tokens, "sm_90a")
    m = spec.shape("mamba2")
    assert check_mamba(m) == "" and m.num_warps == NW and m.tiles * m.tile_rows == m.rows
    w = random_weights(cfg, seed=7)
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=32)
    ex = Executor(prog, pack_weights(cfg, w), check=True)
    gen = torch.Generator().manual_seed(13)
    for _ in range(2):  # states and windows away from zero first
        ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
    layer = max(b.layer for b in cfg.blocks if b.kind == "mamba2")
    before = ex.state.clone()
    ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
    recs = last_mamba_records(prog, layer)
    assert len(recs) == batch * m.groups
    S = before.numpy().astype(F).copy()
    F32 = ex.f32.numpy().astype(F)  # proj of this step (the last Mamba2 layer's)
    W = ex.weights.float().numpy()
    out = np.full(ex.bf16.numel(), np.nan, dtype=F)
    for d in recs:
        emulate_core(m, d, W, F32, S, out, cfg.rms_norm_eps)
    blk = prog.buffers.state[layer]
    lo = blk["conv"].offset
    hi = blk["state"].offset + blk["state"].numel
    mine, theirs = S[lo:hi], ex.state.numpy()[lo:hi]
    assert np.abs(theirs).max() > 0.05 and not np.array_equal(mine, before.numpy()[lo:hi])
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())
    assert_ssm_out(prog, ex, out)


def stagger_ring(prog, ex: Executor, layer: int, units: int, window: int) -> None:
    """Start the layer's sequences at different ring positions n = (2 b + 1) mod L (its groups
    alike, as the executor's write counts expect) with random committed entries and a random
    committed state, set through the program's region shapes (not the kernel's index helpers);
    entries past the count are NaN, so a read beyond the committed ones cannot pass."""
    gen = torch.Generator().manual_seed(5)
    regs = {name: ex.state[r.offset : r.offset + r.numel].view(r.shape)
            for name, r in prog.buffers.state[layer].items()}
    for name in ("x", "B", "dt"):
        regs[name].fill_(float("nan"))
    regs["state"].copy_(0.5 * torch.randn(regs["state"].shape, generator=gen))
    cnt = prog.buffers.i32["ring_count"]
    counts = ex.i32[cnt.offset : cnt.offset + cnt.numel].view(cnt.shape)[
        prog.buffers.row("rec", layer)]  # [B, units]
    heads = regs["x"].shape[2] // units  # R
    for b in range(counts.shape[0]):
        for j in range(units):
            n = (2 * b + 1) % window
            counts[b, j] = n
            hs = slice(j * heads, (j + 1) * heads)
            regs["x"][b, :n, hs] = torch.randn(regs["x"][b, :n, hs].shape, generator=gen)
            regs["B"][b, :n, j] = torch.randn(regs["B"][b, :n, j].shape, generator=gen)
            regs["dt"][b, :n, hs] = 0.05 + 0.5 * torch.rand(regs["dt"][b, :n, hs].shape,
                                                            generator=gen)


@pytest.mark.parametrize("batch,tokens", [(2, 1), (2, 2), (2, 4)])
def test_mamba_replay_emulation_matches_the_executor(batch, tokens):
    """nemotron-h-tiny by ReplaySSM with L = 4, step after step from staggered ring positions
    (stagger_ring; T = 1: rings fill, fold at the 4th entry and restart; T = 2: steps on 0 to
    3 committed entries, folds from 2; T = 4: a fold every step): the last Mamba2 layer's state
    block (window, S_c, ring), ring_count and ssm_out against the executor's."""
    window = 4
    cfg = preset("nemotron-h-tiny")
    spec = make_spec(cfg, batch, tokens, "sm_90a", replay_window=window)
    m = spec.shape("mamba2")
    assert m.cap == window - 1 + tokens and spec.replay_window == window
    w = random_weights(cfg, seed=11)
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=64,
                           replay_window=window)
    assert prog.header["REPLAY_WINDOW"] == window and prog.header["RING_CAP"] == m.cap
    ex = Executor(prog, pack_weights(cfg, w), check=True)
    layer = max(b.layer for b in cfg.blocks if b.kind == "mamba2")
    blk = prog.buffers.state[layer]
    lo, hi = blk["conv"].offset, max(r.offset + r.numel for r in blk.values())
    stagger_ring(prog, ex, layer, m.groups, window)
    recs = last_mamba_records(prog, layer, isa.Op.MAMBA_REPLAY)
    assert len(recs) == batch * m.groups
    cnt = slice(recs[0]["COUNT_OFF"], recs[0]["COUNT_OFF"] + batch * m.groups)  # the layer's
    gen = torch.Generator().manual_seed(17)
    seen = set()
    for _ in range(7 if tokens == 1 else 4):
        S = ex.state.numpy().astype(F).copy()
        I32 = ex.i32.numpy().copy()
        seen |= {(int(n), int(n) + tokens >= window) for n in I32[cnt]}
        ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
        F32 = ex.f32.numpy().astype(F)  # proj of this step (the last Mamba2 layer's)
        out = np.full(ex.bf16.numel(), np.nan, dtype=F)
        for d in recs:
            emulate_replay(m, window, d, ex.weights.float().numpy(), F32, S, I32, out,
                           cfg.rms_norm_eps)
        theirs = ex.state.numpy()[lo:hi]
        np.testing.assert_allclose(S[lo:hi], theirs, rtol=1e-5,
                                   atol=1e-5 * np.nanmax(np.abs(theirs)))
        np.testing.assert_array_equal(I32[cnt], ex.i32.numpy()[cnt])
        assert_ssm_out(prog, ex, out)
    # ring positions 0 (a restart), 1 and 3 at least; steps with and without a fold
    assert {0, 1, 3} <= {n for n, _ in seen}, seen
    assert {f for _, f in seen} == ({True} if tokens >= window else {False, True}), seen


def test_mamba_shapes_the_handler_refuses():
    """check_mamba names a shape the thread mapping cannot run; make_spec refuses it."""
    assert "state size 48" in check_mamba(MambaShape(8, 8, 48, 2, 4, 1, 1, 8))
    assert "state size 12" in check_mamba(MambaShape(8, 8, 12, 2, 4, 1, 1, 8))
    assert "multiple of 16" in check_mamba(MambaShape(4, 4, 16, 2, 4, 1, 1, 8))
    assert check_mamba(MambaShape(4, 4, 64, 1, 4, 1, 1, 8)) == ""  # 16 rows = 2 passes
    cfg = dataclasses.replace(preset("nemotron-h-tiny"), mamba2=Mamba2Config(8, 8, 24, 2, 4))
    with pytest.raises(SpecError, match="state size 24"):
        make_spec(cfg, 1, 1, "sm_90a")


class Traffic:
    """The state arena seen through [] with the elements read (before any write of theirs this
    step) and written marked: the handler's global traffic, distinct elements."""

    def __init__(self, a: np.ndarray):
        self.a = a
        self.read = np.zeros(a.shape, dtype=bool)
        self.written = np.zeros(a.shape, dtype=bool)

    def __getitem__(self, idx):  # noqa: ANN001, ANN204
        self.read[idx] |= ~self.written[idx]
        return self.a[idx]

    def __setitem__(self, idx, v) -> None:  # noqa: ANN001
        self.written[idx] = True
        self.a[idx] = v


def test_mamba_replay_traffic_is_what_the_cost_model_charges():
    """Over one window of L steps at T = 1 from an empty ring, the replay emulation's distinct
    state-arena elements read and written per step, on average, are the bytes layers/recurrent.py
    charges the layer (S_c read once a step, the committed entries once, T entries appended,
    S_c written at the fold, the window read and written once)."""
    window, batch = 4, 2
    cfg = preset("nemotron-h-tiny")
    m = make_spec(cfg, batch, 1, "sm_90a", replay_window=window).shape("mamba2")
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=1, max_seq_len=32,
                           replay_window=window)
    ex = Executor(prog, pack_weights(cfg, random_weights(cfg, seed=3)), check=True)
    layer = max(b.layer for b in cfg.blocks if b.kind == "mamba2")
    blk = next(b for b in cfg.blocks if b.layer == layer and b.kind == "mamba2")
    regs = prog.buffers.state[layer]
    recs = last_mamba_records(prog, layer, isa.Op.MAMBA_REPLAY)
    gen = torch.Generator().manual_seed(23)
    total: dict[str, int] = {}
    for _ in range(window):
        S, I32 = Traffic(ex.state.numpy().astype(F).copy()), ex.i32.numpy().copy()
        ex.step(torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen))
        out = np.full(ex.bf16.numel(), np.nan, dtype=F)
        for d in recs:
            emulate_replay(m, window, d, ex.weights.float().numpy(), ex.f32.numpy(), S, I32,
                           out, cfg.rms_norm_eps)
        for name, r in regs.items():
            part = "ring" if name in ("x", "B", "dt") else name
            for what, mask in (("read", S.read), ("written", S.written)):
                key = f"{part}_{what}"
                total[key] = total.get(key, 0) + 4 * int(mask[r.offset : r.offset + r.numel].sum())
    charged = kind("mamba2").step_bytes(blk, prog)
    mine = {k: v / window for k, v in total.items()}
    for k in ("state_read", "state_written", "ring_read", "ring_written", "conv_read",
              "conv_written"):
        assert mine[k] == charged[k], (k, mine[k], charged[k])
