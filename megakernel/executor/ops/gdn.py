"""GDN_CORE and GDN_REPLAY (layers/gdn.py), one (sequence, key head) each; the delta-rule math is
the reference's (reference/layers/gdn.py, replay.py)."""

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
from reference.layers.common import l2norm, rms_norm, softplus
from reference.layers.gdn import delta_rule_step
from reference.layers.replay import delta_rule_fold, delta_rule_replay


def _inputs(ex: Executor, d: dict):  # noqa: ANN202
    blk = ex.block(d, "gdn")
    c = blk.cfg
    hv, dk, dv = c.num_v_heads, c.k_head_dim, c.v_head_dim
    kh, rep, kd = d["K_HEAD"], hv // c.num_k_heads, c.key_dim
    h0 = kh * rep
    taps = ex.weights[d["CONV_W"] : d["CONV_W"] + c.conv_dim * c.conv_kernel].view(
        c.conv_dim, c.conv_kernel).float()
    segs = [slice(kh * dk, (kh + 1) * dk), slice(kd + kh * dk, kd + (kh + 1) * dk),
            slice(2 * kd + h0 * dv, 2 * kd + (h0 + rep) * dv)]
    q, k, v = conv(ex, d, blk, 0, segs, taps)
    bc = c.conv_dim + c.value_dim + h0
    prm = ex.f32[d["PARAM_OFF"] : d["PARAM_OFF"] + 2 * hv].view(2, hv)[:, h0 : h0 + rep]
    t_ = ex.prog.tokens
    return blk, dict(
        q=l2norm(q) * dk**-0.5, k=l2norm(k), v=v.reshape(t_, rep, dv),
        beta=torch.sigmoid(proj_cols(ex, d, blk, bc, rep)),
        g=-prm[0].exp() * softplus(proj_cols(ex, d, blk, bc + hv, rep) + prm[1]),  # [T, R]
        z=proj_cols(ex, d, blk, c.conv_dim + h0 * dv, rep * dv), heads=slice(h0, h0 + rep),
        rep=rep)


def _output(ex: Executor, d: dict, blk, inp: dict, y: torch.Tensor) -> None:  # noqa: ANN001
    """bf16(RMSNorm(y) * w * silu(z)) per value head -> ssm_out; y [T, R, dv]."""
    c, p = blk.cfg, ex.prog
    dv, rep, h = c.v_head_dim, inp["rep"], inp["heads"]
    nw = ex.weights[d["NORM_W"] : d["NORM_W"] + dv]
    o = rms_norm(y, nw, ex.eps) * torch.nn.functional.silu(inp["z"].reshape(p.tokens, rep, dv))
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    ex.write("bf16", d["OUT_OFF"], (p.rows, c.value_dim), (rows, slice(h.start * dv, h.stop * dv)),
             o.reshape(p.tokens, rep * dv))


def _expand(inp: dict, dk: int) -> tuple[torch.Tensor, ...]:
    """Key-head q, k [T, dk] and scalar decays [T, R] -> per value head [T, R, dk]."""
    rep = inp["rep"]
    return (inp["q"][:, None].expand(-1, rep, dk), inp["k"][:, None].expand(-1, rep, dk),
            inp["g"][..., None].expand(-1, rep, dk))


@op("GDN_CORE")
def gdn_core(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _inputs(ex, d)
    off, shape = state_views(ex, d, blk)["state"]
    idx = (d["B_IDX"], inp["heads"])
    state = ex.read("state", off, shape, idx, scratch=False)[None]  # [1, R, dk, dv]
    q, k, g = _expand(inp, blk.cfg.k_head_dim)
    ys = []
    for t in range(q.shape[0]):
        y, state = delta_rule_step(state, q[t][None], k[t][None], inp["v"][t][None],
                                   inp["beta"][t][None], g[t][None])
        ys.append(y[0])
    ex.write("state", off, shape, idx, state[0])
    _output(ex, d, blk, inp, torch.stack(ys, dim=0))


@op("GDN_REPLAY")
def gdn_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _inputs(ex, d)
    c, t_, b, kh = blk.cfg, ex.prog.tokens, d["B_IDX"], d["K_HEAD"]
    dk, rep, heads = c.k_head_dim, inp["rep"], inp["heads"]
    views = state_views(ex, d, blk)
    n = ring_count(ex, d, blk, kh)
    sel = {"k": kh, "u": heads, "g": heads}  # ring k per key head, u and g per value head

    def ring(name: str, rows: slice) -> torch.Tensor:
        off, shape = views[name]
        return ex.read("state", off, shape, (b, rows, sel[name]), scratch=False)

    old = {name: ring(name, slice(0, n)) for name in sel}
    full = {"k": old["k"][:, None].expand(-1, rep, dk), "u": old["u"],
            "g": old["g"][..., None].expand(-1, rep, dk)}
    st_off, st_shape = views["state"]
    state = ex.read("state", st_off, st_shape, (b, heads), scratch=False)  # [R, dk, dv]
    q, k, g = _expand(inp, dk)
    y, entries = delta_rule_replay(state, full, q, k, inp["v"], inp["beta"], g)
    new = {"k": inp["k"], "u": entries["u"], "g": inp["g"]}
    for name, val in new.items():
        off, shape = views[name]
        ex.write("state", off, shape, (b, slice(n, n + t_), sel[name]), val)
    if folds(ex, n):  # every committed entry folded into the state; the ring restarts
        all_ = {"k": torch.cat((full["k"], k)), "u": torch.cat((full["u"], entries["u"])),
                "g": torch.cat((full["g"], g))}
        ex.write("state", st_off, st_shape, (b, heads), delta_rule_fold(state, all_))
        set_ring_count(ex, d, kh, 0)
    else:
        set_ring_count(ex, d, kh, n + t_)
    _output(ex, d, blk, inp, y)
