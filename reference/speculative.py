"""Greedy speculative decoding, the truth: what a verify step accepts, what the n-gram drafter
proposes, and a generation loop over `ReferenceModel.verify` / `commit`.

A speculative step runs T = 1 + k tokens per sequence: the last known token and k drafts. Row t
of the step predicts the token after input t, so draft i (input i + 1) is accepted while every
draft before it was accepted and it equals the greedy token of row i. With a accepted drafts the
step emits a + 1 tokens: the a drafts and the bonus, the greedy token of row a. Greedy
speculative decoding therefore emits exactly the tokens plain greedy decoding would.

The n-gram drafter (prompt lookup) reads a sequence's history (prompt and generated tokens, the
next input last): the longest suffix of up to `n_max` tokens that also occurs earlier, at its most
recent earlier occurrence, proposes the tokens that followed it; past the end of the history the
proposal repeats with the period of the match (a repeating pattern continues). Without a match the
last token is proposed k times.
"""

from __future__ import annotations

import torch

NGRAM_MAX = 3  # the longest suffix the n-gram drafter matches


def accepted_count(drafts: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """drafts [B, k] (inputs 1..k of the step), greedy [B, 1 + k] (the step's greedy tokens) ->
    [B] int64: the number of leading drafts equal to the greedy token of the row before them."""
    k = drafts.shape[1]
    same = (drafts == greedy[:, :k]).to(torch.int64)
    return same.cumprod(dim=1).sum(dim=1)


def ngram_propose(history: list[int], k: int, n_max: int = NGRAM_MAX) -> list[int]:
    """k draft tokens after `history` (module docstring); history ends with the next input."""
    if not history:
        raise ValueError("the n-gram drafter needs at least one token of history")
    length = len(history)
    for n in range(min(n_max, length - 1), 0, -1):
        suffix = history[length - n:]
        for p in range(length - 1, n - 1, -1):  # p: the token after an earlier occurrence
            if history[p - n:p] == suffix:
                period = length - p
                return [history[p + i % period] for i in range(k)]
    return [history[-1]] * k


def generate(model, prompts: list[list[int]], steps: int, k: int,  # noqa: ANN001
             drafts_fn=None, max_seq_len: int | None = None  # noqa: ANN001
             ) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy speculative generation of `steps` new tokens per prompt on a ReplaySSM (or
    attention-only) `ReferenceModel` with k drafts a step: verify 1 + k tokens, commit the
    accepted ones. `drafts_fn(histories, k)` proposes the drafts (default: the n-gram drafter).
    Returns (tokens per prompt, accepted counts per step of the rows still generating).
    Each row is verified on its own (a batch-1 view of the cache), so finished rows stop."""
    from .model import ReferenceError, greedy

    if k < 1:
        raise ReferenceError(f"k must be >= 1 draft tokens, got {k}")
    if model.cached and any(op.state == "recurrent" for op in model.cached.values()) \
            and model.replay_window is None:
        raise ReferenceError("speculative decoding of recurrent layers needs ReplaySSM "
                             "(replay_window)")
    propose = drafts_fn or (lambda hs, kk: [ngram_propose(h, kk) for h in hs])
    b = len(prompts)
    if max_seq_len is None:
        max_seq_len = max(len(p) for p in prompts) + steps + k
    cache = model.new_cache(b, max_seq_len, max_step_tokens=1 + k)
    last = greedy(model.prefill(cache, prompts)).tolist()
    hist = [list(p) + [t] for p, t in zip(prompts, last, strict=True)]
    out = [[t] for t in last]
    acc_log: list[list[int]] = []
    while min(len(o) for o in out) < steps:
        live = [i for i in range(b) if len(out[i]) < steps]  # finished rows are not stepped
        drafts = propose([hist[i] for i in live], k)
        step_acc = []
        for i, d in zip(live, drafts, strict=True):
            seq = cache.row(i)
            tokens = torch.tensor([[last[i], *d]], dtype=torch.int64)
            logits = (model.verify(seq, tokens) if model.replay_window is not None
                      else model._forward(seq, tokens, replay=False, prefill=False))
            g = greedy(logits)[0]
            a = int(accepted_count(tokens[:, 1:], g[None])[0])
            if model.replay_window is not None:
                model.commit(seq, [a])
            else:
                seq.lengths += a + 1
            step_acc.append(a)
            new = g[: a + 1].tolist()
            out[i] += new
            hist[i] += new
            last[i] = new[-1]
        acc_log.append(step_acc)
    return [o[:steps] for o in out], acc_log
