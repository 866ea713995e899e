"""Tensor parallelism on the CPU executor: tp ranks, each an `Executor` of its shard
(program/tp.py) with its own arenas and race detector, run step by step over shared peer buffers
(docs/TP.md).

The ranks run one program (their shards have one shape) on different weights. Four opcodes differ
from the single-rank executor, as the kernel's epilogues would:
- EMBED: each rank gathers the rows of its vocabulary slice (zeros for other tokens) and the
  all-reduce sums them: every rank gets the embedding, exactly;
- OPROJ, DOWN: each slab's product is a partial sum of h; the all-reduce adds the ranks'
  partials in rank order to h, so every rank holds the same bits of h;
- ARGMAX: each rank merges its LM-head slabs (logits of its V/tp rows) into a (max, global
  index) per row, and the all-reduce's merge picks the largest, the lowest index among equal
  maxima, as the single-rank ARGMAX does.
The all-reduce: a rank publishes its partial of instruction (SM, position) in a peer slot with a
flag = step epoch + 1 (a release store), then spins (`BLOCKED`) until every rank's flag for that
slot reaches the epoch, and sums the peers' partials in rank order. Slots alternate with the
epoch's parity: a rank one step ahead cannot overwrite a partial a peer has yet to read. The SMs
of all ranks interleave in one seeded order; a stall of every rank is a `DeadlockError`.
Not modelled: the interconnect's latency and bandwidth, memory ordering of real peer stores.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import torch

from megakernel.executor.core import BLOCKED, DeadlockError, Executor, ExecutorError
from megakernel.executor.ops.frame import best_of, store_tokens
from megakernel.program import tp as shard

__all__ = ["PeerBuffers", "TPGroup"]


class PeerBuffers:
    """What ranks see of each other: per (rank, instruction, epoch parity) a partial and its flag
    (the epoch it was published at, + 1)."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.data: dict[tuple, torch.Tensor] = {}
        self.flag: dict[tuple, int] = {}
        self.published = 0  # partials published so far: progress a spinning rank may wait for

    def publish(self, rank: int, key: tuple, epoch: int, t: torch.Tensor) -> None:
        self.data[rank, key, epoch % 2] = t.clone()
        self.flag[rank, key, epoch % 2] = epoch + 1  # release: data first, then the flag
        self.published += 1

    def gather(self, key: tuple, epoch: int) -> list[torch.Tensor] | None:
        """Every rank's partial of `key` at `epoch`, in rank order; None while one is missing."""
        slots = [(r, key, epoch % 2) for r in range(self.tp)]
        if any(self.flag.get(s) != epoch + 1 for s in slots):
            return None
        return [self.data[s] for s in slots]


def rank_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The partials summed in rank order: the same bits on every rank."""
    return functools.reduce(torch.add, parts)


def all_reduce(ex: Executor, epoch: int, partial: Callable[[], torch.Tensor],
               merge: Callable[[list[torch.Tensor]], torch.Tensor] = rank_sum) -> object:
    """`merge` of every rank's `partial()` (computed once per rank and step) for the current
    instruction; BLOCKED until every rank's partial is published."""
    group, rank, key = ex.tp_group, ex.tp_rank, ex.cur
    if key not in group.published[rank]:
        group.peers.publish(rank, key, epoch, partial())
        group.published[rank].add(key)
    parts = group.peers.gather(key, epoch)
    if parts is None:
        return BLOCKED
    group.published[rank].discard(key)
    return merge(parts)


def embed(ex: Executor, d: dict, epoch: int) -> object:
    """h[N0:N1] = embedding[tokens_in[N0:N1]], each rank gathering its vocabulary slice."""
    n0, n1, k, rows = d["N0"], d["N1"], d["K"], ex.prog.rows

    def partial() -> torch.Tensor:
        toks = ex.read("i32", d["TOK_OFF"], (rows,), slice(n0, n1), scratch=False).long()
        local = toks - ex.tp_vocab.start
        mine = (local >= 0) & (local < ex.cfg.vocab_size)
        emb = ex.weights[d["W"] : d["W"] + ex.cfg.vocab_size * k].view(-1, k)
        return torch.where(mine[:, None], emb[local.clamp(0, ex.cfg.vocab_size - 1)].float(),
                           0.0)

    total = all_reduce(ex, epoch, partial)
    if total is BLOCKED:
        return BLOCKED
    ex.write("f32", d["OUT_OFF"], (rows, k), slice(n0, n1), total)
    return None


def residual(ex: Executor, d: dict, epoch: int) -> object:
    """OPROJ, DOWN: h[:, ROW0 : ROW0 + NROWS] += the ranks' partial products, summed."""
    total = all_reduce(ex, epoch, lambda: ex.matvec(d))
    if total is BLOCKED:
        return BLOCKED
    n, h = ex.prog.rows, ex.cfg.hidden_size
    cols = (slice(None), slice(d["ROW0"], d["ROW0"] + d["NROWS"]))
    ex.write("f32", d["OUT_OFF"], (n, h), cols, ex.read("f32", d["OUT_OFF"], (n, h), cols) + total)
    return None


def argmax(ex: Executor, d: dict, epoch: int) -> object:
    """The vocab-parallel argmax: this rank's (max, global index) per row, merged across ranks."""
    p = ex.prog

    def partial() -> torch.Tensor:  # [N, 2]
        parg = ex.read("f32", d["PARG_OFF"], (p.num_sms, p.rows, 2), slice(0, d["N_TILES"]))
        best = best_of(parg)
        best[:, 1] += ex.tp_vocab.start
        return best

    best = all_reduce(ex, epoch, partial, lambda parts: best_of(torch.stack(parts)))
    if best is BLOCKED:
        return BLOCKED
    store_tokens(ex, d, best[:, 1].to(torch.int32))
    return None


TP_OPS = {"EMBED": embed, "OPROJ": residual, "DOWN": residual, "ARGMAX": argmax}


class TPGroup:
    """tp executors of one dense model's shards over shared peer buffers, stepped together."""

    def __init__(self, cfg, weights: dict[str, torch.Tensor], tp: int, prog,  # noqa: ANN001
                 check: bool = True) -> None:
        """`prog`: the program of `shard.shard_config(cfg, tp)` every rank runs."""
        from megakernel.program.pack import pack_weights

        if prog.cfg != shard.shard_config(cfg, tp):
            raise ExecutorError("the program is not of this model's tensor-parallel shard")
        self.cfg, self.tp = cfg, tp
        self.peers = PeerBuffers(tp)
        self.published: list[set] = [set() for _ in range(tp)]
        self.ranks: list[Executor] = []
        for r in range(tp):
            ex = Executor(prog, pack_weights(prog.cfg, shard.shard_weights(cfg, weights, tp, r)),
                          check)
            ex.ops = {**ex.ops, **TP_OPS}
            ex.tp_group, ex.tp_rank = self, r
            ex.tp_vocab = shard.vocab_slice(cfg, tp, r)
            ex.vocab_size = cfg.vocab_size  # token ids are global
            self.ranks.append(ex)

    def load_cache(self, cache) -> None:  # noqa: ANN001 (reference.Cache)
        for r, ex in enumerate(self.ranks):
            ex.load_cache(shard.shard_cache(self.cfg, cache, self.tp, r))

    @property
    def logits(self) -> torch.Tensor:
        """[N, V] the ranks' logits side by side (vLLM's gather of a parallel LM head)."""
        return torch.cat([ex.logits for ex in self.ranks], dim=-1)

    @property
    def lengths(self) -> torch.Tensor:
        return self.ranks[0].lengths

    def step(self, tokens: torch.Tensor | None = None, seed: int = 0) -> torch.Tensor:
        """One step of every rank, their SMs interleaved in one seeded order; tokens_out [B, T]
        (every rank's must agree)."""
        gens = [ex.stepper(tokens, seed * self.tp + r) for r, ex in enumerate(self.ranks)]
        rng, live, stalls, seen = random.Random(seed), set(range(self.tp)), {}, -1
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            while live:
                cand = sorted(live - stalls.keys())
                if not cand:
                    raise DeadlockError("\n".join(f"rank {r}: {stalls[r]()}" for r in stalls))
                r = rng.choice(cand)
                try:
                    out = next(gens[r])
                except StopIteration:
                    live.discard(r)
                    out = None
                if out is None or self.peers.published != seen:
                    stalls.clear()  # progress (an instruction, a partial): stalled ranks may go on
                    seen = self.peers.published
                if out is not None:
                    stalls[r] = out
        finally:
            torch.set_num_threads(threads)
        outs = [ex.tokens_out for ex in self.ranks]
        if any(not torch.equal(o, outs[0]) for o in outs):
            raise ExecutorError(f"ranks disagree on the tokens: {[o.tolist() for o in outs]}")
        p = self.ranks[0].prog
        return outs[0].view(p.batch, p.tokens).to(torch.int64)
