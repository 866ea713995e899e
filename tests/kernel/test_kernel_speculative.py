"""Host emulations of the speculative step's device handlers, run with their own index helpers
(kernel/host/speculative_index.py, commit_index.py and the kinds' *_index.py), against the truth:

- NGRAM (kernel/device/speculative.py): every thread's candidate scan, the warps' butterfly
  maxima, the shared-memory words and the drafts, against reference/speculative.ngram_propose on
  random and adversarial histories (repetitions, ties between positions, no match, m = 1, a
  record N_MAX below the build's); planted bugs in the keys and limits are caught by the same cases.
- ACCEPT (kernel/device/megakernel.py): the merge a lane per tile and a warp per row (ties to
  the lowest index), then the per-sequence accept logic, against the op's notes (executor best_of,
  reference accepted_count) with every accepted count 0..k and sequences at the cache's end.
- the COMMIT handlers (kernel/device/commit.py): window, pending and ring offsets against the
  executor's state layout, and the commit of the last recurrent layer (window shift, count,
  fold of the n + e entries in the REPLAY handler's order) on the state the executor's REPLAY
  records left, against the executor's COMMIT, for GDN, KDA and Mamba2 and every e in 0..T.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from megakernel import isa
from megakernel.common.errors import SpecError
from megakernel.executor import Executor, executor_gpu
from megakernel.executor.ops.frame import best_of
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host.commit_index import shift_source
from megakernel.kernel.host.speculative_index import LANES, AcceptShape, NgramShape
from megakernel.layers import kind
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights
from megakernel.reference.speculative import accepted_count, ngram_propose
from tests.kernel.helpers import last_records

F = np.float32
NT = 256


# ---- NGRAM --------------------------------------------------------------------------------------
def emulate_ngram(g: NgramShape, hist: list[int], n_max: int) -> list[int]:
    """One sequence of an NGRAM record as the handler runs it: NT threads scan, a butterfly max
    per warp, the warps' words in shared memory, every thread's max, threads i < k draft."""
    m = len(hist)
    keys = np.zeros(g.num_threads, dtype=np.int64)
    for tidx in range(g.num_threads):
        suffix = [hist[max(g.compare(0, m, i)[1], 0)] for i in range(g.n_max)]
        key = 0
        for p in range(*g.candidates(tidx, m)):
            limit, length, alive = g.limit(p, n_max), 0, 1
            for i in range(g.n_max):
                if i < limit:
                    at, _ = g.compare(p, m, i)
                    alive &= int(hist[at] == suffix[i])
                    length += alive
            key = max(key, g.key(length, p, m))
        keys[tidx] = key
    part = np.zeros(2 * g.num_warps, dtype=np.int64)
    for warp in range(g.num_warps):
        lanes = keys[warp * LANES : (warp + 1) * LANES].copy()
        for s in range(5):  # shuffle_sync_bfly
            lanes = np.maximum(lanes, lanes[np.arange(LANES) ^ (1 << s)])
        assert (lanes == lanes[0]).all()
        part[g.part(0, warp)] = lanes[0]
    best = max(part[g.part(0, w)] for w in range(g.num_warps))
    matched, p = g.source(int(best), m)
    if not matched:
        p = m - 1
    return [hist[g.draft(p, m, i)] for i in range(g.drafts)]


def ngram_cases() -> list[tuple[list[int], int, int]]:
    """(history, k, n_max): random over small vocabularies (many repeats), and adversarial."""
    rng = np.random.default_rng(3)
    out = [([5], 3, 3), ([5, 5], 3, 3), ([1, 2], 4, 3), ([7] * 40, 7, 3), ([1, 2, 3] * 9, 5, 3),
           ([1, 2, 3, 1, 2, 4, 1, 2], 3, 3), ([9, 1, 2, 8, 1, 2, 7, 1, 2], 3, 2),
           ([4, 5, 6, 7, 4, 5, 6, 7, 4, 5], 7, 1), ([3, 1, 3, 2, 3], 2, 3), (list(range(30)), 3, 3),
           ([1, 2, 3, 4, 9, 2, 3, 4, 8, 3, 4, 1, 2, 3, 4], 4, 3), ([2, 2, 1, 2, 2, 2], 6, 8)]
    out.append(([int(x) for x in rng.integers(0, 3, 600)], 7, 3))  # more candidates than threads
    for _ in range(60):
        m = int(rng.integers(1, 80))
        out.append(([int(x) for x in rng.integers(0, int(rng.integers(2, 6)), m)],
                    int(rng.integers(1, 8)), int(rng.integers(1, 5))))
    return out


@pytest.mark.parametrize("build_n", [3, 8])
def test_ngram_emulation_matches_the_reference(build_n):
    """The build's n_max (the suffix registers) and the record's N_MAX (<= it) differ too."""
    for hist, k, n in ngram_cases():
        n = min(n, build_n)
        g = NgramShape(NT, k, build_n)
        assert emulate_ngram(g, hist, n) == ngram_propose(hist, k, n), (hist, k, n)


class _Recency(NgramShape):  # most recent match of any length first
    @staticmethod
    def key(length, p, m):
        return p * 100 + length if length else p


class _Oldest(NgramShape):  # the earliest position of the longest match
    @staticmethod
    def key(length, p, m):
        return length * m + (m - p) if length else 0


class _Unbounded(NgramShape):  # comparisons past the history's start (p < n)
    @staticmethod
    def limit(p, n_max, minimum=min):
        return n_max

    @staticmethod
    def compare(p, m, i):
        return (p - 1 - i) % m, m - 1 - i


class _NoPeriod(NgramShape):  # drafts past the history's end clamped, not repeated
    @staticmethod
    def draft(p, m, i):
        return min(p + i, m - 1)


@pytest.mark.parametrize("bug", [_Recency, _Oldest, _Unbounded, _NoPeriod])
def test_ngram_cases_catch_planted_bugs(bug):
    bad = [(h, k, n) for h, k, n in ngram_cases()
           if emulate_ngram(bug(NT, k, 8), h, n) != ngram_propose(h, k, n)]
    assert bad, f"{bug.__name__} passes every case"


# ---- ACCEPT -------------------------------------------------------------------------------------
def emulate_accept(a: AcceptShape, parg: np.ndarray, toks: np.ndarray, lens: np.ndarray,
                   hist: np.ndarray, s_max: int, low_ties: bool = True) -> tuple[np.ndarray, ...]:
    """ACCEPT as the handler runs it on flat arrays (parg [tiles * N * 2] fp32, tokens_in [N],
    lengths [B], history [B * S_max], all updated); returns (tokens_out, emitted)."""
    tiles = parg.size // (a.rows * 2)
    out = np.zeros(a.rows, dtype=np.int64)
    for n in range(a.rows):  # a warp per row: a lane per tile, then the butterfly
        best = np.full(LANES, -np.inf, dtype=F)
        bidx = np.full(LANES, 0x7FFFFFFF, dtype=np.int64)
        for lane in range(LANES):
            for tile in range(lane, tiles, LANES):
                v, i = parg[a.parg(tile, n, 0)], int(parg[a.parg(tile, n, 1)])
                if v > best[lane] or (v == best[lane] and (i < bidx[lane]) == low_ties):
                    best[lane], bidx[lane] = v, i
        for s in range(5):
            ov, oi = best[np.arange(LANES) ^ (1 << s)], bidx[np.arange(LANES) ^ (1 << s)]
            take = (ov > best) | ((ov == best) & ((oi < bidx) == low_ties) & (oi != bidx))
            best, bidx = np.where(take, ov, best), np.where(take, oi, bidx)
        out[n] = bidx[0]
    emitted = np.zeros(a.batch, dtype=np.int64)
    for b in range(a.batch):  # a thread per sequence
        g = [out[a.row(b, t)] for t in range(a.tokens)]
        x = [int(toks[a.row(b, t)]) for t in range(a.tokens)]
        length, acc, alive = int(lens[b]), 0, 1
        for t in range(a.drafts):
            alive &= int(x[t + 1] == g[t])
            acc += alive
        e = a.emitted(acc, length, s_max)
        bonus = x[0]
        for t in range(a.tokens):
            if t < e:
                hist[a.hist(b, length + t, s_max)] = x[t]
            if t == e - 1:
                bonus = g[t]
        if e > 0:
            hist[a.hist(b, length + e, s_max)] = bonus
            toks[a.row(b, 0)] = bonus
        emitted[b] = e
        lens[b] = length + e
    return out, emitted


def accept_truth(a: AcceptShape, parg: np.ndarray, toks: np.ndarray, lens: np.ndarray,
                 hist: np.ndarray, s_max: int) -> tuple[np.ndarray, ...]:
    """The ACCEPT notes (layers/speculative.py) with the executor's merge and the reference's
    accepted count."""
    greedy = best_of(torch.from_numpy(parg).view(-1, a.rows, 2))[:, 1].long()
    g, x = greedy.view(a.batch, a.tokens), torch.from_numpy(toks.copy()).view(a.batch, a.tokens)
    acc = accepted_count(x[:, 1:], g)
    emitted = np.zeros(a.batch, dtype=np.int64)
    for b in range(a.batch):
        n = int(lens[b])
        e = min(int(acc[b]) + 1, max(0, s_max - a.tokens - n))
        if e:
            hist[b * s_max + n : b * s_max + n + e] = x[b, :e].numpy()
            hist[b * s_max + n + e] = toks[b * a.tokens] = int(g[b, e - 1])
        emitted[b], lens[b] = e, n + e
    return greedy.numpy(), emitted


def accept_case(batch: int, k: int, tiles: int, seed: int):  # noqa: ANN201
    """Partials with many equal maxima (a small value range), drafts that match the greedy
    tokens for a chosen count per sequence, lengths from 0 to the cache's end."""
    rng = np.random.default_rng(seed)
    a, s_max = AcceptShape(batch, 1 + k, 8), 24
    parg = np.zeros(tiles * a.rows * 2, dtype=F)
    for tile in range(tiles):
        for n in range(a.rows):
            parg[a.parg(tile, n, 0)] = F(rng.integers(0, 3))
            parg[a.parg(tile, n, 1)] = F(tile * 16 + int(rng.integers(0, 16)))
    greedy = best_of(torch.from_numpy(parg).view(tiles, a.rows, 2))[:, 1].long().numpy()
    toks = rng.integers(0, tiles * 16, a.rows)
    for b in range(batch):
        want = int(rng.integers(0, k + 1))
        for t in range(want):
            toks[a.row(b, t + 1)] = greedy[a.row(b, t)]
    lens = rng.integers(0, s_max - 2 * a.tokens, batch)
    lens[seed % batch] = s_max - a.tokens - seed % 3  # full (emits nothing), room for 1 or 2
    return a, parg, toks.astype(np.int64), lens.astype(np.int64), s_max


@pytest.mark.parametrize("batch,k,tiles", [(1, 3, 5), (4, 7, 70), (6, 1, 33), (3, 3, 100)])
def test_accept_emulation_matches_the_notes(batch, k, tiles):
    seen = set()
    for seed in range(12):
        a, parg, toks, lens, s_max = accept_case(batch, k, tiles, seed)
        hist = np.full(batch * s_max, -1, dtype=np.int64)
        mine = emulate_accept(a, parg, toks.copy(), l1 := lens.copy(), h1 := hist.copy(), s_max)
        want = accept_truth(a, parg, t2 := toks.copy(), l2 := lens.copy(), h2 := hist.copy(),
                            s_max)
        np.testing.assert_array_equal(mine[0], want[0])
        np.testing.assert_array_equal(mine[1], want[1])
        np.testing.assert_array_equal(l1, l2)
        np.testing.assert_array_equal(h1, h2)
        t1 = toks.copy()
        emulate_accept(a, parg, t1, lens.copy(), hist.copy(), s_max)
        np.testing.assert_array_equal(t1, t2)
        seen |= set(want[1].tolist())
    assert 0 in seen and len(seen) >= min(k + 1, 3), seen


def test_accept_cases_catch_ties_to_the_highest_index():
    a, parg, toks, lens, s_max = accept_case(4, 7, 70, 0)
    hist = np.zeros(4 * s_max, dtype=np.int64)
    got = emulate_accept(a, parg, toks.copy(), lens.copy(), hist.copy(), s_max, low_ties=False)
    want = accept_truth(a, parg, toks.copy(), lens.copy(), hist.copy(), s_max)
    assert not np.array_equal(got[0], want[0])


# ---- COMMIT -------------------------------------------------------------------------------------
KINDS = {"gdn": "qwen3.5-tiny", "kda": "kimi-linear-tiny", "mamba2": "nemotron-h-tiny"}
WINDOW, K = 4, 3


def spec_program(name: str, batch: int):  # noqa: ANN201
    cfg = preset(name)
    prog = compile_program(cfg, batch, executor_gpu(8), tokens=1 + K, max_seq_len=64,
                           replay_window=WINDOW, drafts=K)
    return cfg, prog


@pytest.mark.parametrize("name", sorted(KINDS))
def test_commit_offsets_match_the_state_layout(name):
    """window, ring and pending offsets of the kind's index shape against its state() layout
    with `pending` (what executor/ops/recurrent.state_views reads), for every (b, chan, t)."""
    cfg, prog = spec_program(KINDS[name], 2)
    spec = make_spec(cfg, 2, 1, "sm_90a", replay_window=WINDOW, drafts=K)
    assert spec.tokens == 1 + K and spec.ring_cap == prog.buffers.ring_cap
    assert prog.header["DRAFTS"] == spec.drafts and prog.header["NGRAM"] == spec.ngram
    sh, kd = spec.shape(name), kind(name)
    blk = next(b for b in cfg.blocks if b.kind == name)
    views, off = {}, 0
    for part, shape in kd.state(blk, cfg, 2, prog.buffers.ring_cap, prog.tokens):
        views[part] = (off, shape)
        off += math.prod(shape)
    p0, pshape = views["pending"]
    assert sh.ring_end() == p0 and pshape == (2, kd.conv_dim(blk.cfg), 1 + K)
    for b in range(2):
        for chan in range(pshape[1]):
            for t in range(pshape[2]):
                assert sh.pending(b, chan, t) == p0 + (b * pshape[1] + chan) * pshape[2] + t
            for j in range(blk.cfg.conv_kernel - 1):
                assert sh.window(b, chan, j) == views["conv"][0] + np.ravel_multi_index(
                    (b, chan, j), views["conv"][1])


def test_shift_source_is_the_executor_window_shift():
    """Value j of the committed window: the last K - 1 of [window | pending[:e]]."""
    for win in (1, 2, 3):
        for e in range(0, 9):
            u = [("w", i) for i in range(win)] + [("p", t) for t in range(e)]
            for j in range(win):
                at_p, at_w = shift_source(e, j, win)
                assert u[-win:][j] == (("p", at_p) if at_p >= 0 else ("w", at_w))


def commit_records(cfg, prog, name: str):  # noqa: ANN001, ANN201
    layer = max(b.layer for b in cfg.blocks if b.kind == name)
    op = kind(name).commit_op
    return layer, last_records(prog, layer, op)


def emulate_window(sh, d: dict, unit: int, e: int, S: np.ndarray) -> None:  # noqa: ANN001
    """Step 1: a thread per channel, every load before the stores."""
    b, st0 = d["B_IDX"], d["STATE"]
    for c in range(sh.ch):
        chan = sh.channel(c, unit)
        vals = []
        for j in range(sh.win):
            at_p, at_w = shift_source(e, j, sh.win)
            vals.append(S[st0 + (sh.pending(b, chan, at_p) if at_p >= 0
                                 else sh.window(b, chan, at_w))])
        for j, v in enumerate(vals):
            S[st0 + sh.window(b, chan, j)] = v


def emulate_delta_fold(sh, d: dict, unit: int, ne: int, S: np.ndarray, channel: bool) -> None:  # noqa: ANN001
    """GDN_COMMIT / KDA_COMMIT's fold in the REPLAY handler's order (fold_tile)."""
    b, st0 = d["B_IDX"], d["STATE"]
    keys = np.array([[S[st0 + sh.ring_k(b, e, unit, i)] for i in range(sh.dk)]
                     for e in range(ne)], dtype=F)
    for r in range(sh.rep):
        h = unit * sh.rep + r
        st = np.array([[S[st0 + sh.state(b, h, i, j)] for j in range(sh.dv)]
                       for i in range(sh.dk)], dtype=F)
        u = np.array([[S[st0 + sh.ring_u(b, e, h, j)] for j in range(sh.dv)]
                      for e in range(ne)], dtype=F)
        if channel:
            gs = np.array([[S[st0 + sh.ring_g(b, e, h, i)] for i in range(sh.d)]
                           for e in range(ne)], dtype=F)
            tot = np.exp(sum((gs[e] for e in range(ne)), np.zeros(sh.d, F)), dtype=F)
            reg = tot[:, None] * st
            for e in range(ne):
                seg = sum((gs[ee] for ee in range(e + 1, ne)), np.zeros(sh.d, F))
                reg = reg + (np.exp(seg, dtype=F) * keys[e])[:, None] * u[e][None, :]
        else:
            gs = np.array([S[st0 + sh.ring_g(b, e, h)] for e in range(ne)], dtype=F)
            tot = F(0.0)
            for e in range(ne):
                tot = F(tot + gs[e])
            reg, seg = st * np.exp(tot, dtype=F), F(0.0)
            for e in range(ne - 1, -1, -1):
                reg = reg + keys[e][:, None] * (np.exp(seg, dtype=F) * u[e])[None, :]
                seg = F(seg + gs[e])
        for i in range(sh.dk):
            for j in range(sh.dv):
                S[st0 + sh.state(b, h, i, j)] = reg[i, j]


def emulate_mamba_fold(sh, d: dict, j: int, ne: int, S: np.ndarray, F32: np.ndarray) -> None:  # noqa: ANN001
    """MAMBA_COMMIT's fold (commit_ring, fold_weights, fold_tile's order)."""
    b, st0, R, N = d["B_IDX"], d["STATE"], sh.rep, sh.state_size
    a = -np.exp(F32[d["PARAM_OFF"] + j * R : d["PARAM_OFF"] + (j + 1) * R], dtype=F)
    dt = np.array([[S[st0 + sh.ring_dt(b, e, j, r)] for r in range(R)] for e in range(ne)], F)
    lam = (a[None, :] * dt).astype(F)
    bs = np.array([[S[st0 + sh.ring_b(b, e, j, c)] for c in range(N)] for e in range(ne)], F)

    def lam_sum(first: int, last: int) -> np.ndarray:
        s = np.zeros(R, F)
        for q in range(first, last + 1):
            s = (s + lam[q]).astype(F)
        return s

    decay = np.exp(lam_sum(0, ne - 1), dtype=F)
    wf = np.array([dt[e] * np.exp(lam_sum(e + 1, ne - 1), dtype=F) for e in range(ne)], F)
    for row in range(sh.rows):
        r = row // sh.head_dim
        s = np.array([S[st0 + sh.state(b, j, row, c)] for c in range(N)], F) * decay[r]
        for e in range(ne):
            s = s + S[st0 + sh.ring_x(b, e, j, row)] * (wf[e, r] * bs[e])
        for c in range(N):
            S[st0 + sh.state(b, j, row, c)] = s[c]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_commit_emulation_matches_the_executor(name):
    """Speculative steps of the last `name` layer with emitted[b] forced to every value 0..T in
    turn (before the COMMIT records run: the state the REPLAY records left is the emulation's
    input); the layer's block (window, state, ring, pending) and ring counts after the step
    against the executor's: the window and counts exactly, the state within fp32 rounding;
    steps with and without a fold."""
    batch, T = 2, 1 + K
    cfg, prog = spec_program(KINDS[name], batch)
    spec = make_spec(cfg, batch, 1, "sm_90a", replay_window=WINDOW, drafts=K)
    sh = spec.shape(name)
    assert isa.spec(kind(name).commit_op).handler and kind(name).commit_op in spec.ops
    ex = Executor(prog, pack_weights(cfg, random_weights(cfg, seed=5)), check=False)
    ex.state.zero_()
    layer, recs = commit_records(cfg, prog, name)
    unit_name = kind(name).unit_name
    assert len(recs) == batch * kind(name).units(cfg.kind_config(name))
    emit = prog.buffers.i32["emitted"].offset
    blk = prog.buffers.state[layer]
    lo, hi = blk["conv"].offset, blk["pending"].offset + blk["pending"].numel
    gen = torch.Generator().manual_seed(7)
    folds, seen = 0, set()
    for step in range(9):
        forced = [(step + b) % (T + 1) for b in range(batch)]
        mid = {}
        ops = dict(ex.ops)
        commit_fn = ops[isa.spec(kind(name).commit_op).name]

        def snapshot(ex_, d, epoch, fn=commit_fn, mid=mid, forced=forced):  # noqa: ANN001, ANN202
            if not mid:
                ex_.i32[emit : emit + batch] = torch.tensor(forced, dtype=torch.int32)
                mid["S"], mid["I"] = ex_.state.numpy().copy(), ex_.i32.numpy().copy()
            return fn(ex_, d, epoch)

        ops[isa.spec(kind(name).commit_op).name] = snapshot
        ex.ops = ops
        ex.step(torch.randint(0, cfg.vocab_size, (batch, T), generator=gen))
        S, I32 = mid["S"].astype(F), mid["I"]
        for d in recs:
            unit, e = d[unit_name], int(I32[emit + d["B_IDX"]])
            cnt = d["COUNT_OFF"] + sh.count(d["B_IDX"], unit)
            ne = int(I32[cnt]) + e
            seen.add(e)
            emulate_window(sh, d, unit, e, S)
            if ne >= WINDOW:
                folds += 1
                if name == "mamba2":
                    emulate_mamba_fold(sh, d, unit, ne, S, ex.f32.numpy())
                else:
                    emulate_delta_fold(sh, d, unit, ne, S, name == "kda")
                ne = 0
            I32[cnt] = ne
        theirs = ex.state.numpy()[lo:hi]
        win = slice(blk["conv"].offset - lo, blk["conv"].offset + blk["conv"].numel - lo)
        np.testing.assert_array_equal(S[lo:hi][win], theirs[win], err_msg=f"step {step}")
        np.testing.assert_allclose(S[lo:hi], theirs, rtol=1e-5,
                                   atol=1e-5 * max(1.0, np.abs(theirs).max()),
                                   err_msg=f"step {step}")
        c0 = recs[0]["COUNT_OFF"]
        n_units = len(recs)
        np.testing.assert_array_equal(I32[c0 : c0 + n_units], ex.i32.numpy()[c0 : c0 + n_units])
    assert folds and seen == set(range(T + 1)), (folds, seen)


def test_speculative_spec_checks():
    cfg = preset("qwen3.5-tiny")
    with pytest.raises(SpecError, match="ReplaySSM"):
        make_spec(cfg, 1, 1, "sm_90a", drafts=3)
    with pytest.raises(SpecError, match="1 to"):
        make_spec(preset("llama-tiny"), 1, 9, "sm_90a", drafts=8)
    with pytest.raises(SpecError, match="needs a speculative build"):
        make_spec(preset("llama-tiny"), 1, 1, "sm_90a", ngram=3)
    s = make_spec(preset("llama-tiny"), 2, 1, "sm_90a", drafts=3, ngram=3)
    names = {isa.spec(op).name for op in s.ops}
    assert s.tokens == 4 and {"ACCEPT", "NGRAM"} <= names and "ARGMAX" not in names
    r = make_spec(cfg, 1, 1, "sm_90a", replay_window=16, drafts=1)
    names = {isa.spec(op).name for op in r.ops}
    assert {"ACCEPT", "GDN_REPLAY", "GDN_COMMIT"} <= names and "NGRAM" not in names
    assert dataclasses.replace(r, drafts=0).tag != r.tag
