"""A numpy emulation of the latent-attention device handlers (MLA_Q, MLA, MLA_O;
kernel/device/mla.py), run with the kernel's own index helpers (kernel/host/mla_index.py), against
the CPU executor's ops.

The emulation walks each handler's loops with its thread mapping (MLA_Q: row parts x columns, the
parts summed in order; MLA: a warp per new position for the latent norm, key chunks of KC staged
as fp32 rows LS apart, a warp per query with lanes over its dims and a register per chunk key
summed by the warp's butterfly, the o elements a thread owns; MLA_O: the merge, a warp per output
dim) over flat fp32 arrays laid out as the arenas, in float32. The executor's ops run the same
records on the same fresh random inputs (lengths, caches, proj): the truth. kimi-linear-tiny at B
in {1, 4}, T in {1, 4}, split counts up to more splits than keys (empty ranges; with T = 4 also
queries that see no key of a non-empty range).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.executor import Executor, executor_gpu
from megakernel.executor.ops.mla import mla, mla_o, mla_q
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host.dense_index import attn_keys, kv_row
from megakernel.kernel.host.limits import NUM_THREADS
from megakernel.kernel.host.mla_index import LANES, LATENT_NORM_EPS, MLAShape, check_mla
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights

F = np.float32
NT, NW = NUM_THREADS, NUM_THREADS // LANES
MODEL = "kimi-linear-tiny"
S_MAX = 80  # cache positions per sequence


def bf16(x):  # noqa: ANN001, ANN201
    """fp32 -> bf16 -> fp32 (round to nearest even), as `.to(BFloat16)` on the device."""
    return torch.from_numpy(np.asarray(x, dtype=F)).to(torch.bfloat16).float().numpy()


def butterfly_sum(v: np.ndarray) -> np.ndarray:
    """cute.arch.warp_reduction_sum over 32 lanes: v + v[lane ^ offset], offsets 16 .. 1."""
    for off in (16, 8, 4, 2, 1):
        v = (v + v[np.arange(LANES) ^ off]).astype(F)
    return v


# ---- the handlers' walks -------------------------------------------------------------------------
def emulate_mla_q(m: MLAShape, d: dict, W: np.ndarray, F32: np.ndarray) -> None:
    h, proj, kvb, qlat = d["HEAD"], d["PROJ_OFF"], d["KVB_W"], d["QLAT_OFF"]
    n_, dn = m.rows, m.nope
    sq = np.array([bf16(F32[proj + m.proj(idx // dn, m.q_col(h, idx % dn))])
                   for idx in range(n_ * dn)], dtype=F)  # sQ [N, dn]
    for jc in range(0, m.rank, m.rc):
        red = np.full(m.parts * n_ * m.rc, np.nan, dtype=F)
        for tidx in range(NT):
            p, j = m.q_part(tidx)
            acc = np.zeros(n_, dtype=F)
            for i in range(*m.part_rows(p)):
                acc = acc + sq[np.arange(n_) * dn + i] * W[kvb + m.w_uk(h, i, jc + j)]
            for n in range(n_):
                red[m.red(p, n, j)] = acc[n]
        for idx in range(n_ * m.rc):
            n, jj = divmod(idx, m.rc)
            tot = F(0.0)
            for pp in range(m.parts):
                tot = F(tot + red[m.red(pp, n, jj)])
            F32[qlat + m.qlat(n, h, jc + jj)] = tot


def emulate_mla(m: MLAShape, d: dict, slot: int, s_max: int, W: np.ndarray, F32: np.ndarray,
                I32: np.ndarray, K: np.ndarray, V: np.ndarray) -> None:
    b, s, ns, proj, qlat = d["B_IDX"], d["SPLIT"], d["N_SPLITS"], d["PROJ_OFF"], d["QLAT_OFF"]
    T, r, kc, ls = m.tokens, m.rank, m.kc, m.ls
    length = int(I32[d["LEN_OFF"] + b])
    row0 = kv_row(slot, b, 0, s_max, m.batch, 1)
    lo, hi = attn_keys(s, ns, length, T - 1, 0, 1, T)
    for pos in range(*m.new_keys(lo, hi, length)):  # a warp each: the latent -> cache
        n = b * T + pos - length
        x = np.array([F32[proj + m.proj(n, m.lat_col(c))] for c in range(r)], dtype=F)
        rstd = F(1.0) / np.sqrt(F((x * x).sum(dtype=F) / F(r)) + F(LATENT_NORM_EPS), dtype=F)
        y = x * rstd * W[d["NORM_W"] : d["NORM_W"] + r]
        for c in range(r):
            K[m.c_elem(row0 + pos, c)] = bf16(y[c])
        for c in range(m.rope):
            V[m.kr_elem(row0 + pos, c)] = bf16(F32[proj + m.proj(n, m.lat_col(r + c))])
    sm_m = np.full(m.queries, -np.inf, dtype=F)
    sm_l = np.zeros(m.queries, dtype=F)
    o = np.zeros((NT, m.owned), dtype=F)
    for k0 in range(lo, hi, kc):
        nk = min(hi - k0, kc)
        lat = np.full(kc * ls, np.nan, dtype=F)  # the staged chunk; rows past nk: stale
        for kk in range(nk):
            for c in range(m.width32):
                row = row0 + k0 + kk
                lat[m.lat(kk, c)] = (K[m.c_elem(row, c)] if c < r else
                                     V[m.kr_elem(row, c - r)] if c < m.width else 0.0)
        p_ = np.zeros((m.queries, kc), dtype=F)
        alpha = np.zeros(m.queries, dtype=F)
        for qi in range(m.queries):  # a warp each
            t, h = m.query(qi)
            n = b * T + t
            ke = attn_keys(s, ns, length, t, 0, 1, T)[1]
            qv = np.zeros(m.width32, dtype=F)
            for c in range(m.width):
                if c < r:
                    qv[c] = F32[qlat + m.qlat(n, h, c)]
                else:
                    qv[c] = bf16(F32[proj + m.proj(n, m.q_col(h, m.nope + c - r))])
            lanes = np.arange(LANES)
            acc = np.zeros((kc, LANES), dtype=F)  # a register per chunk key, lanes over dims
            for c in range(m.dim_steps):
                for kk in range(kc):
                    acc[kk] = acc[kk] + qv[c * LANES + lanes] * lat[m.lat(kk, c * LANES + lanes)]
            dot = np.full(LANES, np.nan, dtype=F)  # lane kk: key kk's warp sum
            dot[:kc] = [butterfly_sum(a)[0] for a in acc]
            live = (lanes < kc) & (k0 + lanes < ke)
            score = np.where(live, dot * F(m.dqk ** -0.5), F(-np.inf)).astype(F)
            m_new = max(sm_m[qi], score.max())
            base = F(0.0) if m_new == -np.inf else m_new
            alpha[qi] = np.exp(F(sm_m[qi] - base), dtype=F)
            pr = np.exp(score - base, dtype=F)
            p_[qi] = pr[:kc]
            sm_m[qi] = m_new
            sm_l[qi] = F(F(sm_l[qi] * alpha[qi]) + pr.sum(dtype=F))
        for tidx in range(NT):
            for u in range(m.owned):
                qi, j = m.own(tidx, u)
                if qi < m.queries:
                    acc = F(o[tidx, u] * alpha[qi])
                    for kk in range(nk):
                        acc = F(acc + F(p_[qi, kk] * lat[m.lat(kk, j)]))
                    o[tidx, u] = acc
    for tidx in range(NT):
        for u in range(m.owned):
            qi, j = m.own(tidx, u)
            if qi < m.queries:
                t, h = m.query(qi)
                F32[d["PO_OFF"] + m.po(s, b * T + t, h, j)] = o[tidx, u]
    for qi in range(m.queries):
        t, h = m.query(qi)
        F32[d["PML_OFF"] + m.pml(s, b * T + t, h)] = sm_m[qi]
        F32[d["PML_OFF"] + m.pml(s, b * T + t, h) + 1] = sm_l[qi]


def emulate_mla_o(m: MLAShape, d: dict, W: np.ndarray, F32: np.ndarray, out: np.ndarray) -> None:
    h, ns, po, pml, kvb = d["HEAD"], d["N_SPLITS"], d["PO_OFF"], d["PML_OFF"], d["KVB_W"]
    n_, r = m.rows, m.rank
    mx = np.array([max(F32[pml + m.pml(s, n, h)] for s in range(ns)) for n in range(n_)], F)
    den = np.zeros(n_, dtype=F)
    for n in range(n_):
        for s in range(ns):
            den[n] = F(den[n] + F(F32[pml + m.pml(s, n, h) + 1] * np.exp(
                F(F32[pml + m.pml(s, n, h)] - mx[n]), dtype=F)))
    o = np.zeros(n_ * r, dtype=F)
    for idx in range(n_ * r):
        n, j = divmod(idx, r)
        num = F(0.0)
        for s in range(ns):
            num = F(num + F(F32[po + m.po(s, n, h, j)] * np.exp(
                F(F32[pml + m.pml(s, n, h)] - mx[n]), dtype=F)))
        o[idx] = F(num / den[n])
    for i in range(m.vdim):  # a warp per output dim, lanes over r
        w = np.array([W[kvb + m.w_uv(h, i, j)] for j in range(r)], dtype=F)
        for n in range(n_):
            out[d["OUT_OFF"] + m.out(n, h, i)] = (o[n * r : (n + 1) * r] * w).sum(dtype=F)


# ---- the comparison ------------------------------------------------------------------------------
def setup(batch: int, tokens: int, n_splits: int, seed: int):  # noqa: ANN201
    """An executor of kimi-linear-tiny with fresh random lengths, caches and proj, and the MLA
    layer's records by opcode."""
    cfg = preset(MODEL)
    m = make_spec(cfg, batch, tokens, "sm_90a", smem_stages=0).shape("mla")
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=tokens, max_seq_len=S_MAX,
                           n_splits=n_splits)
    ex = Executor(prog, pack_weights(cfg, random_weights(cfg, seed=seed)), check=False)
    gen = torch.Generator().manual_seed(seed)
    ex.f32.copy_(torch.randn(ex.f32.shape, generator=gen))
    ex.k.copy_(torch.randn(ex.k.shape, generator=gen))
    ex.v.copy_(torch.randn(ex.v.shape, generator=gen))
    # a long sequence (several key chunks at S = 1), then 0 and 1 cached keys (more splits than
    # keys: empty ranges) and a random length
    top = S_MAX - tokens + 1
    lens = [int(torch.randint(40, top, (1,), generator=gen))]
    if batch > 1:
        lens += [0, 1, *torch.randint(2, top, (batch - 3,), generator=gen).tolist()]
    ex.lengths.copy_(torch.tensor(lens, dtype=torch.int32))
    layer = next(b.layer for b in cfg.blocks if b.kind == "mla")
    recs = [isa.decode(rr) for q in prog.records().tolist() for rr in q if rr[0] != isa.Op.END]
    by_op = {name: [d for d in recs if d["OPCODE"] == getattr(isa.Op, name)
                    and d["LAYER"] == layer] for name in ("MLA_Q", "MLA", "MLA_O")}
    assert len(by_op["MLA"]) == batch * n_splits and len(by_op["MLA_Q"]) == m.heads
    return m, prog, ex, by_op, layer


def flat(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).float().numpy().astype(F).copy()


def run_and_compare(batch: int, tokens: int, n_splits: int, seed: int = 3) -> None:
    m, prog, ex, by_op, layer = setup(batch, tokens, n_splits, seed)
    W = ex.weights.float().numpy()
    slot, s_max = prog.buffers.kv_slot[layer], prog.max_seq_len
    f32 = prog.buffers.f32
    # MLA_Q: q_lat of every head from the same proj
    F32 = flat(ex.f32)
    for d in by_op["MLA_Q"]:
        mla_q(ex, d, 0)
        emulate_mla_q(m, d, W, F32)
    _close(F32, flat(ex.f32), f32["qlat"], "q_lat")
    # MLA: cache writes and partials (from the executor's q_lat)
    F32, I32, K, V = flat(ex.f32), ex.i32.numpy().copy(), flat(ex.k), flat(ex.v)
    for d in by_op["MLA"]:
        mla(ex, d, 0)
        emulate_mla(m, d, slot, s_max, W, F32, I32, K, V)
    _bf16_close(K, flat(ex.k), "latent cache")
    np.testing.assert_array_equal(V, flat(ex.v), err_msg="k_rope cache")
    ml = f32["part_ml"]
    mine, theirs = F32[ml.offset : ml.offset + ml.numel], flat(ex.f32)[ml.offset : ml.offset
                                                                        + ml.numel]
    assert np.isneginf(theirs[0::2]).any() or batch == 1  # an empty range is covered
    np.testing.assert_allclose(mine, theirs, rtol=2e-5, atol=1e-5, err_msg="partial (m, l)")
    _close(F32, flat(ex.f32), f32["part_o"], "partial o")
    # MLA_O: the bf16 output from the executor's partials
    F32, out = flat(ex.f32), np.full(ex.bf16.numel(), np.nan, dtype=F)
    for d in by_op["MLA_O"]:
        mla_o(ex, d, 0)
        emulate_mla_o(m, d, W, F32, out)
    r = prog.buffers.bf16["attn"]
    _bf16_close(bf16(out[r.offset : r.offset + r.numel]),
                flat(ex.bf16)[r.offset : r.offset + r.numel], "attention output")


def _bf16_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """bf16 values within one bf16 ulp of the executor's (or fp32 rounding of the largest)."""
    assert np.isfinite(got).all() and np.abs(want).max() > 0.01, what
    bad = np.abs(got - want) > np.maximum(2.0 ** -7 * np.abs(want), 1e-5 * np.abs(want).max())
    assert not bad.any(), (what, got[bad], want[bad])


def _close(mine: np.ndarray, theirs: np.ndarray, r, what: str) -> None:  # noqa: ANN001
    a, b = mine[r.offset : r.offset + r.numel], theirs[r.offset : r.offset + r.numel]
    assert np.isfinite(b).all() and np.abs(b).max() > 0.01, what
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * np.abs(b).max(), err_msg=what)


@pytest.mark.parametrize("batch,tokens,n_splits", [(1, 1, 1), (1, 4, 3), (4, 1, 4), (4, 4, 6)])
def test_mla_emulation_matches_the_executor(batch, tokens, n_splits):
    run_and_compare(batch, tokens, n_splits)


def test_mla_shape_the_handlers_refuse():
    """check_mla names what the thread mappings cannot run; Kimi's real shape fits at T = 1."""
    real = MLAShape(32, 512, 128, 64, 128, 1, 1, NT)
    assert check_mla(real) == "" and real.kc == 8 and real.owned == 64
    assert "kv_lora_rank 48" in check_mla(MLAShape(4, 48, 16, 8, 16, 1, 1, NT))
    assert "registers" in check_mla(MLAShape(32, 512, 128, 64, 128, 1, 2, NT))
