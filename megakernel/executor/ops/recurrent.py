"""The recurrent cores: GDN_CORE / GDN_REPLAY (layers/gdn.py), KDA_CORE / KDA_REPLAY
(layers/kda.py), MAMBA_CORE / MAMBA_REPLAY (layers/mamba2.py), and what they share: the record's
block of the state arena, the short causal conv over the fp32 window, the ring bookkeeping of
ReplaySSM. The delta-rule, SSD and norm math is the reference's (reference/layers/)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megakernel import isa
from megakernel.executor.core import Executor, ExecutorError, op
from megakernel.layers import kind
from megakernel.reference.layers.common import l2norm, rms_norm, shift_window, short_conv, softplus
from megakernel.reference.layers.gdn import delta_rule_step
from megakernel.reference.layers.mamba2 import ssd_step
from megakernel.reference.layers.replay import (
    delta_rule_fold,
    delta_rule_replay,
    ssd_fold,
    ssd_replay,
)


def state_views(ex: Executor, d: dict, blk) -> dict[str, tuple[int, tuple[int, ...]]]:  # noqa: ANN001
    """name -> (offset, shape) of the layer's state block, from the record's 64-bit STATE and the
    kind's layout (conv window, state, ring entries)."""
    p, off, out = ex.prog, d["STATE"], {}
    for name, shape in kind(blk.kind).state(blk, ex.cfg, p.batch, p.buffers.ring_cap,
                                            p.tokens if p.drafts else 0):
        out[name] = (off, shape)
        off += math.prod(shape)
    return out


def conv(ex: Executor, d: dict, blk, col0: int, segs: list[slice], taps: torch.Tensor,  # noqa: ANN001
         bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    """silu(causal conv) of the T new inputs of sequence B_IDX on conv channels `segs`; channel c
    is proj column col0 + c. The window is read and shifted (written) once per channel; in a
    speculative step it is left alone and the T inputs go to `pending` (COMMIT shifts it)."""
    p = ex.prog
    kd = kind(blk.kind)
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    views = state_views(ex, d, blk)
    win_off, win_shape = views["conv"]
    width = kd.proj_width(blk.cfg)
    out = []
    for sg in segs:
        x = ex.read("f32", d["PROJ_OFF"], (p.rows, width), (rows, slice(col0 + sg.start,
                                                                        col0 + sg.stop)))
        win = ex.read("state", win_off, win_shape, (d["B_IDX"], sg), scratch=False)  # [c, K-1]
        pre = short_conv(win[None], x[None], taps[sg][:, None, :],
                         None if bias is None else bias[sg])[0]  # [T, c]
        if p.drafts:
            ex.write("state", *views["pending"], (d["B_IDX"], sg), x.T)
        else:
            ex.write("state", win_off, win_shape, (d["B_IDX"], sg),
                     shift_window(win[None], x[None])[0])
        out.append(torch.nn.functional.silu(pre))
    return out


def proj_cols(ex: Executor, d: dict, blk, c0: int, width: int) -> torch.Tensor:  # noqa: ANN001
    """proj[rows of sequence B_IDX, c0 : c0 + width] (the block's own projection width)."""
    p = ex.prog
    rows = slice(d["B_IDX"] * p.tokens, (d["B_IDX"] + 1) * p.tokens)
    return ex.read("f32", d["PROJ_OFF"], (p.rows, kind(blk.kind).proj_width(blk.cfg)),
                   (rows, slice(c0, c0 + width)))


def recurrent_steps(ex: Executor, d: dict, blk, heads: slice,  # noqa: ANN001
                    step: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
                    ) -> torch.Tensor:
    """The recurrent core of one record: the state of (B_IDX, heads) is read once, advanced by
    `step(state [1, ...], t) -> (y [1, ...], state)` for each of the T tokens and stored once;
    returns y [T, ...]."""
    off, shape = state_views(ex, d, blk)["state"]
    idx = (d["B_IDX"], heads)
    state = ex.read("state", off, shape, idx, scratch=False)[None]
    ys = []
    for t in range(ex.prog.tokens):
        y, state = step(state, t)
        ys.append(y[0])
    ex.write("state", off, shape, idx, state[0])
    return torch.stack(ys, dim=0)


class Ring:
    """The ReplaySSM bookkeeping of one record: the n committed ring entries of (B_IDX, unit),
    `sel[name]` indexing each ring tensor's unit axis, and the committed state of `heads`."""

    def __init__(self, ex: Executor, d: dict, blk, unit: int,  # noqa: ANN001
                 sel: dict[str, int | slice], heads: slice) -> None:
        self.ex, self.d, self.unit, self.sel, self.heads = ex, d, unit, sel, heads
        self.views = state_views(ex, d, blk)
        p, self.b = ex.prog, d["B_IDX"]
        self.count_shape = p.buffers.i32["ring_count"].shape[1:]
        self.n = int(ex.read("i32", d["COUNT_OFF"], self.count_shape, (self.b, unit),
                             scratch=False))
        if self.n + p.tokens > p.buffers.ring_cap:
            raise ExecutorError(f"{ex.cur_desc}: ring overflow, {self.n} + {p.tokens} entries > "
                                f"{p.buffers.ring_cap}")

    def _at(self, name: str, rows: slice | None = None) -> tuple:
        off, shape = self.views[name]
        idx = (self.b, self.heads) if rows is None else (self.b, rows, self.sel[name])
        return off, shape, idx

    def entries(self) -> dict[str, torch.Tensor]:
        """The committed entries: name -> [n, ...]."""
        return {name: self.ex.read("state", *self._at(name, slice(0, self.n)), scratch=False)
                for name in self.sel}

    def state(self) -> torch.Tensor:
        return self.ex.read("state", *self._at("state"), scratch=False)

    def commit(self, new: dict[str, torch.Tensor], fold: Callable[[], torch.Tensor]) -> None:
        """Append the T new entries; when n + T >= L (header REPLAY_WINDOW) store the state
        `fold()` (every entry folded in) and restart the ring, else count n + T. A speculative
        step only appends: its COMMIT record keeps the accepted entries."""
        ex = self.ex
        t_ = ex.prog.tokens
        for name, val in new.items():
            ex.write("state", *self._at(name, slice(self.n, self.n + t_)), val)
        if not ex.prog.drafts:
            self.keep(t_, fold)

    def keep(self, m: int, fold: Callable[[], torch.Tensor]) -> None:
        """Count n + m entries committed; at n + m >= L store `fold()` and count 0."""
        ex = self.ex
        count = self.n + m
        if count >= ex.prog.header["REPLAY_WINDOW"]:
            ex.write("state", *self._at("state"), fold())
            count = 0
        ex.write("i32", self.d["COUNT_OFF"], self.count_shape,
                 (self.b, slice(self.unit, self.unit + 1)),
                 torch.tensor([count], dtype=torch.int32))


# ---- GDN_CORE, GDN_REPLAY (layers/gdn.py): one (sequence, key head) each -------------------------
def _gdn_inputs(ex: Executor, d: dict):  # noqa: ANN202
    blk = ex.block(d, "gdn")
    c = blk.cfg
    hv, dk, dv = c.num_v_heads, c.k_head_dim, c.v_head_dim
    kh, rep = d["K_HEAD"], hv // c.num_k_heads
    h0 = kh * rep
    taps = ex.weights[d["CONV_W"] : d["CONV_W"] + c.conv_dim * c.conv_kernel].view(
        c.conv_dim, c.conv_kernel).float()
    q, k, v = conv(ex, d, blk, 0, kind("gdn").unit_segments(c, kh), taps)
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
    q, k, g = _gdn_expand(inp, blk.cfg.k_head_dim)
    y = recurrent_steps(ex, d, blk, inp["heads"], lambda s, t: delta_rule_step(
        s, q[t][None], k[t][None], inp["v"][t][None], inp["beta"][t][None], g[t][None]))
    _gdn_output(ex, d, blk, inp, y)


@op("GDN_REPLAY")
def gdn_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _gdn_inputs(ex, d)
    dk, rep, kh = blk.cfg.k_head_dim, inp["rep"], d["K_HEAD"]
    # ring k per key head, u and g per value head
    ring = Ring(ex, d, blk, kh, {"k": kh, "u": inp["heads"], "g": inp["heads"]}, inp["heads"])
    old = ring.entries()
    full = {"k": old["k"][:, None].expand(-1, rep, dk), "u": old["u"],
            "g": old["g"][..., None].expand(-1, rep, dk)}
    state = ring.state()  # [R, dk, dv]
    q, k, g = _gdn_expand(inp, dk)
    y, entries = delta_rule_replay(state, full, q, k, inp["v"], inp["beta"], g)
    ring.commit({"k": inp["k"], "u": entries["u"], "g": inp["g"]}, lambda: delta_rule_fold(
        state, {"k": torch.cat((full["k"], k)), "u": torch.cat((full["u"], entries["u"])),
                "g": torch.cat((full["g"], g))}))
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
    q, k, v = conv(ex, d, blk, 0, kind("kda").unit_segments(c, h), taps)
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
    y = recurrent_steps(ex, d, blk, inp["heads"], lambda s, t: delta_rule_step(
        s, inp["q"][t][None, None], inp["k"][t][None, None], inp["v"][t][None],
        inp["beta"][t][None], inp["g"][t][None]))
    _kda_output(ex, d, blk, inp, y)


@op("KDA_REPLAY")
def kda_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _kda_inputs(ex, d)
    heads = inp["heads"]
    ring = Ring(ex, d, blk, d["HEAD"], {"k": heads, "u": heads, "g": heads}, heads)
    old, state = ring.entries(), ring.state()  # state [1, d, d]
    y, entries = delta_rule_replay(state, old, inp["q"][:, None], inp["k"][:, None], inp["v"],
                                   inp["beta"], inp["g"])
    ring.commit(entries, lambda: delta_rule_fold(
        state, {name: torch.cat((old[name], entries[name])) for name in old}))
    _kda_output(ex, d, blk, inp, y)


# ---- MAMBA_CORE, MAMBA_REPLAY (layers/mamba2.py): one (sequence, group) each ---------------------
def _mamba_inputs(ex: Executor, d: dict):  # noqa: ANN202
    blk = ex.block(d, "mamba2")
    m = blk.cfg
    hh, hp, ng, kw = m.num_heads, m.head_dim, m.n_groups, m.conv_kernel
    rep, di, cd, j = hh // ng, m.d_inner, m.conv_dim, d["GROUP"]
    h0 = j * rep
    taps = ex.weights[d["CONV_W"] : d["CONV_W"] + cd * kw].view(cd, kw).float()
    bias = ex.weights[d["CONV_W"] + cd * kw : d["CONV_W"] + cd * (kw + 1)].float()
    x, bb, cc = conv(ex, d, blk, di, kind("mamba2").unit_segments(m, j), taps, bias)
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

    def step(state: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        b_t, c_t = inp["B"][t].expand(rep, -1), inp["C"][t].expand(rep, -1)  # [R, N]
        return ssd_step(state, inp["x"][t][None], b_t[None], c_t[None], inp["dt"][t][None],
                        inp["a"], inp["D"])

    _mamba_output(ex, d, blk, inp, recurrent_steps(ex, d, blk, inp["heads"], step))


@op("MAMBA_REPLAY")
def mamba_replay(ex: Executor, d: dict, epoch: int) -> None:
    blk, inp = _mamba_inputs(ex, d)
    rep, j, heads, ns = inp["rep"], d["GROUP"], inp["heads"], blk.cfg.state_size
    ring = Ring(ex, d, blk, j, {"x": heads, "B": j, "dt": heads}, heads)  # B per group
    old = ring.entries()
    old["B"] = old["B"][:, None, :].expand(-1, rep, ns)
    b_new = inp["B"][:, None, :].expand(-1, rep, ns)
    c_new = inp["C"][:, None, :].expand(-1, rep, ns)
    state = ring.state()  # [R, P, N]
    y, _ = ssd_replay(state, old, inp["x"], b_new, c_new, inp["dt"], inp["a"], inp["D"])
    ring.commit({"x": inp["x"], "B": inp["B"], "dt": inp["dt"]}, lambda: ssd_fold(
        state, {"x": torch.cat((old["x"], inp["x"])), "B": torch.cat((old["B"], b_new)),
                "dt": torch.cat((old["dt"], inp["dt"]))}, inp["a"]))
    _mamba_output(ex, d, blk, inp, y)


# ---- GDN_COMMIT, KDA_COMMIT, MAMBA_COMMIT (layers/recurrent.py): after ACCEPT -------------------
def _unit_ring(ex: Executor, d: dict, blk  # noqa: ANN001
               ) -> tuple[Ring, Callable[[dict], torch.Tensor]]:
    """The ring of the record's (sequence, unit) and the kind's fold of entries [0, m) read as
    {name: [m, ...]} into its committed state."""
    c, name = blk.cfg, blk.kind
    unit = d[kind(name).unit_name]
    if name == "gdn":
        rep, dk = c.num_v_heads // c.num_k_heads, c.k_head_dim
        heads = slice(unit * rep, (unit + 1) * rep)
        ring = Ring(ex, d, blk, unit, {"k": unit, "u": heads, "g": heads}, heads)

        def fold(e: dict) -> torch.Tensor:
            return delta_rule_fold(ring.state(), {
                "k": e["k"][:, None].expand(-1, rep, dk), "u": e["u"],
                "g": e["g"][..., None].expand(-1, rep, dk)})
    elif name == "kda":
        heads = slice(unit, unit + 1)
        ring = Ring(ex, d, blk, unit, {"k": heads, "u": heads, "g": heads}, heads)

        def fold(e: dict) -> torch.Tensor:
            return delta_rule_fold(ring.state(), e)
    else:  # mamba2: per group
        rep = c.num_heads // c.n_groups
        heads = slice(unit * rep, (unit + 1) * rep)
        ring = Ring(ex, d, blk, unit, {"x": heads, "B": unit, "dt": heads}, heads)
        a = -ex.f32[d["PARAM_OFF"] : d["PARAM_OFF"] + c.num_heads][heads].exp()

        def fold(e: dict) -> torch.Tensor:
            b = e["B"][:, None, :].expand(-1, rep, c.state_size)
            return ssd_fold(ring.state(), {"x": e["x"], "B": b, "dt": e["dt"]}, a)
    return ring, fold


@op("GDN_COMMIT")
@op("KDA_COMMIT")
@op("MAMBA_COMMIT")
def commit(ex: Executor, d: dict, epoch: int) -> None:
    """Keep emitted[b] of the step's proposed entries: the window shifted by them, the count
    advanced, the state folded when the window L is reached (reference commit_layer)."""
    p = ex.prog
    blk = ex.block(d, isa.spec(d["OPCODE"]).kind)
    kd, bi = kind(blk.kind), d["B_IDX"]
    keep = int(ex.read("i32", d["EMIT_OFF"], (p.batch,), slice(bi, bi + 1), scratch=False))
    views = state_views(ex, d, blk)
    for sg in kd.unit_segments(blk.cfg, d[kd.unit_name]):
        win = ex.read("state", *views["conv"], (bi, sg), scratch=False)  # [c, K-1]
        pend = ex.read("state", *views["pending"], (bi, sg), scratch=False)  # [c, T]
        ex.write("state", *views["conv"], (bi, sg),
                 shift_window(win[None], pend[:, :keep].T[None])[0])
    ring, fold = _unit_ring(ex, d, blk)
    m = ring.n + keep
    ring.keep(keep, lambda: fold({name: ex.read("state", *ring._at(name, slice(0, m)),
                                                scratch=False) for name in ring.sel}))
