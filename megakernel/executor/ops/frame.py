"""EMBED, the residual projections (OPROJ, DOWN), PROJ, LMHEAD and ARGMAX (layers/frame.py)."""

from __future__ import annotations

import torch

from megakernel import isa
from megakernel.executor.core import Executor, op


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
