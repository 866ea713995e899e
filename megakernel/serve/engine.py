"""Generation on the program: prefill and decode both run program steps, so the first new token
comes from the same program (CPU executor or kernel) as every later one.

A `Stepper` is one compiled program for B sequences x T tokens with its arenas: `step(tokens)`
consumes tokens [B, T] (None: the tokens the last step fed back) and returns the greedy tokens
[B, T] at those positions. `program_generate` drives one or two of them:

1. chunk (optional, T > 1): every row consumes its prompt T tokens at a time, as far as the
   shortest prompt allows while leaving it at least one token (KV cache and recurrent state written
   as in decode; ReplaySSM takes the chunk as its T);
2. single (T = 1): every row consumes its next prompt token, or once its prompt is exhausted its
   own last new token. The output at a prompt's last token is that row's first new token. Once no
   row has prompt left the program feeds its own tokens back.

Between the two, `copy_state` carries lengths, ring counts, KV cache and recurrent state from the
chunk program's arenas into the single program's. Caches and states start empty.

3. speculative (optional, a program of T = 1 + k with drafts): once every row has its first new
   token the state moves to it; each step verifies a row's last token and k drafts, and the
   device accepts, commits and (with the n-gram drafter) drafts the next ones
   (layers/speculative.py); the host reads `emitted` and the emitted tokens, and writes the
   drafts only when they are its own (`drafts_fn`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

STATE_ARENAS = ("i32", "state", "k", "v")  # what a step carries to the next one
PREFILL_CHUNK = 4  # prompt tokens per sequence and step of the chunked prefill


class Stepper(Protocol):
    """One program (B sequences x T tokens) and its arenas."""

    prog: object  # megakernel.program.compiler.Program
    tokens: int

    def step(self, tokens: torch.Tensor | None) -> torch.Tensor: ...  # [B, T] -> [B, T] int64

    def arenas(self) -> dict[str, torch.Tensor]: ...  # STATE_ARENAS -> tensor (k, v cache-shaped)

    def sync(self) -> None: ...  # wait for the device (timing)


@dataclass
class Generated:
    """New tokens per row (each ends at its EOS when it met one) and when the first arrived."""

    tokens: list[list[int]]
    first_token_s: float = 0.0  # wall time until every row had its first new token
    total_s: float = 0.0
    steps: dict[int, int] = field(default_factory=dict)  # T -> program steps run
    accepted: list[list[int]] = field(default_factory=list)  # per speculative step: per live row

    def speculative_stats(self, method: str, k: int) -> dict:
        """The `--json` "speculative" object: drafts accepted and tokens emitted per row and
        speculative step (live rows only)."""
        acc = [a for step in self.accepted for a in step]
        mean = sum(acc) / len(acc) if acc else 0.0
        return {"method": method, "k": k, "steps": len(self.accepted),
                "accepted_per_step": round(mean, 4), "tokens_per_step": round(mean + 1, 4)}


def copy_state(src: Stepper, dst: Stepper) -> None:
    """Carry what persists across steps (lengths, ring counts, KV cache, recurrent state and its
    ReplaySSM ring) from `src`'s arenas into `dst`'s; both programs serve one model and batch."""
    sp, dp = src.prog.buffers, dst.prog.buffers  # type: ignore[attr-defined]
    sa, da = src.arenas(), dst.arenas()
    for name in ("k", "v"):
        if sa[name] is not da[name]:
            da[name].copy_(sa[name])
    for arena, name in dp.persistent:
        if name not in getattr(sp, arena):  # what only a speculative program keeps
            continue
        s, d = getattr(sp, arena)[name], getattr(dp, arena)[name]
        da[arena][d.offset: d.offset + d.numel].copy_(sa[arena][s.offset: s.offset + s.numel])
    for layer, regs in dp.state.items():
        for name, d in regs.items():
            if name not in sp.state[layer]:  # a speculative step's pending inputs: step scratch
                continue
            s = sp.state[layer][name]
            src_t = sa["state"][s.offset: s.offset + s.numel].view(s.shape)
            dst_t = da["state"][d.offset: d.offset + d.numel].view(d.shape)
            if s.shape == d.shape:
                dst_t.copy_(src_t)
            else:  # a ReplaySSM ring [B, cap, ...]: the capacity grows with T
                n = min(s.shape[1], d.shape[1])
                dst_t[:, :n].copy_(src_t[:, :n])


def _check_prompts(prompts: list[list[int]], batch: int) -> None:
    if len(prompts) != batch or any(len(p) == 0 for p in prompts):
        raise ValueError(f"program_generate needs {batch} non-empty prompts, got "
                         f"{[len(p) for p in prompts]} tokens")


class HiddenLog:
    """The target's residual stream after its last block (before the final norm), fp32, at every
    position each row has consumed, copied from a stepper's f32 "h" after each step: what the MTP
    drafter reads (megakernel/serve/drafters.py MtpDrafts). A later step that consumes a position
    again (a rejected draft's) overwrites it."""

    def __init__(self, batch: int) -> None:
        self.rows: list[dict[int, torch.Tensor]] = [{} for _ in range(batch)]

    def lengths(self, stepper: Stepper) -> list[int]:
        return region(stepper, "i32", "lengths").tolist()

    def record(self, stepper: Stepper, before: list[int]) -> None:
        """Keep rows b*T + t of the step just run at positions before[b] + t."""
        hidden = getattr(stepper, "hidden", None)
        if hidden is None:
            raise TypeError(f"{type(stepper).__name__} does not expose its hidden states")
        h, t = hidden().float().cpu(), stepper.tokens
        for b, n in enumerate(before):
            for i in range(t):
                self.rows[b][n + i] = h[b * t + i].clone()

    def hook(self, row: int, tokens: list[int], start: int) -> torch.Tensor:
        """The `hidden` hook of MtpDrafts: h at positions start .. len(tokens) - 1 of `row`."""
        return torch.stack([self.rows[row][p] for p in range(start, len(tokens))])


def spec_max_seq_len(longest_prompt: int, steps: int, drafts: int = 0) -> int:
    """The cache length generation needs: the longest prompt + steps - 1, and with k drafts a
    step k + 1 more (a live row's last step still verifies 1 + k tokens)."""
    return longest_prompt + steps - 1 + (drafts + 1 if drafts else 0)


def region(stepper: Stepper, arena: str, name: str) -> torch.Tensor:
    """A view of buffer `name` of a stepper's persistent arena `arena` (its own shape)."""
    r = getattr(stepper.prog.buffers, arena)[name]  # type: ignore[attr-defined]
    return stepper.arenas()[arena][r.offset: r.offset + r.numel].view(r.shape)


def program_generate(single: Stepper, prompts: list[list[int]], steps: int,
                     eos_token_id: int | None = None, chunk: Stepper | None = None,
                     live: list[bool] | None = None, spec: Stepper | None = None,
                     drafts_fn: Callable | None = None, hidden_log: HiddenLog | None = None
                     ) -> Generated:
    """Greedy generation of up to `steps` new tokens per prompt, prefill included, on the
    program (module docstring). The program needs max_seq_len >= longest prompt + steps - 1
    (+ k with a speculative program `spec`). A row stops at `eos_token_id` (kept); the loop ends
    when every row has stopped. Rows whose `live` is False (batch padding) are stepped but never
    hold the loop; their tokens stay []. `drafts_fn(histories, k)`: the drafts of a speculative
    program without the device drafter (histories: each row's tokens, the next input last).
    `hidden_log` keeps every step's hidden states (HiddenLog: the MTP drafter's input)."""
    b = len(prompts)
    _check_prompts(prompts, b)
    t0 = time.perf_counter()
    done = Generated([[] for _ in prompts])
    if steps <= 0:
        return done
    pos = 0
    if chunk is not None and chunk.tokens > 1:
        t = chunk.tokens
        n_chunks = (min(len(p) for p in prompts) - 1) // t
        for c in range(n_chunks):
            before = hidden_log.lengths(chunk) if hidden_log else []
            chunk.step(torch.tensor([p[c * t: (c + 1) * t] for p in prompts]))
            if hidden_log:
                hidden_log.record(chunk, before)
        done.steps[t] = n_chunks
        if n_chunks:
            copy_state(chunk, single)
        pos = n_chunks * t
    stopped = [not x for x in live] if live is not None else [False] * b
    last = [0] * b
    n1 = 0
    while not all(stopped):
        prompt_left = any(pos < len(p) for p in prompts)
        feed = (torch.tensor([[p[pos] if pos < len(p) else last[i]]
                              for i, p in enumerate(prompts)]) if prompt_left or n1 == 0
                else None)
        before = hidden_log.lengths(single) if hidden_log else []
        out = single.step(feed)[:, 0].tolist()
        if hidden_log:
            hidden_log.record(single, before)
        n1 += 1
        for i, p in enumerate(prompts):
            if pos >= len(p) - 1 and not stopped[i]:
                tok = int(out[i])
                last[i] = tok
                done.tokens[i].append(tok)
                stopped[i] = len(done.tokens[i]) >= steps or tok == eos_token_id
        if pos == max(len(p) for p in prompts) - 1:
            single.sync()
            done.first_token_s = time.perf_counter() - t0
            if spec is not None:
                break
        pos += 1
    single.sync()
    done.steps[1] = n1
    if spec is not None and not all(stopped):
        copy_state(single, spec)
        speculate(spec, prompts, done, stopped, steps, eos_token_id, drafts_fn, hidden_log)
        spec.sync()
    done.total_s = time.perf_counter() - t0
    return done


def speculate(spec: Stepper, prompts: list[list[int]], done: Generated, stopped: list[bool],
              steps: int, eos_token_id: int | None, drafts_fn: Callable | None,
              hidden_log: HiddenLog | None = None) -> None:
    """The speculative phase (module docstring, 3.), from every row's first new token on:
    appends each live row's emitted tokens to `done.tokens` until every row has stopped."""
    from megakernel.reference.speculative import NGRAM_MAX, ngram_propose

    prog = spec.prog  # type: ignore[attr-defined]
    k, b = prog.drafts, len(prompts)
    hist = [list(p) + done.tokens[i] for i, p in enumerate(prompts)]  # the next input last
    history = region(spec, "i32", "history")
    history[:] = 0
    for i, h in enumerate(hist):
        history[i, : len(h)] = torch.tensor(h, dtype=torch.int32)
    propose = drafts_fn or (lambda hs, kk: [ngram_propose(x, kk, prog.ngram or NGRAM_MAX)
                                            for x in hs])

    def host_feed() -> torch.Tensor:
        """tokens [B, 1 + k]: each row's next input, then the host's drafts."""
        return torch.cat((torch.tensor([h[-1] for h in hist])[:, None],
                          torch.tensor(propose(hist, k), dtype=torch.int64)), dim=1)

    feed: torch.Tensor | None = host_feed()  # the first drafts come from the host either way
    n = 0
    while not all(stopped):
        before = hidden_log.lengths(spec) if hidden_log else []
        out = spec.step(feed).tolist()
        if hidden_log:
            hidden_log.record(spec, before)
        emitted = region(spec, "i32", "emitted").tolist()
        n += 1
        if not any(emitted[i] for i in range(b) if not stopped[i]):
            raise ValueError(f"speculative generation cannot go on: the live rows' caches are "
                             f"full (lengths {region(spec, 'i32', 'lengths').tolist()}, "
                             f"{prog.tokens} tokens a step, max sequence length "
                             f"{prog.max_seq_len}); compile with max_seq_len >= "
                             "spec_max_seq_len(...)")
        done.accepted.append([emitted[i] - 1 for i in range(b) if not stopped[i]])
        for i in range(b):
            new = out[i][: emitted[i]]
            hist[i] += new
            if stopped[i]:
                continue
            for tok in new:
                done.tokens[i].append(tok)
                if len(done.tokens[i]) >= steps or tok == eos_token_id:
                    stopped[i] = True
                    break
        feed = None if prog.ngram else host_feed()
    done.steps[prog.tokens] = n
