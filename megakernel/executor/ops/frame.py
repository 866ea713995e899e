"""EMBED, the residual projections (OPROJ, DOWN), PROJ, LMHEAD and ARGMAX (layers/frame.py);
ACCEPT and NGRAM (layers/speculative.py)."""

from __future__ import annotations

import torch

from megakernel import isa
from megakernel.executor.core import Executor, op
from megakernel.reference.speculative import accepted_count, ngram_propose


@op("EMBED")
def embed(ex: Executor, d: dict, epoch: int) -> None:
    n0, n1, k, rows = d["N0"], d["N1"], d["K"], ex.prog.rows
    toks = ex.read("i32", d["TOK_OFF"], (rows,), slice(n0, n1), scratch=False)
    emb = ex.weights[d["W"] : d["W"] + ex.cfg.vocab_size * k].view(-1, k)
    ex.write("f32", d["OUT_OFF"], (rows, k), slice(n0, n1), emb[toks.long()].float())


@op("OPROJ")
@op("DOWN")
def residual(ex: Executor, d: dict, epoch: int) -> None:
    """h[:, ROW0 : ROW0 + NROWS] += the slab's output (fp32)."""
    acc = ex.matvec(d)
    n, h = ex.prog.rows, ex.cfg.hidden_size
    cols = (slice(None), slice(d["ROW0"], d["ROW0"] + d["NROWS"]))
    cur = ex.read("f32", d["OUT_OFF"], (n, h), cols)
    ex.write("f32", d["OUT_OFF"], (n, h), cols, cur + acc)


@op("PROJ")
def proj(ex: Executor, d: dict, epoch: int) -> None:
    r0 = d["ROW0"]
    ex.write("f32", d["OUT_OFF"], (ex.prog.rows, d["OUT_W"]),
             (slice(None), slice(r0, r0 + d["NROWS"])), ex.matvec(d))


@op("LMHEAD")
def lmhead(ex: Executor, d: dict, epoch: int) -> None:
    """Logits of the slab's rows below V (padded rows are neither stored nor candidates) and the
    slab's (max, lowest index of the max)."""
    acc = ex.matvec(d)
    n, v, r0 = ex.prog.rows, ex.cfg.vocab_size, d["ROW0"]
    real = max(0, min(d["NROWS"], v - r0))
    acc = acc[:, :real]
    ex.write("f32", d["OUT_OFF"], (n, v), (slice(None), slice(r0, r0 + real)), acc)
    if real:
        best, idx = acc.max(dim=-1)  # first index of the max
    else:  # a slab of padding only: never wins
        best = torch.full((n,), float("-inf"))
        idx = torch.zeros(n, dtype=torch.int64)
    ex.write("f32", d["PARG_OFF"], (ex.prog.num_sms, n, 2), d["TILE"],
             torch.stack((best, (idx + r0).float()), dim=-1))


def best_of(parts: torch.Tensor) -> torch.Tensor:
    """[P, N, 2] partial (max, vocab index) -> [N, 2] the largest; equal maxima go to the lowest
    index, whatever the order of the partials."""
    vals, idxs = parts[..., 0], parts[..., 1]
    best = vals.amax(dim=0)
    cand = torch.where(vals == best, idxs, torch.full_like(idxs, float("inf")))
    return torch.stack((best, cand.amin(dim=0)), dim=-1)


@op("ARGMAX")
def argmax(ex: Executor, d: dict, epoch: int) -> None:
    p = ex.prog
    parg = ex.read("f32", d["PARG_OFF"], (p.num_sms, p.rows, 2), slice(0, d["N_TILES"]))
    store_tokens(ex, d, best_of(parg)[:, 1].to(torch.int32))


def store_tokens(ex: Executor, d: dict, tok: torch.Tensor) -> None:
    """ARGMAX's stores: tokens_out [N] = tok; lengths advanced, tokens fed back (FLAGS)."""
    p, n = ex.prog, ex.prog.rows
    ex.write("i32", d["OUT_OFF"], (n,), slice(None), tok)
    if d["FLAGS"] & isa.FLAG_ADVANCE:
        ln = ex.read("i32", d["LEN_OFF"], (p.batch,), slice(None), scratch=False)
        ex.write("i32", d["LEN_OFF"], (p.batch,), slice(None), ln + p.tokens)
    if d["FLAGS"] & isa.FLAG_FEEDBACK:
        ex.write("i32", d["TOK_OFF"], (n,), slice(None), tok)


@op("ACCEPT")
def accept(ex: Executor, d: dict, epoch: int) -> None:
    """The speculative step's end (layers/speculative.py): greedy tokens, accepted drafts,
    emitted tokens, history, lengths and the bonus fed back."""
    p = ex.prog
    b, t, s_max = p.batch, p.tokens, p.max_seq_len
    parg = ex.read("f32", d["PARG_OFF"], (p.num_sms, p.rows, 2), slice(0, d["N_TILES"]))
    greedy = best_of(parg)[:, 1].to(torch.int32)
    ex.write("i32", d["OUT_OFF"], (p.rows,), slice(None), greedy)
    toks = ex.read("i32", d["TOK_OFF"], (p.rows,), slice(None), scratch=False).view(b, t)
    lens = ex.read("i32", d["LEN_OFF"], (b,), slice(None), scratch=False)
    g = greedy.view(b, t)
    acc = accepted_count(toks[:, 1:], g)
    emit = torch.minimum(acc + 1, (s_max - t - lens.long()).clamp(min=0)).to(torch.int32)
    for i in range(b):
        e, n = int(emit[i]), int(lens[i])
        if e:
            bonus = g[i, e - 1]
            row = torch.cat((toks[i, :e], bonus[None]))
            ex.write("i32", d["HIST_OFF"], (b, s_max), (i, slice(n, n + e + 1)), row)
            ex.write("i32", d["TOK_OFF"], (p.rows,), slice(i * t, i * t + 1), bonus[None])
    ex.write("i32", d["EMIT_OFF"], (b,), slice(None), emit)
    ex.write("i32", d["LEN_OFF"], (b,), slice(None), lens + emit)


@op("NGRAM")
def ngram(ex: Executor, d: dict, epoch: int) -> None:
    """Drafts of sequences [B0, B1) by prompt lookup (reference/speculative.ngram_propose)."""
    p = ex.prog
    b, t, s_max = p.batch, p.tokens, p.max_seq_len
    for i in range(d["B0"], d["B1"]):
        m = int(ex.read("i32", d["LEN_OFF"], (b,), slice(i, i + 1), scratch=False)) + 1
        hist = ex.read("i32", d["HIST_OFF"], (b, s_max), (i, slice(0, m)), scratch=False)
        drafts = ngram_propose(hist.tolist(), t - 1, d["N_MAX"])
        ex.write("i32", d["TOK_OFF"], (p.rows,), slice(i * t + 1, (i + 1) * t),
                 torch.tensor(drafts, dtype=torch.int32))
