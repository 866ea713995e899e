"""A numpy emulation of the MAMBA_CORE device handler (kernel/mamba2.py), run with the kernel's
own index helpers (kernel/mamba_index.py), against the CPU executor's step.

The emulation walks the handler's phases with its thread mapping (a thread per conv channel and
per (token, head) gate, a warp per token for B . C and the output norm, state rows on LPR lanes
with RPT rows per thread in row tiles, the segmented shuffle reductions as butterflies) over flat
fp32 arrays laid out as the state arena, proj, ssm_out and the shared scratch span, in float32 as
the device code computes. The executor runs the same program step; its proj (the last Mamba2
layer's), the state block of that layer before the step, and its outputs after it are the ground
truth: new conv window and states within fp32 rounding, ssm_out within one bf16 ulp. Shapes:
nemotron-h-tiny (R = 4, N = 16: two rows per warp pass) at B = 2, T = 1 and 4, and two other
head shapes (SHAPES: N = 128 with four row tiles and a 3-tap conv; N = 8, four rows per pass).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.executor import Executor, executor_gpu
from megakernel.kernel.gdn_index import SOFTPLUS_LINEAR
from megakernel.kernel.mamba_index import LANES, MambaShape, check_mamba
from megakernel.kernel.spec import NUM_THREADS, SpecError, make_spec
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


def emulate_core(m: MambaShape, d: dict, W: np.ndarray, F32: np.ndarray, S: np.ndarray,
                 out: np.ndarray, eps: float) -> None:
    """One MAMBA_CORE record, as kernel/mamba2.py runs it: W bf16 weights (as fp32), F32 the
    fp32 arena, S the state arena (updated), out the bf16 arena as fp32 (written)."""
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
        sS[sm["dt"] + idx] = sp
        sS[sm["da"] + idx] = np.exp(F(-np.exp(F32[prm + h], dtype=F) * sp), dtype=F)
    # B . C: a warp per token, lanes strided over n
    for t in range(T):
        base = sm["x"] + t * m.ch + m.rows
        part = np.zeros(LANES, dtype=F)
        for n in range(m.state_size):
            part[n % LANES] = F(part[n % LANES] + F(sS[base + n] * sS[base + m.state_size + n]))
        sS[sm["bc"] + t] = butterfly(part, LANES)[0]
    # phase 2: states, per row tile; registers [warp][lane][RPT][CPL]
    warp, lane = np.arange(NW)[:, None], LANE[None, :]
    cols = np.stack([m.col(lane, c) for c in range(m.cpl)], -1)  # [1, 32, CPL]
    D = F32[prm + m.heads + j * m.rep : prm + m.heads + (j + 1) * m.rep]
    for it in range(m.tiles):
        rows = np.stack([np.broadcast_to(m.row(it, warp, lane, k), (NW, LANES))
                         for k in range(m.rpt)], -1)  # [NW, 32, RPT]
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
            sc = butterfly(np.moveaxis(sc, 1, -1), m.lpr)  # [NW, RPT, 32]
            sc = np.moveaxis(sc, -1, 1)
            xv = sS[xt + rows]
            dt, da = sS[sm["dt"] + t * m.rep + head], sS[sm["da"] + t * m.rep + head]
            y = F(da * sc) + F(F(dt * sS[sm["bc"] + t]) * xv)
            y = F(y + F(D[head] * xv))
            lead = (lane % m.lpr == 0)[..., None] & np.ones_like(rows, dtype=bool)
            sS[sm["y"] + t * m.rows + rows[lead]] = y[lead]
            regs = F(da[..., None] * regs) + F(xv[..., None] * F(dt[..., None] * bb))
        S[addr] = regs
    # phase 3: a warp per token
    for t in range(T):
        y = sS[sm["y"] + t * m.rows : sm["y"] + (t + 1) * m.rows]
        assert np.isfinite(y).all(), "a row of y was never written"
        z = np.array([F32[proj + m.proj(b, t, m.z_col(j, c))] for c in range(m.rows)], dtype=F)
        g = F(y * silu(z))
        part = np.zeros(LANES, dtype=F)
        for c in range(m.rows):
            part[c % LANES] = F(part[c % LANES] + F(g[c] * g[c]))
        ss = butterfly(part, LANES)[0]
        rstd = F(1.0) / np.sqrt(F(F(ss / F(m.rows)) + F(eps)), dtype=F)
        for c in range(m.rows):
            out[d["OUT_OFF"] + m.out(b, t, j, c)] = F(F(g[c] * rstd)
                                                       * W[d["NORM_W"] + j * m.rows + c])


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


def last_mamba_records(prog, layer: int) -> list[dict]:
    recs = [isa.decode(r) for q in prog.records().tolist() for r in q if r[0] != isa.Op.END]
    return [d for d in recs if d["OPCODE"] == isa.Op.MAMBA_CORE and d["LAYER"] == layer]


@pytest.mark.parametrize("model,batch,tokens", [
    ("nemotron-h-tiny", 2, 1), ("nemotron-h-tiny", 2, 4), ("wide", 1, 2), ("narrow", 2, 3)])
def test_mamba_core_emulation_matches_the_executor(model, batch, tokens):
    cfg = model_config(model)
    spec = make_spec(cfg, batch, tokens, "sm_90a")
    m = spec.mamba_shape
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
    r = prog.buffers.bf16["ssm_out"]
    got = torch.from_numpy(out[r.offset : r.offset + r.numel]).to(torch.bfloat16).float()
    want = ex.bf16[r.offset : r.offset + r.numel].float()
    assert torch.isfinite(got).all() and want.abs().max() > 0.01
    ulp = 2.0 ** -7 * want.abs().clamp_min(1e-30)  # one bf16 ulp (8 significant bits)
    assert bool(((got - want).abs() <= ulp).all()), float((got - want).abs().max())


def test_mamba_shapes_the_handler_refuses():
    """check_mamba names a shape the thread mapping cannot run; make_spec refuses it."""
    assert "state size 48" in check_mamba(MambaShape(8, 8, 48, 2, 4, 1, 1, 8))
    assert "state size 12" in check_mamba(MambaShape(8, 8, 12, 2, 4, 1, 1, 8))
    assert "multiple of 16" in check_mamba(MambaShape(4, 4, 16, 2, 4, 1, 1, 8))
    assert check_mamba(MambaShape(4, 4, 64, 1, 4, 1, 1, 8)) == ""  # 16 rows = 2 passes
    cfg = dataclasses.replace(preset("nemotron-h-tiny"), mamba2=Mamba2Config(8, 8, 24, 2, 4))
    with pytest.raises(SpecError, match="state size 24"):
        make_spec(cfg, 1, 1, "sm_90a")
