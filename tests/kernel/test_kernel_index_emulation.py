"""numpy emulations of the kernel's index arithmetic, run with the kernel's own helpers.

No GPU here. The device code computes its addresses with the pure-Python helpers of spec.py
(row_major, tile_copy, k_slice, tile_warp, chunk_ksplit, acc_index, attn_query, attn_warp,
attn_keys, kv_row; ring_slot, matvec_tiles); these emulations walk the same loop nests with the
same helpers over numpy arrays laid out as shared and global memory, and compare with plain
matrix products (float64):
- the GEMV: loader copies into the ring (whole tiles or one copy per row of a K-chunk), the
  consumer warps' (row, K-slice) roles, the shared accumulator [ksplit][NO][rows] and the
  epilogue's in-order sum; pipelined FMA, pipelined mma (tile product plain: test_kernel_mma
  checks the fragments) and the global-memory FMA path;
- split-KV GQA attention: which queries a warp serves, which kv head and keys it reads, the
  softmax scale of the kernel's Attention, the warp-share and split merges (the latter in
  batches of attn_merge_batch splits, as Attention.merge loads them).
Shapes: llama-tiny, llama-mid, llama-3.2-1b, qwen3-0.6b at B = 1 and 16.
"""

from __future__ import annotations

import numpy as np
import pytest

from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.config.spec import KernelSpec
from megakernel.kernel.host.dense_index import (
    acc_index,
    attn_chunk_keys,
    attn_group_queries,
    attn_keys,
    attn_merge_batch,
    attn_merge_split,
    attn_mma_chunk,
    attn_q_rows,
    attn_query,
    attn_query_batch,
    attn_round_trips,
    attn_tensor_cores,
    attn_value_batch,
    attn_warp,
    attn_warp_queries,
    chunk_ksplit,
    k_slice,
    kv_row,
    kv_slot,
    ring_slot,
    row_major,
    tile_copy,
    tile_warp,
)
from megakernel.kernel.host.limits import LANES, ROW_CHUNK, SMEM_STAGE_BYTES, VEC, tile_rows
from megakernel.kernel.host.plans import matvec_tiles
from megakernel.models import preset

MODELS = ("llama-tiny", "llama-mid", "llama-3.2-1b", "qwen3-0.6b")
BATCHES = (1, 16)
NROWS = ROW_CHUNK + 32  # a full row chunk and a short one (fewer row groups than warps)


def _specs(smem_stages=None) -> list[KernelSpec]:  # noqa: ANN001
    return [make_spec(preset(m), b, 1, "sm_90a", smem_stages=smem_stages)
            for m in MODELS for b in BATCHES]


def _ks(spec: KernelSpec) -> list[int]:
    """The matvec K's of a layer: hidden (QKV, GATEUP, LMHEAD), q size (OPROJ), inter (DOWN)."""
    return sorted({spec.hidden, spec.heads * spec.head_dim, spec.inter})


# ---- the GEMV -----------------------------------------------------------------------------------
def _stage_x(spec: KernelSpec, x: np.ndarray, n0: int, kc0: int, kc: int) -> np.ndarray:
    """sX [NO][XS] flat: rows n0.. of the input's K-chunk, zeros past N (matvec.stage_x)."""
    sx = np.full(spec.no * spec.x_stride, np.nan)
    for nn in range(spec.no):
        a = row_major(nn, 0, spec.x_stride)
        sx[a:a + kc] = x[n0 + nn, kc0:kc0 + kc] if n0 + nn < spec.rows else 0.0
    return sx


def _load_tile(ring: np.ndarray, stage: int, w: np.ndarray, row0: int, rows: int, col0: int,
               kc: int) -> None:
    """The loader's bulk copies of one tile (pipeline.load_queue) into its stage."""
    k = w.shape[1]
    flat, base = w.reshape(-1), stage * (SMEM_STAGE_BYTES // 2)
    ring[base:base + SMEM_STAGE_BYTES // 2] = np.nan  # stale data must not leak
    copies = [(0, rows * kc)] if kc == k else [(r, kc) for r in range(rows)]
    for r, n in copies:
        d, e = tile_copy(r, row0, col0, kc, k)
        assert 0 <= d and d + n <= SMEM_STAGE_BYTES // 2  # within the stage
        ring[base + d:base + d + n] = flat[e:e + n]


def _emulate_piped(spec: KernelSpec, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, dict]:
    """Matvec.run_piped over one slab w [NROWS, K]: [N, NROWS] and what occurred."""
    nrows, k = w.shape
    NO, NW, KC = spec.no, spec.num_warps, spec.k_chunk
    tr = tile_rows(min(KC, k), NW)
    ksplit = NW // tr
    loads = list(matvec_tiles(nrows, k, spec.passes, KC, NW))  # the loader's sequence
    ring = np.full(spec.smem_stages * SMEM_STAGE_BYTES // 2, np.nan)
    out = np.full((spec.rows, nrows), np.nan)
    seen = {"ksplit": ksplit, "k_chunked": KC < k}
    j = 0
    for p, n0 in enumerate(range(0, spec.rows, NO)):
        for rc0 in range(0, nrows, spec.row_chunk):
            nr = min(spec.row_chunk, nrows - rc0)
            acc = np.full(spec.acc_words, np.nan)
            acc[:ksplit * NO * nr] = 0.0
            for kc0 in range(0, k, KC):
                kc = min(KC, k - kc0)
                sx = _stage_x(spec, x, n0, kc0, kc).reshape(-1)
                for t0 in range(0, nr, tr):
                    rows = min(tr, nr - t0)
                    s = ring_slot(j, spec.smem_stages)[0]
                    assert loads[j] == (p, rc0 + t0, rows, kc0, kc)  # loader = consumers
                    _load_tile(ring, s, w, rc0 + t0, rows, kc0, kc)
                    sbase = s * (SMEM_STAGE_BYTES // 2)
                    if spec.mma:  # one 8-row tile, K over the warps, summed (mma_reduce)
                        tile = ring[sbase:sbase + rows * kc].reshape(rows, kc)
                        xs = np.stack([sx[row_major(nn, 0, spec.x_stride):][:kc]
                                       for nn in range(NO)])
                        part = xs @ tile.T  # [NO, rows]
                        for nn in range(NO):
                            a = acc_index(0, nn, t0, NO, nr)
                            acc[a:a + rows] += part[nn]
                    else:
                        for warp in range(NW):  # gemv_tile
                            r, ks = tile_warp(warp, ksplit)
                            if r >= rows:
                                continue
                            vb, ve = k_slice(kc // VEC, ksplit, ks)
                            wrow = sbase + row_major(r, 0, kc)
                            wv = ring[wrow + vb * VEC:wrow + ve * VEC]
                            for nn in range(NO):
                                xa = row_major(nn, vb * VEC, spec.x_stride)
                                xv = sx[xa:xa + (ve - vb) * VEC]
                                acc[acc_index(ks, nn, t0, NO, nr) + r] += wv @ xv
                    j += 1
            for nn in range(min(NO, spec.rows - n0)):  # the epilogue's acc_value
                for r in range(nr):
                    out[n0 + nn, rc0 + r] = sum(acc[acc_index(ks, nn, r, NO, nr)]
                                                for ks in range(ksplit))
    assert j == len(loads)
    return out, seen


def _emulate_global(spec: KernelSpec, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, dict]:
    """Matvec.run + gemv (weights from global memory) over one slab w [NROWS, K]."""
    nrows, k = w.shape
    NO, NW, KC, R = spec.no, spec.num_warps, spec.k_chunk, spec.rows_per_group
    flat = w.reshape(-1)
    out = np.full((spec.rows, nrows), np.nan)
    seen = {"ksplit": 1, "k_chunked": KC < k}
    for n0 in range(0, spec.rows, NO):
        for rc0 in range(0, nrows, spec.row_chunk):
            nr = min(spec.row_chunk, nrows - rc0)
            ng = nr // R
            ksplit = chunk_ksplit(ng, NW)
            nrp = ng * R
            seen["ksplit"] = max(seen["ksplit"], ksplit)
            acc = np.full(spec.acc_words, np.nan)
            acc[:ksplit * NO * nrp] = 0.0
            for kc0 in range(0, k, KC):
                kc = min(KC, k - kc0)
                sx = _stage_x(spec, x, n0, kc0, kc)
                for warp in range(NW):
                    ks = warp // ng
                    if ks >= ksplit:
                        continue
                    vb, ve = k_slice(kc // VEC, ksplit, ks)
                    for gi in range(warp - ks * ng, ng, NW):
                        rowl = gi * R
                        row_off = row_major(rc0 + rowl, kc0, k)
                        for r in range(R):
                            a0 = row_off + row_major(r, vb * VEC, k)
                            wv = flat[a0:a0 + (ve - vb) * VEC]
                            for nn in range(NO):
                                xa = row_major(nn, vb * VEC, spec.x_stride)
                                acc[acc_index(ks, nn, rowl, NO, nrp) + r] += (
                                    wv @ sx[xa:xa + (ve - vb) * VEC])
            for nn in range(min(NO, spec.rows - n0)):
                for r in range(nr):
                    out[n0 + nn, rc0 + r] = sum(acc[acc_index(ks, nn, r, NO, nrp)]
                                                for ks in range(ksplit))
    return out, seen


def _check_gemv(specs: list[KernelSpec], emulate) -> list[dict]:  # noqa: ANN001
    rng = np.random.default_rng(7)
    seen = []
    for spec in specs:
        for k in _ks(spec):
            w = rng.standard_normal((NROWS, k))
            x = rng.standard_normal((spec.rows, k))
            got, s = emulate(spec, w, x)
            np.testing.assert_allclose(got, x @ w.T, rtol=1e-10, atol=1e-10,
                                       err_msg=f"{spec.tag} K={k}")
            seen.append(s)
    return seen


def test_pipelined_gemv_indexing_computes_the_matrix_product():
    specs = _specs()
    assert all(s.pipelined for s in specs)
    seen = _check_gemv(specs, _emulate_piped)
    assert any(s["ksplit"] > 1 for s in seen)  # warps split K (FMA, B = 1)
    assert any(s["k_chunked"] for s in seen)  # per-row copies of K-chunked tiles (B = 16)
    assert {s.mma for s in specs} == {False, True}


def test_global_memory_gemv_indexing_computes_the_matrix_product():
    seen = _check_gemv(_specs(smem_stages=0), _emulate_global)
    assert any(s["ksplit"] > 1 for s in seen) and any(s["k_chunked"] for s in seen)


# ---- attention ----------------------------------------------------------------------------------
def _merge_batches(size: int, n_splits: int, stride: int,
                   slot0: int) -> list[tuple[int, int, int]]:
    """(first split, entry, partial slot) of each load of Attention.merge's batches of `size`
    splits: entries past n_splits load the last split (attn_merge_split)."""
    return [(s0, j, attn_merge_split(s0, j, n_splits) * stride + slot0)
            for s0 in range(0, n_splits, size) for j in range(size)]


def _q_rows(spec: KernelSpec) -> int:
    """q rows per warp the consumers' span holds (Attention.query_rows)."""
    return attn_q_rows(spec.smem_regions()["flag"][0], spec.head_dim, spec.num_warps)


def _emulate_attention(spec: KernelSpec, scale: float, q: np.ndarray, kc: np.ndarray,
                       vc: np.ndarray, lengths: list[int], layer: int, n_splits: int,
                       fetch=None, live=None) -> np.ndarray:  # noqa: ANN001
    """ATTN_PARTIAL for every (sequence, kv head, split) then the merge: out [N, Hq, D].
    q [N * Hq * D] flat (the q buffer), kc / vc [L * B * Hkv * S_max * D] flat (the caches);
    `fetch(b, g, key)`: (key row, value row) of another cache layout (the paged one); `live`
    [B] 0/1: 0 for a padding row of a paged step, which sees no keys (Attention.partial)."""
    D, G, T, N, Hq, NW = (spec.head_dim, spec.group, spec.tokens, spec.rows, spec.heads,
                          spec.num_warps)
    s_max = kc.size // (spec.layers * spec.batch * spec.kv_heads * D) if fetch is None else 0
    WQ = max(1, NW // spec.attn_queries)
    QB = attn_query_batch(D, G, T, NW, smem_queries=_q_rows(spec))
    QG, step = spec.attn_queries, NW // WQ
    po = np.full((n_splits * N * Hq, D), np.nan)
    pml = np.full((n_splits * N * Hq, 2), np.nan)
    for b in range(spec.batch):
        for g in range(spec.kv_heads):
            row0 = kv_row(layer, b, g, s_max, spec.batch, spec.kv_heads)
            for s in range(n_splits):
                shares = {}
                for warp in range(NW):
                    q0, part = attn_warp(warp, WQ)
                    for g0 in range(q0, QG, step * QB):  # a pass: QB queries, one key walk
                        qs, keq, kbs = [], [], set()
                        for j in range(QB):
                            qi, ql = attn_group_queries(g0, j, step, QG)
                            t, head, n = attn_query(qi, g, b, G, T)
                            kb, ke = attn_keys(s, n_splits, lengths[b], t, part, WQ, T)
                            live_b = 1 if live is None else live[b]
                            qa = row_major(row_major(n, head, Hq), 0, D)
                            qs.append((ql, n, head, q[qa:qa + D]))
                            keq.append(kb + (ke - kb) * ql * live_b)
                            kbs.add(kb)
                        assert len(kbs) == 1  # the pass's queries start at the same key
                        st = [(-np.inf, 0.0, np.zeros(D)) for _ in range(QB)]
                        for k0 in range(kb, max(keq), LANES):  # 32 keys at a time, loaded once
                            keys = range(k0, min(max(keq), k0 + LANES))
                            if fetch is None:
                                kr = np.stack([kc[(row0 + key) * D:][:D] for key in keys])
                                vr = np.stack([vc[(row0 + key) * D:][:D] for key in keys])
                            else:
                                kr, vr = (np.stack(x) for x in zip(
                                    *(fetch(b, g, key) for key in keys), strict=True))
                            for j, (_, _, _, qv) in enumerate(qs):
                                nq = attn_chunk_keys(k0, keq[j])  # its causal limit
                                if nq == 0:
                                    continue
                                m, lsum, o = st[j]
                                sc = kr[:nq] @ qv * scale
                                m_new = max(m, sc.max())
                                p = np.exp(sc - m_new)
                                alpha = np.exp(m - m_new)
                                st[j] = (m_new, lsum * alpha + p.sum(), o * alpha + p @ vr[:nq])
                        for (ql, n, head, _), res in zip(qs, st, strict=True):
                            if ql:
                                assert (n, head, part) not in shares  # each share once
                                shares[(n, head, part)] = res
                for (n, head, part) in shares:  # the WQ shares merged in order
                    if part:
                        continue
                    parts = [shares[(n, head, pp)] for pp in range(WQ)]
                    mm = max(p[0] for p in parts)
                    wts = [np.exp(p[0] - mm) if mm > -np.inf else 0.0 for p in parts]
                    slot = (s * N + n) * Hq + head
                    pml[slot] = (mm, sum(p[1] * wt for p, wt in zip(parts, wts, strict=True)))
                    po[slot] = sum(p[2] * wt for p, wt in zip(parts, wts, strict=True))
    out = np.full((N, Hq, D), np.nan)
    MB, SB = attn_merge_batch(D)
    for b in range(spec.batch):  # the merge of the last split's CTA, a batch of splits a trip
        for g in range(spec.kv_heads):
            for qi in range(spec.attn_queries):
                _, head, n = attn_query(qi, g, b, G, T)
                slot0 = n * Hq + head  # split s's partial at slot s * N * Hq + slot0
                mm = -np.inf  # over every loaded m, the repeats past n_splits included
                for _, _, sl in _merge_batches(MB, n_splits, N * Hq, slot0):
                    mm = max(mm, pml[sl, 0])
                den, o = 0.0, np.zeros(D)  # in split order, the repeats skipped
                for s0, j, sl in _merge_batches(SB, n_splits, N * Hq, slot0):
                    if n_splits > s0 + j:
                        wt = np.exp(pml[sl, 0] - mm) if mm > -np.inf else 0.0
                        den, o = den + pml[sl, 1] * wt, o + po[sl] * wt
                if not den > 0:  # a padding row of a paged step saw no keys: 0
                    out[n, head] = 0.0
                    continue
                out[n, head] = o / den
    return out


def _reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lengths: list[int],
                         tokens: int) -> np.ndarray:
    """Plain causal GQA decode attention: q [B, T, Hq, D], k/v [B, Hkv, S, D] -> [B, T, Hq, D];
    q head h reads kv head h // (Hq / Hkv), scores scaled by 1 / sqrt(D) of q and k."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            n_keys = lengths[b] + t + 1
            for h in range(Hq):
                sc = k[b, h // G, :n_keys] @ q[b, t, h] / np.sqrt(q.shape[-1])
                p = np.exp(sc - sc.max())
                out[b, t, h] = p @ v[b, h // G, :n_keys] / p.sum()
    return out


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("batch,tokens,n_splits", [(1, 1, 3), (16, 1, 2), (2, 3, 2),
                                                    (2, 1, 21), (1, 8, 3), (2, 4, 2)])
def test_attention_indexing_computes_gqa_attention(model, batch, tokens, n_splits):
    pytest.importorskip("cutlass", reason="the kernel's Attention holds the softmax scale")
    from megakernel.kernel.device.attention import Attention

    spec = make_spec(preset(model), batch, tokens, "sm_90a")
    rng = np.random.default_rng(batch * 31 + tokens)
    L, B, Hkv, D, Hq = spec.layers, spec.batch, spec.kv_heads, spec.head_dim, spec.heads
    lengths = [int(x) for x in rng.integers(1, 70, B)]
    s_max = max(lengths) + tokens + 5
    layer = L - 1
    kc = rng.standard_normal((L, B, Hkv, s_max, D))
    vc = rng.standard_normal((L, B, Hkv, s_max, D))
    q = rng.standard_normal((B, tokens, Hq, D))
    got = _emulate_attention(spec, Attention(spec).scale, q.reshape(-1), kc.reshape(-1),
                             vc.reshape(-1), lengths, layer, n_splits)
    want = _reference_attention(q, kc[layer], vc[layer], lengths, tokens)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-9, atol=1e-12)


def _attention_walk(group: int, tokens: int, head_dim: int, length: int, n_splits: int,
                    smem_queries: int, num_warps: int = 8):
    """Attention.partial / attend's loop nest, indices only, for one (sequence, kv head): per
    split and warp its passes of QB queries, per pass the chunks of 32 keys it loads (once)
    and the (query, key) pairs each chunk's queries see. Returns (visits: (split, query, key)
    -> count, stores: (split, query, share) -> count, round trips of the busiest warp)."""
    qg = group * tokens
    if attn_tensor_cores(head_dim, group, tokens, num_warps=num_warps):
        return _attention_walk_mma(group, tokens, head_dim, length, n_splits, num_warps)
    wq = max(1, num_warps // qg)
    qb = attn_query_batch(head_dim, group, tokens, num_warps, smem_queries)
    step, vb = num_warps // wq, attn_value_batch(head_dim)
    visits, stores, trips = {}, {}, [0] * num_warps
    for s in range(n_splits):
        for warp in range(num_warps):
            q0, part = attn_warp(warp, wq)
            warp_trips = 0
            for g0 in range(q0, qg, step * qb):
                pas = [attn_group_queries(g0, j, step, qg) for j in range(qb)]
                bounds = [attn_keys(s, n_splits, length, qi // group, part, wq, tokens)
                          for qi, _ in pas]
                kb = bounds[0][0]
                keq = [k0 + (k1 - k0) * ql for (k0, k1), (_, ql) in zip(bounds, pas, strict=True)]
                assert all(k0 == kb for k0, _ in bounds)
                warp_trips += 2  # the pass's q rows, its stores
                loaded = []
                for k0 in range(kb, max(keq), LANES):
                    nvalid = min(max(keq) - k0, LANES)
                    loaded.append(k0)
                    warp_trips += 1 + len(range(vb, nvalid, vb))
                    for (qi, _), ke in zip(pas, keq, strict=True):
                        nq = attn_chunk_keys(k0, ke)
                        for lane in range(LANES):  # the scores: lane = key
                            if lane < nq:
                                v = (s, qi, k0 + lane)
                                visits[v] = visits.get(v, 0) + 1
                assert len(set(loaded)) == len(loaded)  # each chunk loaded once a pass
                for qi, ql in pas:
                    if ql:
                        stores[(s, qi, part)] = stores.get((s, qi, part), 0) + 1
            trips[warp] = warp_trips
    return visits, stores, max(trips)


def _attention_walk_mma(group: int, tokens: int, head_dim: int, length: int, n_splits: int,
                        num_warps: int):
    """TensorCorePartial.partial's loop nest (attention_mma.py), indices only: per split every
    warp a share of the keys (attn_keys of the last token) for all the queries, each row cut at
    its causal limit, chunks of attn_mma_chunk keys (one wait each); after the warps' merge each
    query's partial is stored once (share 0), by warp qi % NW."""
    qg, kc = group * tokens, attn_mma_chunk(head_dim)
    visits, stores, trips = {}, {}, [0] * num_warps
    for s in range(n_splits):
        for warp in range(num_warps):
            kb, kw = attn_keys(s, n_splits, length, tokens - 1, warp, num_warps, tokens)
            chunks = list(range(kb, kw, kc))
            trips[warp] = 2 + len(chunks) + 1  # q, the chunks, the warps' merge, the stores
            for qi in range(qg):
                ke = max(kb, min(kw, length + qi // group + 1))
                for k0 in chunks:
                    for key in range(k0, min(k0 + kc, kw)):
                        if key < ke:
                            v = (s, qi, key)
                            visits[v] = visits.get(v, 0) + 1
        for qi in range(qg):
            stores[(s, qi, 0)] = stores.get((s, qi, 0), 0) + 1
    return visits, stores, max(trips)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_passes_visit_each_query_key_once(group, head_dim):
    """The new loop nest against a plain enumeration: every (split, query, key) with key in the
    split's range [s ctx / S, (s + 1) ctx / S) and below the query's causal limit length + t + 1
    is scored exactly once, nothing else; every (split, query, share) is stored once; the
    busiest warp's round trips are at most attn_round_trips (equal for full chunks)."""
    rng = np.random.default_rng(group * 1000 + head_dim)
    for tokens in range(1, 9):
        for smem_queries in (0, 1, 3):
            for length, n_splits in [(0, 1), (1, 3), (37, 2), (63, 5), (200, 7),
                                     (int(rng.integers(1, 400)), int(rng.integers(1, 9)))]:
                visits, stores, trips = _attention_walk(group, tokens, head_dim, length,
                                                        n_splits, smem_queries)
                ctx, qg = length + tokens, group * tokens
                wq = 1 if attn_tensor_cores(head_dim, group, tokens) else max(1, 8 // qg)
                want = {(s, qi, key): 1 for s in range(n_splits) for qi in range(qg)
                        for key in range(s * ctx // n_splits, min((s + 1) * ctx // n_splits,
                                                                  length + qi // group + 1))}
                assert visits == want, (group, tokens, length, n_splits, smem_queries)
                assert stores == {(s, qi, p): 1 for s in range(n_splits) for qi in range(qg)
                                  for p in range(wq)}
                if not smem_queries:
                    keys = -(-ctx // n_splits)
                    assert trips <= attn_round_trips(keys, head_dim, group, tokens)
    for tokens in range(1, 9):  # one split of whole chunks: the count is exact
        length = 64 * 4 - tokens
        _, _, trips = _attention_walk(group, tokens, head_dim, length, 1, 0)
        assert trips == attn_round_trips(length + tokens, head_dim, group, tokens)


def test_attention_passes_share_the_key_walk():
    """A warp's queries go QB at a time (attn_query_batch): all it owns when they fit the
    register cap (one pass: one walk of the keys), balanced passes otherwise; the shared memory
    the builds' consumer span gives q rows never caps QB below the registers' cap."""
    assert attn_query_batch(64, 4, 4) == 2 and attn_query_batch(64, 4, 8) == 4
    assert attn_query_batch(64, 8, 8) == 8 and attn_query_batch(64, 8, 12) == 6  # 12: 2 x 6
    assert attn_query_batch(128, 8, 8) == attn_query_batch(256, 4, 8) == 1  # D > 64: 1
    assert attn_query_batch(64, 4, 1) == 1 and attn_warp_queries(4, 1) == 1  # WQ = 2
    assert attn_query_batch(64, 4, 8, smem_queries=3) == 2  # cap 3: two passes of 2
    # round trips per warp: passes x (2 + chunks x (1 + value batches)), not queries x ...
    # (the FMA loop: the paged build's, or a model with recurrent layers; the tensor-core
    # partial waits once per 32 keys (16 at D = 128) of a warp's 1 / 8 share, + its merge)
    one = attn_round_trips(1024, 64, 4, 2, tight=True)  # 8 queries: one a warp, all keys
    assert one == 2 + 32 * (1 + 3)  # the paged build's value batches of 8
    assert attn_round_trips(1024, 64, 4, 2, recurrent=True) == 2 + 32 * (1 + 0)  # of 32
    assert attn_round_trips(1024, 64, 4, 2) == 2 + 1024 // 8 // 32 + 1
    assert attn_round_trips(1024, 128, 4, 2) == 2 + 1024 // 8 // 16 + 1
    assert (attn_round_trips(1024, 64, 4, 4, tight=True)
            == attn_round_trips(1024, 64, 4, 8, tight=True) == one)
    assert (attn_round_trips(1024, 64, 8, 12, tight=True)
            == 2 * attn_round_trips(1024, 64, 8, 1, tight=True))
    for model in ("llama-3.2-1b", "qwen3-0.6b", "llama-tiny"):
        for tokens in (2, 4, 8):
            for stages in (None, 0):
                spec = make_spec(preset(model), 1, tokens, "sm_90a", smem_stages=stages)
                d, g = spec.head_dim, spec.group
                assert attn_query_batch(d, g, tokens, smem_queries=_q_rows(spec)) == \
                    attn_query_batch(d, g, tokens), (model, tokens, stages)


# ---- Nemotron-H: the relu^2 epilogue and the KV cache slots --------------------------------------
class _StubExecutor:
    """What the executor's UP_RELU2 op reads of an Executor: the matvec result of the record
    (given), the rows, the block's intermediate size, and a bf16 arena to write (Executor.write:
    a view of [shape] at `off`, the value rounded to the arena's dtype)."""

    def __init__(self, acc, rows: int, inter: int, arena) -> None:  # noqa: ANN001
        from types import SimpleNamespace

        self.acc, self.arena = acc, arena
        self.prog = SimpleNamespace(rows=rows)
        self._blk = SimpleNamespace(cfg=SimpleNamespace(intermediate_size=inter))

    def matvec(self, d: dict):  # noqa: ANN201
        return self.acc

    def block(self, d: dict, kind_name: str):  # noqa: ANN201
        assert kind_name == "relu2"
        return self._blk

    def write(self, buf: str, off: int, shape, idx, value) -> None:  # noqa: ANN001
        assert buf == "bf16"
        view = self.arena[off: off + int(np.prod(shape))].view(shape)
        view[idx] = value.to(view.dtype)


def _emulate_relu2(spec: KernelSpec, parts: np.ndarray, row0: int, out_off: int,
                   arena: np.ndarray) -> None:
    """Matvec.epi_relu2 over every pass and row chunk of a UP_RELU2 slab: parts [ksplit, N,
    NROWS] fp32 are the K-slices the GEMV left in sAcc[ks][n][row] (acc_index), summed in order;
    relu (acc <= 0 selects 0) and the square in fp32, rounded to bf16 at
    row_major(n, row0 + rc0 + r, I) past out_off."""
    import torch

    ksplit, n_rows, nrows = parts.shape
    for n0 in range(0, n_rows, spec.no):
        for rc0 in range(0, nrows, ROW_CHUNK):
            nr = min(ROW_CHUNK, nrows - rc0)
            s_acc = np.full(ksplit * spec.no * nr, np.nan, np.float32)
            for ks in range(ksplit):
                for nn in range(min(spec.no, n_rows - n0)):
                    for r in range(nr):
                        s_acc[acc_index(ks, nn, r, spec.no, nr)] = parts[ks, n0 + nn, rc0 + r]
            for idx in range(spec.no * nr):  # the CTA's threads, tidx strided
                nn, r = divmod(idx, nr)
                if n0 + nn < n_rows:
                    v = s_acc[acc_index(0, nn, r, spec.no, nr)]
                    for ks in range(1, ksplit):
                        v = np.float32(v + s_acc[acc_index(ks, nn, r, spec.no, nr)])
                    y = np.float32(0.0) if v <= 0 else v
                    a = out_off + row_major(n0 + nn, row0 + rc0 + r, spec.inter)
                    arena[a] = torch.tensor(np.float32(y * y)).to(torch.bfloat16).float().item()


@pytest.mark.parametrize("batch", [1, 4, 40])  # 40 > NO: two passes over the activation rows
def test_relu2_epilogue_indexing_matches_the_executor(batch):
    import torch

    from megakernel.executor.ops.mlp import up_relu2

    inter = 2 * ROW_CHUNK + 128  # a slab of a full and a short row chunk, not at column 0
    cfg = preset("nemotron-h-attn-tiny").replace(intermediate_size=inter)
    spec = make_spec(cfg, batch, 1, "sm_90a")
    rng = np.random.default_rng(batch)
    row0, nrows, ksplit, out_off = 64, ROW_CHUNK + 64, 3, 24
    parts = rng.standard_normal((ksplit, batch, nrows)).astype(np.float32)
    total = parts[0]
    for ks in range(1, ksplit):  # the epilogue's order of the K-slices
        total = (total + parts[ks]).astype(np.float32)
    size = out_off + batch * inter + 8
    mine = np.full(size, np.nan, np.float32)
    _emulate_relu2(spec, parts, row0, out_off, mine)
    ref = torch.full((size,), float("nan"), dtype=torch.bfloat16)
    up_relu2(_StubExecutor(torch.from_numpy(total), batch, inter, ref),
             {"ROW0": row0, "NROWS": nrows, "OUT_OFF": out_off, "LAYER": 1}, 0)
    want = ref.float().numpy()
    assert (total < 0).any() and (total > 0).any()  # both sides of the relu
    np.testing.assert_array_equal(mine, want)  # NaN where neither wrote
    assert np.isfinite(want).sum() == batch * nrows


@pytest.mark.parametrize("pattern", ["*-*-", "-*-*--*", "***-", "-**-*"])
def test_kv_slot_is_the_programs_cache_slot(pattern):
    """spec.kv_slot (the kernel's QKV store and attention reads) against the program's buffer
    plan, which gives the attention layers the cache slots in order; dense builds: slot =
    layer."""
    from megakernel.layers.base import StepShape
    from megakernel.program.buffers import plan_buffers

    kinds = {"*": "attention", "-": "mlp"}
    cfg = preset("nemotron-h-attn-tiny").replace(layer_types=tuple(kinds[c] for c in pattern))
    spec = make_spec(cfg, 1, 1, "sm_90a")
    plan = plan_buffers(cfg, StepShape(1, 1, 64, 1, 4, 0))
    assert spec.kv_layers == len(plan.kv_slot) == plan.kv_shape[0]
    assert {layer: kv_slot(layer, spec.attn_layers) for layer in plan.kv_slot} == plan.kv_slot
    dense = make_spec(preset("llama-tiny"), 1, 1, "sm_90a")
    assert [kv_slot(layer, dense.attn_layers) for layer in range(dense.layers)] == list(
        range(dense.layers))


def test_tensor_core_builds_hold_the_merge_buffer():
    """The tensor-core partial (attention_mma.py) takes its warps' merge buffer from the start of
    the consumers' span, below the flag word: it fits every such build of the dense and hybrid
    presets' attention (B, T up to the tile's 16 queries and the large batches)."""
    from megakernel.kernel.device.attention_mma import merge_buffer_bytes
    from megakernel.kernel.host.limits import MMA_M

    seen = set()
    for model in ("llama-tiny", "qwen3-tiny", "llama-3.2-1b", "qwen3-0.6b", "qwen3-8b",
                  "nemotron-h-8b", "qwen2.5-0.5b"):
        cfg = preset(model)
        for b, t in ((1, 1), (2, 1), (8, 1), (1, 4), (4, 4), (1, 8), (64, 1), (256, 1)):
            spec = make_spec(cfg, b, t, "sm_90a")
            if spec.attn_tensor_cores:
                seen.add((spec.head_dim, spec.attn_queries > 8))
                assert spec.attn_queries <= MMA_M
                assert merge_buffer_bytes(spec.head_dim) <= spec.smem_regions()["flag"][0], (
                    model, b, t)
    assert {(64, False), (64, True), (128, False)} <= seen
