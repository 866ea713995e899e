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
"""

from __future__ import annotations

import time
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


def copy_state(src: Stepper, dst: Stepper) -> None:
    """Carry what persists across steps (lengths, ring counts, KV cache, recurrent state and its
    ReplaySSM ring) from `src`'s arenas into `dst`'s; both programs serve one model and batch."""
    sp, dp = src.prog.buffers, dst.prog.buffers  # type: ignore[attr-defined]
    sa, da = src.arenas(), dst.arenas()
    for name in ("k", "v"):
        if sa[name] is not da[name]:
            da[name].copy_(sa[name])
    for arena, name in dp.persistent:
        s, d = getattr(sp, arena)[name], getattr(dp, arena)[name]
        da[arena][d.offset: d.offset + d.numel].copy_(sa[arena][s.offset: s.offset + s.numel])
    for layer, regs in dp.state.items():
        for name, d in regs.items():
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


def program_generate(single: Stepper, prompts: list[list[int]], steps: int,
                     eos_token_id: int | None = None, chunk: Stepper | None = None,
                     live: list[bool] | None = None) -> Generated:
    """Greedy generation of up to `steps` new tokens per prompt, prefill included, on the
    program (module docstring). The program needs max_seq_len >= longest prompt + steps - 1.
    A row stops at `eos_token_id` (kept); the loop ends when every row has stopped. Rows whose
    `live` is False (batch padding) are stepped but never hold the loop; their tokens stay []."""
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
            chunk.step(torch.tensor([p[c * t: (c + 1) * t] for p in prompts]))
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
        out = single.step(feed)[:, 0].tolist()
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
        pos += 1
    single.sync()
    done.total_s = time.perf_counter() - t0
    done.steps[1] = n1
    return done
