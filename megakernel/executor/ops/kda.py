"""KDA_CORE and KDA_REPLAY (layers/kda.py), one (sequence, head) each; the delta-rule math is the
reference's (reference/layers/gdn.py, replay.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel.executor.core import Executor, op
from megakernel.executor.ops.recurrent import (
    conv,
    folds,
    proj_cols,
    ring_count,
    set_ring_count,
    state_views,
)
from reference.layers.common import l2norm, rms_norm, softplus
from reference.layers.gdn import delta_rule_step
from reference.layers.replay import delta_rule_fold, delta_rule_replay


def _inputs(ex: Executor, d: dict):  # noqa: ANN202
    blk = ex.block(d, "kda")
    c = blk.cfg
    hh, dd, kw, hd, h = c.num_heads, c.head_dim, c.conv_kernel, c.qkv_dim, d["HEAD"]
    w0 = d["CONV_W"]
    taps = ex.weights[w0 : w0 + c.conv_dim * kw].view(c.conv_dim, kw).float()
    fb = ex.weights[w0 + c.conv_dim * kw :][: hd * dd].view(hd, dd)[h * dd : (h + 1) * dd]
    gb = ex.weights[w0 + c.conv_dim * kw + hd * dd :][: hd * dd].view(hd, dd)
    gb = gb[h * dd : (h + 1) * dd]
    q, k, v = conv(ex, d, blk, 0, [slice(o + h * dd, o + (h + 1) * dd) for o in (0, hd, 2 * hd)],
                   taps)
    base = 3 * hd
    fa, bb, ga = (proj_cols(ex, d, blk, base, dd), proj_cols(ex, d, blk, base + dd + h, 1),
                  proj_cols(ex, d, blk, base + dd + hh, dd))
    prm = ex.f32[d["PARAM_OFF"] : d["PARAM_OFF"] + hh + hd]
    f = F.linear(fa.to(torch.bfloat16).float(), fb.float())  # [T, d]
    g = -prm[h].exp() * softplus(f + prm[hh + h * dd : hh + (h + 1) * dd])
    return blk, dict(q=l2norm(q, divide=True) * dd**-0.5, k=l2norm(k, divide=True),
                     v=v[:, None], beta=torch.sigmoid(bb), g=g[:, None],
                     gate=F.linear(ga.to(torch.bfloat16).float(), gb.float()),
                     heads=slice(h, h + 1))


def _output(ex: Executor, d: dict, blk, inp: dict, y: torch.Tensor) -> None:  # noqa: ANN001
    """bf16(RMSNorm(o) * w * sigmoid(gate)) -> ssm_out; y [T, 1, d]."""
    c, p, h = blk.cfg, ex.prog, d["HEAD"]
    dd = c.head_dim
    o = rms_norm(y[:, 0], ex.weights[d["NORM_W"] : d["NORM_W"] + dd], ex.eps)
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    ex.write("bf16", d["OUT_OFF"], (p.rows, c.qkv_dim), (rows, slice(h * dd, (h + 1) * dd)),
             o * torch.sigmoid(inp["gate"]))


@op("KDA_CORE")
def kda_core(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _inputs(ex, d)
    off, shape = state_views(ex, d, blk)["state"]
    idx = (d["B_IDX"], inp["heads"])
    state = ex.read("state", off, shape, idx, scratch=False)[None]  # [1, 1, d, d]
    ys = []
    for t in range(inp["q"].shape[0]):
        y, state = delta_rule_step(state, inp["q"][t][None, None], inp["k"][t][None, None],
                                   inp["v"][t][None], inp["beta"][t][None], inp["g"][t][None])
        ys.append(y[0])
    ex.write("state", off, shape, idx, state[0])
    _output(ex, d, blk, inp, torch.stack(ys, dim=0))


@op("KDA_REPLAY")
def kda_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _inputs(ex, d)
    t_, b, h, heads = ex.prog.tokens, d["B_IDX"], d["HEAD"], inp["heads"]
    views = state_views(ex, d, blk)
    n = ring_count(ex, d, blk, h)
    old = {}
    for name in ("k", "u", "g"):
        off, shape = views[name]
        old[name] = ex.read("state", off, shape, (b, slice(0, n), heads), scratch=False)
    st_off, st_shape = views["state"]
    state = ex.read("state", st_off, st_shape, (b, heads), scratch=False)  # [1, d, d]
    k = inp["k"][:, None]
    y, entries = delta_rule_replay(state, old, inp["q"][:, None], k, inp["v"], inp["beta"],
                                   inp["g"])
    for name, val in entries.items():
        off, shape = views[name]
        ex.write("state", off, shape, (b, slice(n, n + t_), heads), val)
    if folds(ex, n):
        all_ = {name: torch.cat((old[name], entries[name])) for name in old}
        ex.write("state", st_off, st_shape, (b, heads), delta_rule_fold(state, all_))
        set_ring_count(ex, d, h, 0)
    else:
        set_ring_count(ex, d, h, n + t_)
    _output(ex, d, blk, inp, y)
