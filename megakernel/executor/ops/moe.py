"""ROUTER_SCORE, ROUTER, EXPERT_GATEUP, EXPERT_DOWN and MOE_COMBINE (layers/moe.py); the routing
is the reference's (reference/layers/moe.py). An expert record is bound at run time to its work
slot's expert: an unbound slot reads no weights (the executor's `slab_bytes` counts what is
read)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakernel import isa
from megakernel.executor.core import Executor, op
from megakernel.layers.moe import SHARED, MoEConfig, work_list
from megakernel.reference.layers.moe import route


@op("ROUTER_SCORE")
def router_score(ex: Executor, d: dict, epoch: int) -> None:
    e = ex.block(d, "moe").cfg
    n, hid, ne = ex.prog.rows, d["K"], e.num_experts
    x = ex.norm_input(d)  # [N, H] bf16-rounded
    ro = d["ROUTER_OFF"]
    wr = ex.f32[ro : ro + ne * hid].view(ne, hid)
    # the reference's rounding: one fp32 product over all experts (a product over fewer router
    # rows rounds differently on the CPU), of which the record writes its experts' columns
    cols = slice(d["E0"], d["E0"] + d["NE"])
    ex.write("f32", d["OUT_OFF"], (n, ne), (slice(None), cols), F.linear(x, wr)[:, cols])


@op("ROUTER")
def router(ex: Executor, d: dict, epoch: int) -> None:
    e = ex.block(d, "moe").cfg
    n, ne = ex.prog.rows, e.num_experts
    logits = ex.read("f32", d["SCORES_OFF"], (n, ne))
    bias = ex.f32[d["BIAS_OFF"] : d["BIAS_OFF"] + ne]
    wts, ids = route(e, logits, bias)
    ex.write("i32", d["IDS_OFF"], (n, e.top_k), slice(None), ids.to(torch.int32))
    ex.write("f32", d["WTS_OFF"], (n, e.top_k), slice(None), wts)
    ex.write("i32", d["WORK_OFF"], (d["SLOTS"], 2 + n), slice(None), work_list(ids, ne))


def _bound(ex: Executor, d: dict, e: MoEConfig) -> tuple[dict, list[tuple[int, int]]]:
    """The record bound to its slot's expert (W moved to that expert's slab) and the (row,
    top-k slot) pairs routed to it; no pairs for a slot past the routed experts."""
    n = ex.prog.rows
    if d["SLOT"] == SHARED:
        return d, [(t, e.top_k) for t in range(n)]
    row = ex.read("i32", d["WORK_OFF"], (e.work_slots(n), 2 + n), d["SLOT"])
    x, m = int(row[0]), int(row[1])
    if x < 0:
        return d, []
    stride = ex.prog.header["MOE_X_STRIDE"]
    return {**d, "W": d["W"] + x * stride}, [divmod(p, e.top_k) for p in row[2 : 2 + m].tolist()]


@op("EXPERT_GATEUP")
def expert_gateup(ex: Executor, d: dict, epoch: int) -> None:
    e, n = ex.block(d, "moe").cfg, ex.prog.rows
    d, pairs = _bound(ex, d, e)
    if not pairs:  # an unbound slot: nothing to stream
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
    d, pairs = _bound(ex, d, e)
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
