"""Host-side drafters for speculative decoding: the `drafts_fn(histories, k) -> drafts` callables
the engine calls once per speculative step (megakernel.serve.engine.speculate), for the methods
whose drafts do not come from the device (megakernel/serve/speculative.py):

  draft:MODEL:K  `ExecutorDrafter` (the draft model's own programs on the CPU executor) or
                 `ReferenceDrafter` (its ReferenceModel): K greedy tokens of a smaller model with
                 the same vocabulary;
  mtp:K          `MtpDrafts`: reference/mtp.MtpDrafter behind the same interface; it needs the
                 target's hidden states, which it takes from a `hidden` hook: on the CPU
                 executor the program's own (engine.HiddenLog), on the reference recomputed.

`make(spec, cfg, weights, batch, max_seq_len, backend)` builds the drafter a method string asks
for (None for ngram: the device drafts). `draft_step_cost` is the cost model's view of a
draft-model step: K draft steps plus the target's verify.

A draft model's drafter keeps, per row, the tokens its KV cache holds (`consumed`, positions
0 .. n-1). At each call, with history h (prompt and generated tokens, the next input last):

1. rewind: n = the longest common prefix of `consumed` and h[:-1] (h[-1] is always fed, so its
   logits are the first draft's); the row's length is set to n. Attention KV past n is simply
   overwritten by the next writes, which is why a draft model must be attention-only: a
   recurrent layer's state cannot be rewound without ReplaySSM's commit semantics;
2. catch up: the pending tokens h[n:] are consumed, in chunk steps of T tokens while some row has
   two or more pending (rows with fewer feed padding after their real tokens; the greedy token
   at a row's last real token is its first draft, causal attention keeps the padding out of it),
   then in T = 1 steps;
3. draft: K - 1 more T = 1 steps, each feeding the row's last draft.

In steady state a row's pending tokens are the bonus alone (a draft was rejected: the accepted
drafts are already consumed, the rejected ones rewound) or the last draft and the bonus (all K
accepted), so a call is one catch-up step and K - 1 draft steps. The lengths of every row are
written before every step (the program reads them at run time), so rows at different points (a
row already holding its K drafts, a row still catching up) share each step: a row with nothing
to feed writes a padding token at its own length, past what it holds, and does not advance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megakernel.serve.speculative import Speculative, SpeculativeError, parse

__all__ = ["DraftCost", "ExecutorDrafter", "MtpDrafts", "ReferenceDrafter", "check_draft_model",
           "draft_step_cost", "make", "reference_hidden"]

DEFAULT_CHUNK = 4  # tokens per row of the draft model's catch-up (chunk) program


def check_draft_model(target_cfg, draft_cfg, name: str | None = None) -> None:  # noqa: ANN001
    """SpeculativeError unless `draft_cfg` can draft for `target_cfg`: the same vocabulary size
    (the drafts are the target's token ids) and no recurrent layers (a draft model is rewound to
    the accepted prefix by its lengths alone)."""
    name = name or draft_cfg.name or draft_cfg.family
    target = target_cfg.name or target_cfg.family
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise SpeculativeError(
            f"draft model {name} has a vocabulary of {draft_cfg.vocab_size} tokens, the target "
            f"{target} {target_cfg.vocab_size}: a draft model must share the target's tokenizer")
    rec = set(draft_cfg.recurrent_layers())
    if rec:
        from megakernel.layers import kind

        kinds = sorted({b.kind for b in draft_cfg.blocks if kind(b.kind).recurrent})
        raise SpeculativeError(
            f"draft model {name} has recurrent layers ({', '.join(kinds)}): a draft model is "
            "rewound to the accepted tokens by resetting its lengths, which only attention KV "
            "(overwritten past the new length) allows; recurrent state would need ReplaySSM's "
            "commit semantics. Use an attention-only draft model")


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _HistoryDrafter:
    """What both draft-model drafters share: per-row consumed tokens and the rewind."""

    def __init__(self, cfg, batch: int, max_seq_len: int) -> None:  # noqa: ANN001
        if batch < 1:
            raise SpeculativeError(f"a drafter needs batch >= 1, got {batch}")
        self.cfg, self.batch, self.max_seq_len = cfg, batch, max_seq_len
        self.consumed: list[list[int]] = [[] for _ in range(batch)]
        self.rewound = 0  # cached tokens dropped by rewinds (rejected drafts, diverged history)
        self.calls = 0

    def _check(self, histories: list[list[int]], k: int) -> None:
        if len(histories) != self.batch:
            raise SpeculativeError(f"{len(histories)} histories for a drafter of batch "
                                   f"{self.batch}")
        if not isinstance(k, int) or k < 1:
            raise SpeculativeError(f"k must be >= 1 drafts, got {k!r}")
        vocab = self.cfg.vocab_size
        for b, h in enumerate(histories):
            if not h:
                raise SpeculativeError(f"history {b} is empty: it needs at least the next input")
            bad = [t for t in h if not 0 <= int(t) < vocab]
            if bad:
                raise SpeculativeError(f"history {b}: token id {bad[0]} is outside [0, {vocab})")

    def _rewind(self, histories: list[list[int]]) -> list[list[int]]:
        """Step 1 of the module docstring -> each row's pending tokens (at least h[-1])."""
        pending = []
        for b, h in enumerate(histories):
            h = [int(t) for t in h]
            n = _lcp(self.consumed[b], h[:-1])
            self.rewound += len(self.consumed[b]) - n
            self.consumed[b] = h[:n]
            pending.append(h[n:])
        return pending


class ExecutorDrafter(_HistoryDrafter):
    """`draft:MODEL:K` on the CPU executor: the draft model's T = 1 program and a T = `chunk`
    catch-up program sharing one KV cache (module docstring). `max_seq_len`: the target's; the
    draft program gets `chunk` more positions (a chunk step's padding)."""

    def __init__(self, cfg, weights: Mapping[str, torch.Tensor], batch: int,  # noqa: ANN001
                 max_seq_len: int, chunk: int = DEFAULT_CHUNK, num_sms: int | None = None,
                 check: bool = False, seed: int = 0, target_cfg=None) -> None:  # noqa: ANN001
        from megakernel.program.compiler import compile_program
        from megakernel.program.pack import pack_weights
        from megakernel.serve.executor_backend import DEFAULT_SMS, ExecutorStepper, executor_gpu

        check_draft_model(target_cfg or cfg, cfg)
        if chunk < 1:
            raise SpeculativeError(f"chunk must be >= 1 tokens, got {chunk}")
        s_max = max_seq_len + (chunk if chunk > 1 else 0)
        super().__init__(cfg, batch, s_max)
        gpu = executor_gpu(num_sms or DEFAULT_SMS)
        packed = pack_weights(cfg, weights)
        self.single = ExecutorStepper(compile_program(cfg, batch, gpu, tokens=1,
                                                      max_seq_len=s_max),
                                      packed, check=check, seed=seed + 30_000)
        self.chunk = None
        if chunk > 1:
            kv = {n: self.single.ex.arena_tensor(n) for n in ("k", "v")}
            self.chunk = ExecutorStepper(compile_program(cfg, batch, gpu, tokens=chunk,
                                                         max_seq_len=s_max),
                                         packed, check=check, seed=seed + 40_000, arenas=kv)
        self.steps: dict[int, int] = {}  # T -> steps run

    def __call__(self, histories: list[list[int]], k: int) -> list[list[int]]:
        self._check(histories, k)
        self.calls += 1
        pending = self._rewind(histories)
        drafts: list[list[int]] = [[] for _ in histories]
        reach = max(k, self.chunk.tokens if self.chunk is not None else 1)
        for b, h in enumerate(histories):  # a row whose steps do not fit: no drafts to run
            if len(h) - 1 + reach > self.max_seq_len:
                pending[b] = []
                drafts[b] = [int(h[-1])] * k
        if self.chunk is not None:
            while max(len(p) for p in pending) >= 2:
                feeds = [p[: self.chunk.tokens] for p in pending]
                out = self._step(self.chunk, feeds, histories)
                for b, f in enumerate(feeds):
                    if f:
                        self.consumed[b] += f
                        pending[b] = pending[b][len(f):]
                        if not pending[b]:
                            drafts[b].append(out[b][len(f) - 1])
        while any(len(d) < k for d in drafts):
            feeds = [[p[0]] if p else [d[-1]] if len(d) < k else []
                     for p, d in zip(pending, drafts, strict=True)]
            out = self._step(self.single, feeds, histories)
            for b, f in enumerate(feeds):
                if f:
                    self.consumed[b] += f
                    if pending[b]:
                        pending[b] = pending[b][1:]
                    if not pending[b]:
                        drafts[b].append(out[b][0])
        return drafts

    def _step(self, stepper, feeds: list[list[int]], histories: list[list[int]]  # noqa: ANN001
              ) -> list[list[int]]:
        """One step of `stepper`: row b feeds `feeds[b]` (at most T tokens, padded with its last
        known token) at position len(consumed[b]); a row with no feed parks there (its writes
        land past what it holds; a row too close to the end parks earlier, dropping what it
        held there). Returns the greedy tokens [B][T]."""
        from megakernel.serve.engine import region

        t = stepper.tokens
        pos, rows = [], []
        for b, f in enumerate(feeds):
            n = len(self.consumed[b])
            if not f and n + t > self.max_seq_len:
                n = self.max_seq_len - t
                self.rewound += len(self.consumed[b]) - n
                self.consumed[b] = self.consumed[b][:n]
            pad = f[-1] if f else int(histories[b][-1])
            pos.append(n)
            rows.append(list(f) + [pad] * (t - len(f)))
        region(stepper, "i32", "lengths")[:] = torch.tensor(pos, dtype=torch.int32)
        out = stepper.step(torch.tensor(rows, dtype=torch.int64)).tolist()
        self.steps[t] = self.steps.get(t, 0) + 1
        return out


class ReferenceDrafter(_HistoryDrafter):
    """`draft:MODEL:K` on the torch reference (`generate --backend reference`): the draft
    ReferenceModel's cache, its lengths rewound per row; the pending tokens in one decode of
    the row, then K - 1 decodes of one token."""

    def __init__(self, cfg, weights: Mapping[str, torch.Tensor], batch: int,  # noqa: ANN001
                 max_seq_len: int, mode: str = "bf16", device: str = "cpu",
                 target_cfg=None) -> None:  # noqa: ANN001
        from megakernel.reference.model import ReferenceModel

        check_draft_model(target_cfg or cfg, cfg)
        s_max = min(max_seq_len, cfg.max_position_embeddings)
        super().__init__(cfg, batch, s_max)
        self.model = ReferenceModel(cfg, dict(weights), mode=mode, device=device)
        self.cache = self.model.new_cache(batch, s_max)

    @torch.no_grad()
    def __call__(self, histories: list[list[int]], k: int) -> list[list[int]]:
        from megakernel.reference.model import greedy

        self._check(histories, k)
        self.calls += 1
        pending = self._rewind(histories)
        out = []
        for b, (h, p) in enumerate(zip(histories, pending, strict=True)):
            if len(h) + k - 1 > self.max_seq_len:
                out.append([int(h[-1])] * k)
                continue
            self.cache.lengths[b] = len(self.consumed[b])
            row = self.cache.row(b)
            logits = self.model.decode(row, torch.tensor([p], dtype=torch.int64))
            self.consumed[b] += p
            drafts = [int(greedy(logits[0, -1]))]
            while len(drafts) < k:
                logits = self.model.decode(row, torch.tensor([[drafts[-1]]], dtype=torch.int64))
                self.consumed[b].append(drafts[-1])
                drafts.append(int(greedy(logits[0, -1])))
            out.append(drafts)
        return out


# ---- MTP ----------------------------------------------------------------------------------------
HiddenHook = Callable[[int, list[int], int], torch.Tensor]


def reference_hidden(model) -> HiddenHook:  # noqa: ANN001
    """A `hidden` hook from the target's ReferenceModel: h of row `row`'s tokens recomputed from
    scratch (reference/mtp.target_hidden, O(n) a call: for tests and the reference backend)."""
    from megakernel.reference.mtp import target_hidden

    def hidden(row: int, tokens: list[int], start: int) -> torch.Tensor:
        return target_hidden(model, tokens)[0][start:]

    return hidden


class MtpDrafts:
    """`mtp:K` as a drafts_fn: reference/mtp.MtpDrafter (one per row, so rows advance
    independently) fed from the histories and a `hidden` hook.

    hidden(row, tokens, start) -> fp32 [len(tokens) - start, H]: the target's residual stream
    after its last block and before its final norm ("pre-final-norm h") at positions start ..
    len(tokens) - 1 of row `row`, whose inputs are `tokens` (the row's history without its last
    token, the next input, whose h the target has not computed yet). The first call for a row
    asks for start = 0 (the prompt and the first new token's input), each later one for the
    inputs the target committed since: the previous bonus and the accepted drafts. A hook on the
    engine returns the rows it kept from the target's steps (`reference_hidden` recomputes them).

    A row whose history did not grow since the last call (a stopped row whose cache is full)
    keeps its last drafts; a history that is not an extension of the last one is an error (the
    MTP cache holds committed pairs only).
    """

    def __init__(self, model, batch: int, max_seq_len: int, k: int,  # noqa: ANN001
                 hidden: HiddenHook) -> None:
        from megakernel.reference.mtp import MtpDrafter

        if batch < 1:
            raise SpeculativeError(f"a drafter needs batch >= 1, got {batch}")
        self.k, self.hidden = k, hidden
        self.rows = [MtpDrafter(model, 1, max_seq_len, k) for _ in range(batch)]
        self.seen: list[list[int] | None] = [None] * batch  # the history of the last call
        self.last: list[list[int]] = [[] for _ in range(batch)]
        self.calls = 0
        self.hidden_log = None  # an engine.HiddenLog behind `hidden` (make: the cpu-executor)

    def __call__(self, histories: list[list[int]], k: int) -> list[list[int]]:
        if k != self.k:
            raise SpeculativeError(f"this MTP drafter chains {self.k} drafts, asked for {k}")
        if len(histories) != len(self.rows):
            raise SpeculativeError(f"{len(histories)} histories for a drafter of batch "
                                   f"{len(self.rows)}")
        self.calls += 1
        out = []
        for b, h in enumerate(histories):
            h = [int(t) for t in h]
            prev, d = self.seen[b], self.rows[b]
            if prev is None:
                if len(h) < 2:
                    raise SpeculativeError(f"history {b}: the MTP drafter needs a prompt token "
                                           "and the next input")
                d.prefill([h[:-1]], [self._hidden(b, h[:-1], 0)])
                self.last[b] = d.propose([[]], [self._hidden(b, h[:-1], len(h) - 1)], [h[-1]])[0]
            elif h != prev:
                if len(h) <= len(prev) or h[: len(prev)] != prev:
                    raise SpeculativeError(f"history {b} does not extend the previous one (the "
                                           "MTP drafter keeps committed tokens only)")
                start = len(prev) - 1  # the previous bonus: the target's input then
                self.last[b] = d.propose([h[start:-1]], [self._hidden(b, h[:-1], start)],
                                         [h[-1]])[0]
            self.seen[b] = h
            out.append(list(self.last[b]))
        return out

    def _hidden(self, b: int, tokens: list[int], start: int) -> torch.Tensor:
        if start == len(tokens):  # nothing new (the first propose after the prefill)
            h = self.rows[b].model.cfg.hidden_size
            return torch.zeros(0, h, dtype=torch.float32)
        return self.hidden(b, tokens, start).to(torch.float32)


# ---- the method string -> a drafter ------------------------------------------------------------
def make(spec: str | Speculative | None, cfg, weights: Mapping[str, torch.Tensor],  # noqa: ANN001
         batch: int, max_seq_len: int, backend: str = "cpu-executor",
         **kw) -> Callable[[list[list[int]], int], list[list[int]]] | None:  # noqa: ANN003
    """The drafts_fn of a speculative method for the target (cfg, weights): None for ngram (the
    device drafts) and for no method. Keywords: draft: `seed` (a preset draft's random weights),
    `dtype`, `draft_model` ((cfg, weights), instead of loading spec.model), `chunk`, `num_sms`,
    `check` (cpu-executor), `mode`, `device` (reference); mtp: `hidden` (the hook, MtpDrafts;
    on the reference backend it defaults to recomputing h with the target's ReferenceModel)."""
    sp = parse(spec)
    if sp is None or sp.method == "ngram":
        return None
    if backend not in ("cpu-executor", "reference"):
        raise SpeculativeError(f"host drafters run on the cpu-executor and reference backends, "
                               f"not {backend!r}")
    if sp.method == "draft":
        if "draft_model" in kw:
            dcfg, dw = kw["draft_model"]
        else:
            from megakernel.models.sources import load_model

            dcfg, dw = load_model(sp.model, seed=kw.get("seed", 0),
                                  dtype=kw.get("dtype", torch.bfloat16))
        if backend == "reference":
            return ReferenceDrafter(dcfg, dw, batch, max_seq_len, mode=kw.get("mode", "bf16"),
                                    device=kw.get("device", "cpu"), target_cfg=cfg)
        return ExecutorDrafter(dcfg, dw, batch, max_seq_len, chunk=kw.get("chunk", DEFAULT_CHUNK),
                               num_sms=kw.get("num_sms"), check=kw.get("check", False),
                               seed=kw.get("seed", 0), target_cfg=cfg)
    # mtp
    if not cfg.mtp:
        raise SpeculativeError(f"mtp: {cfg.name or cfg.family} has no MTP modules enabled (a "
                               "checkpoint that carries them, loaded with mtp=True)")
    from megakernel.reference.model import ReferenceModel

    model = kw.get("model") or ReferenceModel(cfg, dict(weights), mode=kw.get("mode", "bf16"),
                                              device=kw.get("device", "cpu"))
    hidden, log = kw.get("hidden"), None
    if hidden is None and backend == "reference":
        hidden = reference_hidden(model)
    elif hidden is None:  # the program's own hidden states, kept by the engine
        from megakernel.serve.engine import HiddenLog

        log = HiddenLog(batch)
        hidden = log.hook
    drafts = MtpDrafts(model, batch, max_seq_len, sp.k, hidden)
    drafts.hidden_log = log  # engine.program_generate(hidden_log=...) fills it
    return drafts


# ---- the cost model's view ---------------------------------------------------------------------
@dataclass(frozen=True)
class DraftCost:
    """Predicted seconds of one draft-model speculative step (program/cost.py, replay.py)."""

    k: int
    draft_step_s: float  # the draft model's T = 1 step
    verify_s: float  # the target's speculative step, 1 + k tokens
    plain_s: float  # the target's plain T = 1 step
    launch_s: float  # the launch term every predicted step includes (CostParams.launch)

    @property
    def drafts_s(self) -> float:
        return self.k * self.draft_step_s

    @property
    def total_s(self) -> float:
        """K draft launches and the verify launch."""
        return self.drafts_s + self.verify_s

    @property
    def fused_s(self) -> float:
        """Draft steps and verify in one launch: the K launch terms saved (nothing else)."""
        return self.total_s - self.k * self.launch_s

    def tokens_per_step(self, alpha: float) -> float:
        """Expected tokens a step emits when each draft is accepted with probability `alpha`
        independently: 1 + alpha + ... + alpha^k."""
        return sum(alpha ** i for i in range(self.k + 1))

    def speedup(self, alpha: float, fused: bool = False) -> float:
        """Plain step time per token over speculative time per token at acceptance `alpha`."""
        step = self.fused_s if fused else self.total_s
        return self.plain_s * self.tokens_per_step(alpha) / step

    def breakeven(self, fused: bool = False) -> float | None:
        """The acceptance rate at which speculation matches plain decoding (None: never)."""
        lo, hi = 0.0, 1.0
        if self.speedup(hi, fused) < 1.0:
            return None
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.speedup(mid, fused) < 1.0 else (lo, mid)
        return hi


def draft_step_cost(target_cfg, draft_cfg, k: int, batch: int, gpu,  # noqa: ANN001
                    context: int | None = None, max_seq_len: int | None = None,
                    params=None) -> DraftCost:  # noqa: ANN001
    """The predicted cost (compile_program(...).cost.predicted_s, the fluid replay) of one
    draft-model speculative step on `gpu` (a GPU or its name): K steps of the draft's T = 1
    program, the target's 1 + k verify program (host drafts), and the target's plain step for
    comparison; `context` cached tokens per sequence (the compiler's default: min(1024, ...))."""
    from megakernel.program.compiler import compile_program
    from megakernel.program.cost import CostParams
    from megakernel.program.gpus import gpu as gpu_by_name

    g = gpu_by_name(gpu) if isinstance(gpu, str) else gpu
    p = params or CostParams()
    common = dict(max_seq_len=max_seq_len, context=context, params=p)

    def cost(cfg, **extra) -> float:  # noqa: ANN001, ANN003
        return float(compile_program(cfg, batch, g, **common, **extra).cost.predicted_s)

    return DraftCost(k, cost(draft_cfg), cost(target_cfg, drafts=k), cost(target_cfg), p.launch)
