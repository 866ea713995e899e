"""ROUTER, EXPERT_GATEUP, EXPERT_DOWN and MOE_COMBINE (layers/moe.py); the routing is the
reference's (reference/layers/moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel import isa
from megakernel.executor.core import Executor, op
from megakernel.reference.layers.moe import route


@op("ROUTER")
def router(ex: Executor, d: dict, epoch: int) -> None:
    e = ex.block(d, "moe").cfg
    n, hid, ne = ex.prog.rows, d["K"], e.num_experts
    x = ex.norm_input(d)  # [N, H] bf16-rounded
    ro = d["ROUTER_OFF"]
    wr = ex.f32[ro : ro + ne * hid].view(ne, hid)
    bias = ex.f32[ro + ne * hid : ro + ne * hid + ne]
    wts, ids = route(e, F.linear(x, wr), bias)
    ex.write("i32", d["IDS_OFF"], (n, e.top_k), slice(None), ids.to(torch.int32))
    ex.write("f32", d["WTS_OFF"], (n, e.top_k), slice(None), wts)


def _routed(ex: Executor, d: dict, e) -> list[tuple[int, int]]:  # noqa: ANN001
    """(token, slot) pairs routed to the record's expert (the shared one: every token)."""
    n = ex.prog.rows
    if d["EXPERT"] == e.num_experts:
        return [(i, e.top_k) for i in range(n)]
    ids = ex.read("i32", d["IDS_OFF"], (n, e.top_k))
    return [tuple(x) for x in (ids == d["EXPERT"]).nonzero().tolist()]


@op("EXPERT_GATEUP")
def expert_gateup(ex: Executor, d: dict, epoch: int) -> None:
    e, n = ex.block(d, "moe").cfg, ex.prog.rows
    pairs = _routed(ex, d, e)
    if not pairs:  # no token picked this expert: nothing to stream
        return
    x = ex.norm_input(d)[[t for t, _ in pairs]]  # [m, H]
    blk = F.linear(x, ex.slab(d).float()).view(len(pairs), -1, 2, isa.GATEUP_BLOCK)
    act = (F.silu(blk[:, :, 0]) * blk[:, :, 1]).reshape(len(pairs), -1)
    c0 = d["ROW0"] // 2
    shape = (n, e.slots, e.intermediate_size)
    for i, (t, s) in enumerate(pairs):
        ex.write("bf16", d["OUT_OFF"], shape, (t, s, slice(c0, c0 + d["NROWS"] // 2)), act[i])


@op("EXPERT_DOWN")
def expert_down(ex: Executor, d: dict, epoch: int) -> None:
    e, n, hid = ex.block(d, "moe").cfg, ex.prog.rows, ex.cfg.hidden_size
    pairs = _routed(ex, d, e)
    if not pairs:
        return
    x = torch.stack([ex.read("bf16", d["IN_OFF"], (n, e.slots, d["K"]), (t, s))
                     for t, s in pairs]).float()  # [m, I_e]
    y = F.linear(x, ex.slab(d).float())
    r0 = d["ROW0"]
    for i, (t, s) in enumerate(pairs):
        ex.write("f32", d["OUT_OFF"], (n, e.slots, hid), (t, s, slice(r0, r0 + d["NROWS"])), y[i])


@op("MOE_COMBINE")
def moe_combine(ex: Executor, d: dict, epoch: int) -> None:
    e, n, hid = ex.block(d, "moe").cfg, ex.prog.rows, ex.cfg.hidden_size
    cols = slice(d["ROW0"], d["ROW0"] + d["NROWS"])
    ids = ex.read("i32", d["IDS_OFF"], (n, e.top_k))
    wts = ex.read("f32", d["WTS_OFF"], (n, e.top_k))
    for t in range(n):
        out = torch.zeros(d["NROWS"])
        for s in sorted(range(e.top_k), key=lambda j: int(ids[t, j])):  # ascending expert
            out = out + ex.read("f32", d["Y_OFF"], (n, e.slots, hid), (t, s, cols)) * wts[t, s]
        if e.num_shared_experts:
            out = out + ex.read("f32", d["Y_OFF"], (n, e.slots, hid), (t, e.top_k, cols))
        cur = ex.read("f32", d["OUT_OFF"], (n, hid), (t, cols))
        ex.write("f32", d["OUT_OFF"], (n, hid), (t, cols), cur + out)
