"""Host emulation of the MoE router's device handlers (kernel/device/moe_router.py): a numpy walk of
ROUTER_SCORE's and ROUTER's loop nests, with the kernel's own index helpers and order rules
(kernel/host/moe_router_index.py), against the executor's math (F.linear of the bf16-rounded
RMSNorm, reference `route`, layers/moe.py `work_list`) on fresh random inputs: ties, group-limited
top-k (kimi-linear-tiny: 8 experts, top 3 of the best 2 of 4 groups), experts no row picks, B in {1,
4} x T in {1, 4}, a hidden size whose lanes end in a partial batch; the router also at the real
preset's 256 experts (8 registers a lane) and at 72 experts in 3 groups (a lane's last register
padding, groups across registers), up to 96 (row, pick) pairs (3 reads of 32 ids)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megakernel.kernel.host import moe_router_index as ix
from megakernel.layers.moe import MoEConfig, work_list
from megakernel.models import preset
from megakernel.reference.layers.moe import route

CFG = preset("kimi-linear-tiny").moe
EPS = 1e-6
HIDDEN = ix.LANES * ix.BATCH + 3 * ix.LANES + 5  # a full batch, then lanes of 3 or 4 slots
F32 = np.float32


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def _lane_sums(k: int, term) -> np.ndarray:  # noqa: ANN001 (columns -> fp32 terms)
    """Each lane's sum of term(c) over its columns c = lane + 32 j in increasing c, walked as
    s1 / s2 do: batches of BATCH slots, all loaded (`load_col`) before the adds, a slot past K
    adding nothing (lanes are the vector axis; numpy does not fuse the multiply-adds)."""
    lanes = np.arange(ix.LANES)
    acc = np.zeros(ix.LANES, F32)
    for b0 in range(0, k, ix.LANES * ix.BATCH):
        c0 = lanes + b0  # each lane's batch start (its loop runs while c0 < K)
        vals = [term(ix.load_col(ix.batch_col(c0, u), k, np.minimum)) for u in range(ix.BATCH)]
        for u in range(ix.BATCH):
            add = (c0 < k) & (ix.batch_col(c0, u) < k)
            acc = np.where(add, (acc + vals[u]).astype(F32), acc)
    return acc


def emulate_score(h: np.ndarray, norm_w: np.ndarray, wr: np.ndarray, e0: int, ne: int,
                  out: np.ndarray) -> None:
    """ROUTER_SCORE of experts [e0, e0 + ne): s1 (rstd per row), s2 (a warp per task, lanes
    over the columns in batches, a warp sum)."""
    n_rows, k = h.shape
    rstd = [F32(1.0) / np.sqrt(F32(_lane_sums(k, lambda c, n=n: h[n, c] * h[n, c]).sum(dtype=F32)
                                   / F32(k)) + F32(EPS))
            for n in range(n_rows)]
    for t in range(ne * n_rows):
        e, n = ix.score_task(t, n_rows)

        def term(c: np.ndarray, e: int = e, n: int = n) -> np.ndarray:
            x = _bf16((h[n, c] * rstd[n] * norm_w[c]).astype(F32))
            return (wr[e0 + e, c] * x).astype(F32)

        out[n, e0 + e] = _lane_sums(k, term).sum(dtype=F32)


def _warp_argmax(vals: list[tuple[float, int]]) -> tuple[float, int]:
    best = (-np.inf, ix.NO_EXPERT)
    for v, i in vals:
        if ix.better(v, i, *best):
            best = (v, i)
    return best


def _sigmoid(x: F32) -> F32:
    return F32(1.0) / (F32(1.0) + np.exp(-x, dtype=F32))


def _popc(b: int) -> int:
    return bin(b).count("1")


def emulate_route(e: MoEConfig, logits: np.ndarray, bias: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROUTER: r0-r3 per row (a warp each: lane l's registers j hold expert_at(l, j)'s choice
    and sigmoid, per-lane bests then warp argmaxes), r4 the work list (one warp: per-lane
    counts of expert_at(l, c), the ids 32 at a time, ballot slots). -> ids, weights, work."""
    n_rows, ne = logits.shape
    pg, nj, lanes = ne // e.n_group, ix.lane_experts(ne), range(ix.LANES)
    ids = np.zeros((n_rows, e.top_k), np.int64)
    wts = np.zeros((n_rows, e.top_k), F32)
    for n in range(n_rows):
        sg = np.zeros((ix.LANES, nj), F32)  # r0: padding sigmoid(0.0), choice -inf
        ch = np.full((ix.LANES, nj), -np.inf, F32)
        for lane in lanes:
            for j in range(nj):
                x = ix.expert_at(lane, j)
                if x < ne:
                    sg[lane, j] = _sigmoid(logits[n, x])
                    ch[lane, j] = F32(sg[lane, j] + bias[x])
        regs = [(lane, j, ix.expert_at(lane, j)) for lane in lanes for j in range(nj)]
        gs = [-np.inf] * ix.LANES
        for g in range(e.n_group):
            mine = [(lane, j, x) for lane, j, x in regs
                    if ix.holds_group(g, j, pg) and ix.group_of(x, pg) == g]
            v1, i1 = _warp_argmax([_warp_argmax([(ch[lane, j], x) for ll, j, x in mine
                                                 if ll == lane]) for lane in lanes])
            v2, _ = _warp_argmax([_warp_argmax([(ch[lane, j], x) for ll, j, x in mine
                                                if ll == lane and x != i1]) for lane in lanes])
            gs[g] = F32(v1 + v2)
        mask = 0
        for _ in range(e.topk_group):
            _, bg = _warp_argmax([(-np.inf if ix.kept(mask, lane) else gs[lane], lane)
                                  for lane in lanes])
            mask |= 1 << bg
        live = [sum(1 << j for j in range(nj) if ix.expert_at(lane, j) < ne
                    and ix.kept(mask, ix.group_of(min(ix.expert_at(lane, j), ne - 1), pg)))
                for lane in lanes]
        pv, pe, w = np.inf, -1, []
        for s in range(e.top_k):
            pv, pe = _warp_argmax([_warp_argmax(
                [(ch[lane, j], x) for ll, j, x in regs if ll == lane and (live[lane] >> j) & 1
                 and ix.after(ch[lane, j], x, pv, pe)]) for lane in lanes])
            ids[n, s] = pe
            holder = pe % ix.LANES  # the shuffle's source lane
            w.append(next((sg[holder, j] for j in range(nj)
                           if ix.expert_at(holder, j) == pe), F32(0.0)))
        total = F32(0.0)
        for v in w:
            total = F32(total + v)
        for s, v in enumerate(w):
            ws = F32(v / F32(total + F32(1e-20))) if e.norm_topk_prob else v
            wts[n, s] = F32(ws * F32(e.routed_scaling_factor))
    return ids, wts, _emulate_work_list(ids, ne, e.work_slots(n_rows))


def _emulate_work_list(ids: np.ndarray, ne: int, slots: int) -> np.ndarray:
    """r4 on one warp: lane l counts expert_at(l, c) in its register c over the ids read 32 at
    a time and broadcast one by one; ballot slots per c; a second pass writes the pairs."""
    n_rows, nj, lanes = ids.shape[0], ix.lane_experts(ne), range(ix.LANES)
    work = np.full(slots * (2 + n_rows), 7777, np.int64)  # poison: every word must be written
    flat = ids.reshape(-1)
    pairs = flat.size

    def walk(visit) -> None:  # noqa: ANN001 (lane, c, p)
        for p0 in range(0, pairs, ix.LANES):
            x = [int(flat[p0 + lane]) if p0 + lane < pairs else ix.NO_EXPERT for lane in lanes]
            for j in range(min(ix.LANES, pairs - p0)):
                for lane in lanes:
                    for c in range(nj):
                        if x[j] == ix.expert_at(lane, c):
                            visit(lane, c, p0 + j)

    m = np.zeros((ix.LANES, nj), np.int64)

    def count(lane: int, c: int, p: int) -> None:
        m[lane, c] += 1

    walk(count)
    at = np.zeros((ix.LANES, nj), np.int64)
    base = 0
    for c in range(nj):
        ballot = sum(1 << lane for lane in lanes if m[lane, c] > 0)
        for lane in lanes:
            at[lane, c] = w = ix.slot_of(base, ballot, lane, _popc)
            if m[lane, c] > 0:
                work[ix.work_at(w, 0, n_rows)] = ix.expert_at(lane, c)
                work[ix.work_at(w, 1, n_rows)] = m[lane, c]
                for r in range(m[lane, c], n_rows):
                    work[ix.work_at(w, 2 + r, n_rows)] = -1
        base += _popc(ballot)
        m[:, c] = 0

    def write(lane: int, c: int, p: int) -> None:
        work[ix.work_at(at[lane, c], 2 + m[lane, c], n_rows)] = p
        m[lane, c] += 1

    walk(write)
    for idx in range((slots - base) * (2 + n_rows)):
        row, c = divmod(idx, 2 + n_rows)
        work[ix.work_at(base + row, c, n_rows)] = 0 if c == 1 else -1
    return work.reshape(slots, 2 + n_rows)


def _inputs(rows: int, seed: int, ties: bool) -> tuple[np.ndarray, ...]:
    g = torch.Generator().manual_seed(seed)
    h, k, ne = rows, HIDDEN, CFG.num_experts
    hid = torch.randn(h, k, generator=g) * 2.0
    norm_w = (1.0 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).float()
    wr = torch.randn(ne, k, generator=g) * 0.2
    bias = torch.randn(ne, generator=g) * 0.05
    if ties:  # experts 1, 2 (group 0) and 5 (group 2) tie with expert 4 / 0 ...: equal rows
        wr[1], wr[5], bias[1], bias[5] = wr[4], wr[0], bias[4], bias[0]
        wr[7], bias[7] = wr[6], bias[6]  # a tied pair within one group
    return hid.numpy(), norm_w.numpy(), wr.numpy(), bias.numpy()


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (1, 4), (4, 1), (4, 4)])
def test_router_handlers_match_the_executor(batch: int, tokens: int, ties: bool) -> None:
    """Logits (scored in blocks of 3, 1 and 4 experts) within fp32 rounding of the executor's
    F.linear; then, from the same logits, the emulated ROUTER's ids and work list equal the
    reference route's and work_list's exactly, its weights within 1 ulp-ish; some experts go
    unpicked at B T <= 4, and with ties the lower expert ids win."""
    rows = batch * tokens
    hid, norm_w, wr, bias = _inputs(rows, seed=100 * batch + tokens + 7 * ties, ties=ties)
    got = np.full((rows, CFG.num_experts), np.nan, F32)
    for e0, ne in ((0, 3), (3, 1), (4, 4)):
        emulate_score(hid, norm_w, wr, e0, ne, got)
    x = torch.from_numpy(hid)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    want = F.linear((y * torch.from_numpy(norm_w)).to(torch.bfloat16).float(),
                    torch.from_numpy(wr))
    assert np.allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    if ties:  # tied experts score alike in the emulation (the executor's logits may not)
        assert (got[:, 1] == got[:, 4]).all() and (got[:, 7] == got[:, 6]).all()
    logits = torch.from_numpy(got)
    ids, wts, work = emulate_route(CFG, got, bias)
    w_ref, ids_ref = route(CFG, logits, torch.from_numpy(bias))
    assert np.array_equal(ids, ids_ref.numpy())
    assert np.allclose(wts, w_ref.numpy(), rtol=2e-6, atol=0)
    assert np.array_equal(work, work_list(ids_ref, CFG.num_experts).numpy())
    if rows <= 4:
        assert len(np.unique(ids)) < CFG.num_experts  # experts no row picks


def test_ties_go_to_the_lower_expert_and_group() -> None:
    """All logits and biases equal: every group ties (keep groups 0, 1), every expert ties
    (experts 0, 1, 2 in that order), equal weights; the work list has them in slots 0..2."""
    rows = 4
    logits = np.full((rows, CFG.num_experts), 0.3, F32)
    bias = np.full(CFG.num_experts, 0.01, F32)
    ids, wts, work = emulate_route(CFG, logits, bias)
    assert ids.tolist() == [[0, 1, 2]] * rows
    assert np.allclose(wts, CFG.routed_scaling_factor / 3, rtol=1e-6)
    assert work[:3, :2].tolist() == [[0, rows], [1, rows], [2, rows]]
    assert (work[3:, 0] == -1).all() and (work[3:, 1] == 0).all()


@pytest.mark.parametrize(("cfg", "rows"), [
    (preset("kimi-linear-48b-a3b").moe, 1), (preset("kimi-linear-48b-a3b").moe, 5),
    (dataclasses.replace(CFG, num_experts=72, n_group=3, topk_group=2, top_k=6), 3),
    (dataclasses.replace(CFG, num_experts=72, n_group=3, topk_group=2, top_k=6), 16)])
def test_router_register_mapping_on_other_shapes(cfg: MoEConfig, rows: int) -> None:
    """ROUTER on random logits with ties (equal pairs of experts, one pair across groups): ids
    and the work list equal the reference's, weights within rounding."""
    g = torch.Generator().manual_seed(cfg.num_experts + rows)
    logits = torch.randn(rows, cfg.num_experts, generator=g)
    bias = torch.randn(cfg.num_experts, generator=g) * 0.05
    for a, b in ((3, 40), (1, 2), (33, 65), (70, 71)):  # ties: same choice, same weight
        logits[:, b], bias[b] = logits[:, a], bias[a]
    ids, wts, work = emulate_route(cfg, logits.numpy(), bias.numpy())
    w_ref, ids_ref = route(cfg, logits, bias)
    assert np.array_equal(ids, ids_ref.numpy())
    assert np.allclose(wts, w_ref.numpy(), rtol=2e-6, atol=0)
    assert np.array_equal(work, work_list(ids_ref, cfg.num_experts).numpy())
