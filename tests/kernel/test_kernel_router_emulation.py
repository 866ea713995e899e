"""Host emulation of the MoE router's device handlers (kernel/moe_router.py): a numpy walk of
ROUTER_SCORE's and ROUTER's loop nests, with the kernel's own index helpers and order rules
(kernel/moe_router_index.py), against the executor's math (F.linear of the bf16-rounded RMSNorm,
reference `route`, layers/moe.py `work_list`) on fresh random inputs: ties, group-limited top-k
(kimi-linear-tiny: 8 experts, top 3 of the best 2 of 4 groups), experts no row picks,
B in {1, 4} x T in {1, 4}."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megakernel.kernel import moe_router_index as ix
from megakernel.layers.moe import MoEConfig, work_list
from megakernel.models import preset
from megakernel.reference.layers.moe import route

CFG = preset("kimi-linear-tiny").moe
EPS = 1e-6
F32 = np.float32


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).float().numpy()


def emulate_score(h: np.ndarray, norm_w: np.ndarray, wr: np.ndarray, e0: int, ne: int,
                  out: np.ndarray) -> None:
    """ROUTER_SCORE of experts [e0, e0 + ne): s1 (rstd per row), s2 (a warp per task, lanes
    over the columns, a warp sum)."""
    n_rows, k = h.shape
    rstd = [F32(1.0) / np.sqrt(F32((h[n] * h[n]).sum(dtype=F32) / F32(k)) + F32(EPS))
            for n in range(n_rows)]
    for t in range(ne * n_rows):
        e, n = ix.score_task(t, n_rows)
        lanes = np.zeros(ix.LANES, F32)
        for lane in range(ix.LANES):
            c = np.arange(lane, k, ix.LANES)
            x = _bf16((h[n, c] * rstd[n] * norm_w[c]).astype(F32))
            lanes[lane] = (wr[e0 + e, c] * x).sum(dtype=F32)
        out[n, e0 + e] = lanes.sum(dtype=F32)


def _warp_argmax(vals: list[tuple[float, int]]) -> tuple[float, int]:
    best = (-np.inf, ix.NO_EXPERT)
    for v, i in vals:
        if ix.better(v, i, *best):
            best = (v, i)
    return best


def _sigmoid(x: F32) -> F32:
    return F32(1.0) / (F32(1.0) + np.exp(-x, dtype=F32))


def emulate_route(e: MoEConfig, logits: np.ndarray, bias: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROUTER: r1-r3 per row (a warp each: lanes walk the experts, warp argmaxes), r4 the work
    list (one warp, chunks of 32 experts, ballot slots). -> ids, weights, work list."""
    n_rows, ne = logits.shape
    pg = ne // e.n_group
    ids = np.zeros((n_rows, e.top_k), np.int64)
    wts = np.zeros((n_rows, e.top_k), F32)

    def choice(n: int, x: int) -> F32:
        return F32(_sigmoid(logits[n, x]) + bias[x])

    for n in range(n_rows):
        gs = [-np.inf] * ix.LANES
        for g in range(e.n_group):
            v1, i1 = _warp_argmax([(choice(n, g * pg + j), g * pg + j)
                                   for lane in range(ix.LANES) for j in range(lane, pg, ix.LANES)])
            v2, _ = _warp_argmax([(choice(n, g * pg + j), g * pg + j)
                                  for lane in range(ix.LANES) for j in range(lane, pg, ix.LANES)
                                  if g * pg + j != i1])
            gs[g] = F32(v1 + v2)
        mask = 0
        for _ in range(e.topk_group):
            _, bg = _warp_argmax([(-np.inf if ix.kept(mask, lane) else gs[lane], lane)
                                  for lane in range(ix.LANES)])
            mask |= 1 << bg
        pv, pe, w = np.inf, -1, []
        for s in range(e.top_k):
            cands = [(choice(n, x), x) for lane in range(ix.LANES)
                     for x in range(lane, ne, ix.LANES) if ix.kept(mask, ix.group_of(x, pg))]
            pv, pe = _warp_argmax([(v, x) for v, x in cands if ix.after(v, x, pv, pe)])
            ids[n, s] = pe
            w.append(_sigmoid(logits[n, pe]))
        total = F32(0.0)
        for v in w:
            total = F32(total + v)
        for s, v in enumerate(w):
            ws = F32(v / F32(total + F32(1e-20))) if e.norm_topk_prob else v
            wts[n, s] = F32(ws * F32(e.routed_scaling_factor))
    slots = e.work_slots(n_rows)
    work = np.full(slots * (2 + n_rows), 7777, np.int64)  # poison: every word must be written
    flat = ids.reshape(-1)
    base = 0
    for c0 in range(0, ne, ix.LANES):
        ms = [int((flat == c0 + lane).sum()) if c0 + lane < ne else 0
              for lane in range(ix.LANES)]
        ballot = sum(1 << lane for lane in range(ix.LANES) if ms[lane] > 0)
        for lane in range(ix.LANES):
            x, m = c0 + lane, ms[lane]
            if m > 0:
                w = ix.slot_of(base, ballot, lane, lambda b: bin(b).count("1"))
                work[ix.work_at(w, 0, n_rows)], work[ix.work_at(w, 1, n_rows)] = x, m
                q = 0
                for p in range(flat.size):
                    if flat[p] == x:
                        work[ix.work_at(w, 2 + q, n_rows)] = p
                        q += 1
                for r in range(m, n_rows):
                    work[ix.work_at(w, 2 + r, n_rows)] = -1
        base += bin(ballot).count("1")
    for idx in range((slots - base) * (2 + n_rows)):
        row, c = divmod(idx, 2 + n_rows)
        work[ix.work_at(base + row, c, n_rows)] = 0 if c == 1 else -1
    return ids, wts, work.reshape(slots, 2 + n_rows)


def _inputs(rows: int, seed: int, ties: bool) -> tuple[np.ndarray, ...]:
    g = torch.Generator().manual_seed(seed)
    h, k, ne = rows, 64, CFG.num_experts
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
