"""A numpy emulation of the GDN_CORE device handler (kernel/gdn.py), run with the kernel's own
index helpers (kernel/gdn_index.py), against the CPU executor's step.

The emulation walks the handler's phases with its thread mapping (a thread per conv channel, a
warp per (token, q/k) norm and per (token, value head) output, lanes = state columns in tiles of
CW, warps = row blocks of RPW, the two partial buffers) over flat fp32 arrays laid out as the
state arena, proj, ssm_out and the shared scratch span, in float32 as the device code computes.
The executor runs the same program step; its proj (the last GDN layer's), the state block of that
layer before the step, and its outputs after it are the ground truth: new conv window and states
within fp32 rounding, ssm_out within one bf16 ulp. Shapes: qwen3.5-tiny (R = 2, dv = 8 < 32: idle
lanes) at B = 2, T = 1 and 4, and two other head shapes (SHAPES: two column tiles; three value
heads per key head and a 3-tap conv).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.executor import Executor, executor_gpu
from megakernel.kernel.gdn_index import L2NORM_EPS, LANES, SOFTPLUS_LINEAR, GDNShape, check_gdn
from megakernel.kernel.spec import NUM_THREADS, make_spec
from megakernel.layers.gdn import GDNConfig
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights

F = np.float32
NT, NW = NUM_THREADS, NUM_THREADS // LANES


def silu(x):  # noqa: ANN001, ANN201
    return F(x / (F(1.0) + np.exp(F(-x), dtype=F)))


def emulate_core(g: GDNShape, d: dict, W: np.ndarray, F32: np.ndarray, S: np.ndarray,
                 out: np.ndarray, eps: float) -> None:
    """One GDN_CORE record, as kernel/gdn.py runs it: W bf16 weights (as fp32), F32 the fp32
    arena, S the state arena (updated), out the bf16 arena as fp32 (written)."""
    sS = emulate_inputs(g, d, W, F32, S)
    emulate_states(g, d, S, sS)
    emulate_output(g, d, W, F32, sS, out, eps)


def emulate_inputs(g: GDNShape, d: dict, W: np.ndarray, F32: np.ndarray, S: np.ndarray
                   ) -> np.ndarray:
    """Phases 1-2 of both handlers (conv, gates, l2 norms): the scratch span they leave."""
    b, kh, proj, prm = d["B_IDX"], d["K_HEAD"], d["PROJ_OFF"], d["PARAM_OFF"]
    st0, T, sm = d["STATE"], g.tokens, g.smem()
    sS = np.full(sm["words"], np.nan, dtype=F)  # the scratch span
    # phase 1: conv, a thread per channel (tidx strided)
    for tidx in range(NT):
        for c in range(tidx, g.ch, NT):
            chan = g.channel(c, kh)
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
    # gates
    for idx in range(T * g.rep):
        t = idx // g.rep
        h = kh * g.rep + idx - t * g.rep
        bb = F32[proj + g.proj(b, t, g.beta_col(h))]
        aa = F(F32[proj + g.proj(b, t, g.a_col(h))] + F32[prm + g.hv + h])
        sp = aa if aa > SOFTPLUS_LINEAR else F(np.log1p(np.exp(aa, dtype=F), dtype=F))
        sS[sm["beta"] + idx] = F(1.0) / (F(1.0) + np.exp(-bb, dtype=F))
        sS[sm["g"] + idx] = F(-np.exp(F32[prm + h], dtype=F) * sp)
    # l2 norms: a warp per (token, q or k)
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


def emulate_states(g: GDNShape, d: dict, S: np.ndarray, sS: np.ndarray) -> None:
    """GDN_CORE's k.q and phase 3 (the states through registers)."""
    b, kh, st0, T, sm = d["B_IDX"], d["K_HEAD"], d["STATE"], g.tokens, g.smem()
    for t in range(T):
        base = sm["x"] + t * g.ch
        sS[sm["kq"] + t] = (sS[base + g.dk : base + 2 * g.dk] * sS[base : base + g.dk]).sum(
            dtype=F)
    # phase 3: states, per tile; registers [warp][lane][RPW]; the partial buffers alternate
    buf = 0
    for it in range(g.rep * g.tiles):
        regs = np.zeros((NW, LANES, g.rpw), dtype=F)
        cols = {}
        for warp in range(NW):
            for lane in range(LANES):
                col = min(lane, g.cw - 1)
                r, j = g.tile_column(it, col)
                cols[lane] = (r, j, lane < g.cw)
                h = kh * g.rep + r
                for rr in range(g.rpw):
                    regs[warp, lane, rr] = S[st0 + g.state(b, h, warp * g.rpw + rr, j)]
        for t in range(T):
            xt = sm["x"] + t * g.ch
            for warp in range(NW):  # partials, then the barrier
                rows = slice(warp * g.rpw, (warp + 1) * g.rpw)
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
                    a = np.exp(sS[sm["g"] + t * g.rep + r], dtype=F)
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
        for warp in range(NW):
            for lane in range(LANES):
                r, j, live = cols[lane]
                if live:
                    for rr in range(g.rpw):
                        h = kh * g.rep + r
                        S[st0 + g.state(b, h, warp * g.rpw + rr, j)] = regs[warp, lane, rr]


def emulate_output(g: GDNShape, d: dict, W: np.ndarray, F32: np.ndarray, sS: np.ndarray,
                   out: np.ndarray, eps: float) -> None:
    """Phase 4 of both handlers: a warp per (token, value head)."""
    b, kh, proj, sm = d["B_IDX"], d["K_HEAD"], d["PROJ_OFF"], g.smem()
    for p in range(g.tokens * g.rep):
        t = p // g.rep
        h = kh * g.rep + p - t * g.rep
        o = sS[sm["o"] + p * g.dv : sm["o"] + (p + 1) * g.dv]
        assert np.isfinite(o).all(), "a column of o was never written"
        rstd = F(1.0) / np.sqrt(F(F((o * o).sum(dtype=F)) / F(g.dv)) + F(eps), dtype=F)
        for j in range(g.dv):
            z = F32[proj + g.proj(b, t, g.z_col(h, j))]
            out[d["OUT_OFF"] + g.out(b, t, h, j)] = F(o[j] * rstd * W[d["NORM_W"] + j]) * silu(z)


def emulate_replay(g: GDNShape, d: dict, W: np.ndarray, F32: np.ndarray, I32: np.ndarray,
                   S: np.ndarray, out: np.ndarray, eps: float) -> None:
    """One GDN_REPLAY record, as kernel/gdn.py runs it (steps r1-r3 of gdn_index.py); I32 the
    int32 arena (the ring count, updated), the rest as emulate_core."""
    sS = emulate_inputs(g, d, W, F32, S)
    b, kh, st0, T, sm = d["B_IDX"], d["K_HEAD"], d["STATE"], g.tokens, g.smem()
    count = d["COUNT_OFF"] + g.count(b, kh)
    n = int(I32[count])
    assert 0 <= n < g.replay_window
    # r1: a thread per (entry, element): committed from the ring, new ones appended to it
    for idx in range(NT * ((n + T) * g.dk // NT + 1)):
        if idx >= (n + T) * g.dk:
            break
        e, i = divmod(idx, g.dk)
        at = st0 + g.ring_k(b, e, kh, i)
        if e >= n:
            S[at] = sS[sm["x"] + (e - n) * g.ch + g.dk + i]
        sS[sm["keys"] + g.key(e, i)] = S[at]
    for idx in range((n + T) * g.rep):
        e, r = divmod(idx, g.rep)
        at = st0 + g.ring_g(b, e, kh * g.rep + r)
        if e >= n:
            S[at] = sS[sm["g"] + (e - n) * g.rep + r]
        sS[sm["gs"] + g.gs(r, e)] = S[at]
    # r2: a warp per (entry, token, k or q)
    for e in range(n + T):
        key = sS[sm["keys"] + g.key(e, 0) : sm["keys"] + g.key(e, g.dk)]
        for t in range(T):
            for which in range(2):
                base = sm["x"] + t * g.ch + (1 - which) * g.dk
                sS[sm["dots"] + g.dot(t, which, e)] = (key * sS[base : base + g.dk]).sum(dtype=F)
    fold = n + T >= g.replay_window
    # r3: per column tile; registers [warp][lane][RPW]
    for it in range(g.rep * g.tiles):
        regs = np.zeros((NW, LANES, g.rpw), dtype=F)
        cols = {}
        for warp in range(NW):
            for lane in range(LANES):
                col = min(lane, g.cw - 1)
                r, j = g.tile_column(it, col)
                cols[lane] = (r, j, lane < g.cw)
                for rr in range(g.rpw):
                    regs[warp, lane, rr] = S[st0 + g.state(b, kh * g.rep + r, warp * g.rpw + rr,
                                                           j)]
                for t in range(T):
                    xt = sm["x"] + t * g.ch + warp * g.rpw
                    sS[sm["part"] + g.part(t, warp, 0, col)] = (
                        regs[warp, lane] * sS[xt + g.dk : xt + g.dk + g.rpw]).sum(dtype=F)
                    sS[sm["part"] + g.part(t, warp, 1, col)] = (
                        regs[warp, lane] * sS[xt : xt + g.rpw]).sum(dtype=F)
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
                    seg = F(seg + sS[sm["gs"] + g.gs(r, e + 1)])
                    c = F(np.exp(seg, dtype=F) * sS[sm["ut"] + g.ut(e, col)])
                    au = F(au + F(c * sS[sm["dots"] + g.dot(t, 0, e)]))
                    ao = F(ao + F(c * sS[sm["dots"] + g.dot(t, 1, e)]))
                a = np.exp(F(seg + sS[sm["gs"] + g.gs(r, 0)]), dtype=F)
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
                r, j, live = cols[lane]
                gs = sS[sm["gs"] + g.gs(r, 0) : sm["gs"] + g.gs(r, n + T)]
                tot = F(0.0)
                for e in range(n + T):
                    tot = F(tot + gs[e])
                reg = regs[warp, lane] * np.exp(tot, dtype=F)
                seg = F(0.0)
                for e in range(n + T - 1, -1, -1):
                    c = F(np.exp(seg, dtype=F) * sS[sm["ut"] + g.ut(e, col)])
                    rows = sm["keys"] + g.key(e, warp * g.rpw)
                    reg = reg + sS[rows : rows + g.rpw] * c
                    seg = F(seg + gs[e])
                if live:
                    for rr in range(g.rpw):
                        S[st0 + g.state(b, kh * g.rep + r, warp * g.rpw + rr, j)] = reg[rr]
    I32[count] = 0 if fold else n + T
    emulate_output(g, d, W, F32, sS, out, eps)


SHAPES = {  # qwen3.5-tiny with other GDN heads
    # dv = 64 > 32: two column tiles, every lane live
    "wide": GDNConfig(2, 2, 64, 64, 4),
    # R = 3 value heads per key head, R dv = 24 != dk: the v channels' stride is their own
    "odd": GDNConfig(2, 6, 16, 8, 3),
}


def model_config(model: str):  # noqa: ANN201 (ModelConfig)
    if model in SHAPES:
        return dataclasses.replace(preset("qwen3.5-tiny"), gdn=SHAPES[model],
                                   name=f"qwen3.5-gdn-{model}")
    return preset(model)


def last_gdn_records(prog, layer: int, op: int = isa.Op.GDN_CORE) -> list[dict]:
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


@pytest.mark.parametrize("model,batch,tokens", [("qwen3.5-tiny", 2, 1), ("qwen3.5-tiny", 2, 4),
                                                ("wide", 1, 2), ("odd", 2, 3)])
def test_gdn_core_emulation_matches_the_executor(model, batch, tokens):
    cfg = model_config(model)
    spec = make_spec(cfg, batch, tokens, "sm_90a")
    g = spec.gdn_shape
    assert check_gdn(g) == "" and g.num_warps == NW
    w = random_weights(cfg, seed=5)
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=32)
    ex = Executor(prog, pack_weights(cfg, w), check=True)
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):  # states and windows away from zero first
        ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
    layer = max(b.layer for b in cfg.blocks if b.kind == "gdn")
    before = ex.state.clone()
    ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
    recs = last_gdn_records(prog, layer)
    assert len(recs) == batch * g.hk
    S = before.numpy().astype(F).copy()
    F32 = ex.f32.numpy().astype(F)  # proj of this step (the last GDN layer's)
    W = ex.weights.float().numpy()
    out = np.full(ex.bf16.numel(), np.nan, dtype=F)
    for d in recs:
        emulate_core(g, d, W, F32, S, out, cfg.rms_norm_eps)
    blk = prog.buffers.state[layer]
    lo = blk["conv"].offset
    hi = blk["state"].offset + blk["state"].numel
    mine, theirs = S[lo:hi], ex.state.numpy()[lo:hi]
    assert np.abs(theirs).max() > 0.05 and not np.array_equal(mine, before.numpy()[lo:hi])
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())
    assert_bf16_close(out, ex, prog.buffers.bf16["ssm_out"])


@pytest.mark.parametrize("model,batch,tokens", [("qwen3.5-tiny", 2, 1), ("qwen3.5-tiny", 2, 4),
                                                ("qwen3.5-tiny", 2, 3), ("wide", 1, 2)])
def test_gdn_replay_emulation_matches_the_executor(model, batch, tokens):
    """GDN_REPLAY with L = 4 over steps that fill the ring, fold and restart it (T = 3: a step
    with committed entries and several new ones); every step's state block (window, committed
    state, ring), ring counts and ssm_out against the executor's."""
    window = 4
    cfg = model_config(model)
    spec = make_spec(cfg, batch, tokens, "sm_90a", replay_window=window)
    g = spec.gdn_shape
    assert check_gdn(g) == "" and g.replay_window == window
    assert isa.Op.GDN_REPLAY in spec.handled_ops
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=64,
                           replay_window=window)
    assert g.cap == prog.buffers.ring_cap == prog.header["RING_CAP"]
    ex = Executor(prog, pack_weights(cfg, random_weights(cfg, seed=5)), check=True)
    gen = torch.Generator().manual_seed(11)
    layer = max(b.layer for b in cfg.blocks if b.kind == "gdn")
    blk = prog.buffers.state[layer]
    lo, hi = blk["conv"].offset, blk["g"].offset + blk["g"].numel
    seen = set()
    for step in range(-(-2 * window // tokens) + 1):
        before, counts = ex.state.numpy().astype(F).copy(), ex.i32.numpy().copy()
        ex.step(torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen))
        recs = last_gdn_records(prog, layer, isa.Op.GDN_REPLAY)
        assert len(recs) == batch * g.hk
        S, I32 = before.copy(), counts.copy()
        out = np.full(ex.bf16.numel(), np.nan, dtype=F)
        for d in recs:
            seen.add(int(I32[d["COUNT_OFF"] + g.count(d["B_IDX"], d["K_HEAD"])]))
            emulate_replay(g, d, ex.weights.float().numpy(), ex.f32.numpy().astype(F), I32, S,
                           out, cfg.rms_norm_eps)
        mine, theirs = S[lo:hi], ex.state.numpy()[lo:hi]
        assert not np.array_equal(mine, before[lo:hi])
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max(),
                                   err_msg=f"step {step}")
        c0 = recs[0]["COUNT_OFF"]
        np.testing.assert_array_equal(I32[c0 : c0 + batch * g.hk],
                                      ex.i32.numpy()[c0 : c0 + batch * g.hk])
        assert_bf16_close(out, ex, prog.buffers.bf16["ssm_out"])
    # the ring restarted (count 0 after a fold) and, but for T = L, held committed entries
    assert 0 in seen and (tokens == window or max(seen) > 0), seen


def test_gdn_shapes_the_handler_refuses():
    """check_gdn names a shape the thread mapping cannot run; make_spec refuses it."""
    assert "multiple of the 8 warps" in check_gdn(GDNShape(2, 2, 20, 8, 4, 1, 1, 8))
    assert "value head dim 48" in check_gdn(GDNShape(2, 2, 16, 48, 4, 1, 1, 8))
    assert "tokens" in check_gdn(GDNShape(2, 2, 16, 8, 4, 1, 8, 8))
    cfg = dataclasses.replace(preset("qwen3.5-tiny"), gdn=GDNConfig(2, 4, 20, 8, 4))
    from megakernel.kernel.spec import SpecError

    with pytest.raises(SpecError, match="key head dim 20"):
        make_spec(cfg, 1, 1, "sm_90a")
