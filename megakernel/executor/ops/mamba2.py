"""MAMBA_CORE and MAMBA_REPLAY (layers/mamba2.py), one (sequence, group) each; the SSD math is
the reference's (reference/layers/mamba2.py, replay.py)."""

from __future__ import annotations

import torch

from megakernel.executor.core import Executor, op
from megakernel.executor.ops.recurrent import (
    conv,
    folds,
    proj_cols,
    ring_count,
    set_ring_count,
    state_views,
)
from reference.layers.common import softplus
from reference.layers.mamba2 import ssd_step
from reference.layers.replay import ssd_fold, ssd_replay


def _inputs(ex: Executor, d: dict):  # noqa: ANN202
    blk = ex.block(d, "mamba2")
    m = blk.cfg
    hh, hp, ns, ng, kw = m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel
    rep, di, cd, j = hh // ng, m.d_inner, m.conv_dim, d["GROUP"]
    h0 = j * rep
    taps = ex.weights[d["CONV_W"] : d["CONV_W"] + cd * kw].view(cd, kw).float()
    bias = ex.weights[d["CONV_W"] + cd * kw : d["CONV_W"] + cd * (kw + 1)].float()
    segs = [slice(h0 * hp, (h0 + rep) * hp), slice(di + j * ns, di + (j + 1) * ns),
            slice(di + ng * ns + j * ns, di + ng * ns + (j + 1) * ns)]  # x | B | C of the group
    x, bb, cc = conv(ex, d, blk, di, segs, taps, bias)
    prm = ex.f32[d["PARAM_OFF"] : d["PARAM_OFF"] + 3 * hh].view(3, hh)[:, h0 : h0 + rep]
    t_ = ex.prog.tokens
    dt = proj_cols(ex, d, blk, di + cd + h0, rep)  # [T, R]
    return blk, dict(x=x.reshape(t_, rep, hp), B=bb, C=cc, dt=softplus(dt + prm[2]),
                     a=-prm[0].exp(), D=prm[1], z=proj_cols(ex, d, blk, h0 * hp, rep * hp),
                     heads=slice(h0, h0 + rep), rep=rep)


def _output(ex: Executor, d: dict, blk, inp: dict, y: torch.Tensor) -> None:  # noqa: ANN001
    """bf16(w * RMSNorm over the group of (y * silu(z))) -> ssm_out; y [T, R, P]."""
    m, p, h = blk.cfg, ex.prog, inp["heads"]
    c0, c1 = h.start * m.head_dim, h.stop * m.head_dim
    g = y.reshape(p.tokens, c1 - c0) * torch.nn.functional.silu(inp["z"])
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + ex.eps)
    g = g * ex.weights[d["NORM_W"] + c0 : d["NORM_W"] + c1].float()
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    ex.write("bf16", d["OUT_OFF"], (p.rows, m.d_inner), (rows, slice(c0, c1)), g)


@op("MAMBA_CORE")
def mamba_core(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _inputs(ex, d)
    rep = inp["rep"]
    off, shape = state_views(ex, d, blk)["state"]
    idx = (d["B_IDX"], inp["heads"])
    state = ex.read("state", off, shape, idx, scratch=False)[None]  # [1, R, P, N]
    ys = []
    for t in range(inp["x"].shape[0]):
        b_t, c_t = inp["B"][t].expand(rep, -1), inp["C"][t].expand(rep, -1)  # [R, N]
        y, state = ssd_step(state, inp["x"][t][None], b_t[None], c_t[None], inp["dt"][t][None],
                            inp["a"], inp["D"])
        ys.append(y[0])
    ex.write("state", off, shape, idx, state[0])
    _output(ex, d, blk, inp, torch.stack(ys, dim=0))


@op("MAMBA_REPLAY")
def mamba_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _inputs(ex, d)
    rep, t_, b, j, heads = inp["rep"], ex.prog.tokens, d["B_IDX"], d["GROUP"], inp["heads"]
    views = state_views(ex, d, blk)
    n = ring_count(ex, d, blk, j)
    sel = {"x": heads, "B": j, "dt": heads}  # ring x, dt per head; B per group

    def ring(name: str) -> torch.Tensor:
        off, shape = views[name]
        return ex.read("state", off, shape, (b, slice(0, n), sel[name]), scratch=False)

    ns = blk.cfg.state_size
    old = {"x": ring("x"), "B": ring("B")[:, None, :].expand(-1, rep, ns), "dt": ring("dt")}
    b_new = inp["B"][:, None, :].expand(-1, rep, ns)
    c_new = inp["C"][:, None, :].expand(-1, rep, ns)
    st_off, st_shape = views["state"]
    state = ex.read("state", st_off, st_shape, (b, heads), scratch=False)  # [R, P, N]
    y, _ = ssd_replay(state, old, inp["x"], b_new, c_new, inp["dt"], inp["a"], inp["D"])
    for name, val in (("x", inp["x"]), ("B", inp["B"]), ("dt", inp["dt"])):
        off, shape = views[name]
        ex.write("state", off, shape, (b, slice(n, n + t_), sel[name]), val)
    if folds(ex, n):
        all_ = {"x": torch.cat((old["x"], inp["x"])), "B": torch.cat((old["B"], b_new)),
                "dt": torch.cat((old["dt"], inp["dt"]))}
        ex.write("state", st_off, st_shape, (b, heads), ssd_fold(state, all_, inp["a"]))
        set_ring_count(ex, d, j, 0)
    else:
        set_ring_count(ex, d, j, n + t_)
    _output(ex, d, blk, inp, y)
