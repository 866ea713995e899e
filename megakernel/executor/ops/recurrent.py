"""The recurrent cores: GDN_CORE / GDN_REPLAY (layers/gdn.py), KDA_CORE / KDA_REPLAY
(layers/kda.py), MAMBA_CORE / MAMBA_REPLAY (layers/mamba2.py), and what they share: the record's
block of the state arena, the short causal conv over the fp32 window, the ring bookkeeping of
ReplaySSM. The delta-rule, SSD and norm math is the reference's (reference/layers/)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megakernel.executor.core import Executor, ExecutorError, op
from megakernel.layers import kind
from reference.layers.common import l2norm, rms_norm, shift_window, short_conv, softplus
from reference.layers.gdn import delta_rule_step
from reference.layers.mamba2 import ssd_step
from reference.layers.replay import delta_rule_fold, delta_rule_replay, ssd_fold, ssd_replay


def state_views(ex: Executor, d: dict, blk) -> dict[str, tuple[int, tuple[int, ...]]]:  # noqa: ANN001
    """name -> (offset, shape) of the layer's state block, from the record's 64-bit STATE and the
    kind's layout (conv window, state, ring entries)."""
    p, off, out = ex.prog, d["STATE"], {}
    for name, shape in kind(blk.kind).state(blk, ex.cfg, p.batch, p.buffers.ring_cap):
        out[name] = (off, shape)
        off += math.prod(shape)
    return out


def conv(ex: Executor, d: dict, blk, col0: int, segs: list[slice], taps: torch.Tensor,  # noqa: ANN001
         bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    """silu(causal conv) of the T new inputs of sequence B_IDX on conv channels `segs`; channel c
    is proj column col0 + c. The window is read and shifted (written) once per channel."""
    p = ex.prog
    kd = kind(blk.kind)
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    win_off, win_shape = state_views(ex, d, blk)["conv"]
    width = kd.proj_width(blk.cfg)
    out = []
    for sg in segs:
        x = ex.read("f32", d["PROJ_OFF"], (p.rows, width), (rows, slice(col0 + sg.start,
                                                                        col0 + sg.stop)))
        win = ex.read("state", win_off, win_shape, (d["B_IDX"], sg), scratch=False)  # [c, K-1]
        pre = short_conv(win[None], x[None], taps[sg][:, None, :],
                         None if bias is None else bias[sg])[0]  # [T, c]
        ex.write("state", win_off, win_shape, (d["B_IDX"], sg), shift_window(win[None], x[None])[0])
        out.append(torch.nn.functional.silu(pre))
    return out


def proj_cols(ex: Executor, d: dict, blk, c0: int, width: int) -> torch.Tensor:  # noqa: ANN001
    """proj[rows of sequence B_IDX, c0 : c0 + width] (the block's own projection width)."""
    p = ex.prog
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    return ex.read("f32", d["PROJ_OFF"], (p.rows, kind(blk.kind).proj_width(blk.cfg)),
                   (rows, slice(c0, c0 + width)))


def ring_count(ex: Executor, d: dict, blk, unit: int) -> int:  # noqa: ANN001
    """Committed ring entries of (B_IDX, unit); ExecutorError when T more do not fit."""
    p = ex.prog
    shape = ex.prog.buffers.i32["ring_count"].shape[1:]
    n = int(ex.read("i32", d["COUNT_OFF"], shape, (d["B_IDX"], unit), scratch=False))
    if n + p.tokens > p.buffers.ring_cap:
        raise ExecutorError(f"{ex.cur_desc}: ring overflow, {n} + {p.tokens} entries > "
                            f"{p.buffers.ring_cap}")
    return n


def set_ring_count(ex: Executor, d: dict, unit: int, value: int) -> None:
    shape = ex.prog.buffers.i32["ring_count"].shape[1:]
    ex.write("i32", d["COUNT_OFF"], shape, (d["B_IDX"], slice(unit, unit + 1)),
             torch.tensor([value], dtype=torch.int32))


def folds(ex: Executor, n: int) -> bool:
    """Whether a step that starts with n committed entries folds the ring (n + T >= L)."""
    return n + ex.prog.tokens >= ex.prog.header["REPLAY_WINDOW"]


# ---- GDN_CORE, GDN_REPLAY (layers/gdn.py): one (sequence, key head) each -------------------------
def _gdn_inputs(ex: Executor, d: dict):  # noqa: ANN202
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


def _gdn_output(ex: Executor, d: dict, blk, inp: dict, y: torch.Tensor) -> None:  # noqa: ANN001
    """bf16(RMSNorm(y) * w * silu(z)) per value head -> ssm_out; y [T, R, dv]."""
    c, p = blk.cfg, ex.prog
    dv, rep, h = c.v_head_dim, inp["rep"], inp["heads"]
    nw = ex.weights[d["NORM_W"] : d["NORM_W"] + dv]
    o = rms_norm(y, nw, ex.eps) * torch.nn.functional.silu(inp["z"].reshape(p.tokens, rep, dv))
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    ex.write("bf16", d["OUT_OFF"], (p.rows, c.value_dim), (rows, slice(h.start * dv, h.stop * dv)),
             o.reshape(p.tokens, rep * dv))


def _gdn_expand(inp: dict, dk: int) -> tuple[torch.Tensor, ...]:
    """Key-head q, k [T, dk] and scalar decays [T, R] -> per value head [T, R, dk]."""
    rep = inp["rep"]
    return (inp["q"][:, None].expand(-1, rep, dk), inp["k"][:, None].expand(-1, rep, dk),
            inp["g"][..., None].expand(-1, rep, dk))


@op("GDN_CORE")
def gdn_core(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _gdn_inputs(ex, d)
    off, shape = state_views(ex, d, blk)["state"]
    idx = (d["B_IDX"], inp["heads"])
    state = ex.read("state", off, shape, idx, scratch=False)[None]  # [1, R, dk, dv]
    q, k, g = _gdn_expand(inp, blk.cfg.k_head_dim)
    ys = []
    for t in range(q.shape[0]):
        y, state = delta_rule_step(state, q[t][None], k[t][None], inp["v"][t][None],
                                   inp["beta"][t][None], g[t][None])
        ys.append(y[0])
    ex.write("state", off, shape, idx, state[0])
    _gdn_output(ex, d, blk, inp, torch.stack(ys, dim=0))


@op("GDN_REPLAY")
def gdn_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _gdn_inputs(ex, d)
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
    q, k, g = _gdn_expand(inp, dk)
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
    _gdn_output(ex, d, blk, inp, y)


# ---- KDA_CORE, KDA_REPLAY (layers/kda.py): one (sequence, head) each -----------------------------
def _kda_inputs(ex: Executor, d: dict):  # noqa: ANN202
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


def _kda_output(ex: Executor, d: dict, blk, inp: dict, y: torch.Tensor) -> None:  # noqa: ANN001
    """bf16(RMSNorm(o) * w * sigmoid(gate)) -> ssm_out; y [T, 1, d]."""
    c, p, h = blk.cfg, ex.prog, d["HEAD"]
    dd = c.head_dim
    o = rms_norm(y[:, 0], ex.weights[d["NORM_W"] : d["NORM_W"] + dd], ex.eps)
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    ex.write("bf16", d["OUT_OFF"], (p.rows, c.qkv_dim), (rows, slice(h * dd, (h + 1) * dd)),
             o * torch.sigmoid(inp["gate"]))


@op("KDA_CORE")
def kda_core(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _kda_inputs(ex, d)
    off, shape = state_views(ex, d, blk)["state"]
    idx = (d["B_IDX"], inp["heads"])
    state = ex.read("state", off, shape, idx, scratch=False)[None]  # [1, 1, d, d]
    ys = []
    for t in range(inp["q"].shape[0]):
        y, state = delta_rule_step(state, inp["q"][t][None, None], inp["k"][t][None, None],
                                   inp["v"][t][None], inp["beta"][t][None], inp["g"][t][None])
        ys.append(y[0])
    ex.write("state", off, shape, idx, state[0])
    _kda_output(ex, d, blk, inp, torch.stack(ys, dim=0))


@op("KDA_REPLAY")
def kda_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _kda_inputs(ex, d)
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
    _kda_output(ex, d, blk, inp, y)


# ---- MAMBA_CORE, MAMBA_REPLAY (layers/mamba2.py): one (sequence, group) each ---------------------
def _mamba_inputs(ex: Executor, d: dict):  # noqa: ANN202
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


def _mamba_output(ex: Executor, d: dict, blk, inp: dict, y: torch.Tensor) -> None:  # noqa: ANN001
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
    blk, inp = _mamba_inputs(ex, d)
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
    _mamba_output(ex, d, blk, inp, torch.stack(ys, dim=0))


@op("MAMBA_REPLAY")
def mamba_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _mamba_inputs(ex, d)
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
    _mamba_output(ex, d, blk, inp, y)
