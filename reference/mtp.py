"""The multi-token-prediction (MTP) drafter: the next-n predictor that DeepSeek-V3 and
Qwen3-Next / Qwen3.5 checkpoints carry, run as a speculative-decoding drafter (vLLM's `mtp`
method) over a `ReferenceModel`.

One MTP module (`megakernel.models.config.MtpModule`, declared by the family) maps the target's
hidden state at position p and the token at p + 1 to a guess of the token at p + 2:

    g_p   = store(FinalNorm_target(h_p))     the target's LM head input at p (h_p: its residual
                                              stream after the last layer, before the final norm)
    e     = Embed_target(t_{p+1})
    x     = Proj [ store(Norm_e(e)) ; store(Norm_h(g_p)) ]      embedding first, Proj [H, 2H]
    x    += op(store(norm(x)))  for the blocks of one decoder layer (attention at position p,
                                with the module's own KV cache; then the MLP)
    g'    = store(Norm_final(x))              the module's output
    logits = LMHead_target(g')                guesses t_{p+2}

Chained drafting: the first draft comes from (g_p, bonus token) at the last committed position p;
draft d + 1 from (g' of draft d, draft d) at position p + d. With one module (every published
checkpoint) it is reused for every depth, as vLLM does; its KV cache holds one entry per position
of the sequence (pairs of the prompt and of every committed token), draft entries being written
past the committed length and overwritten by the next call. Norms are the model's RMSNorm form
(x * w, or x * (1 + w) for Qwen3.5); `store` rounds to bf16 in "bf16" mode, as in model.py.

Sources: vLLM qwen3_5_mtp.py / qwen3_next_mtp.py (pre_fc_norm_embedding, pre_fc_norm_hidden, fc,
norm; the target hidden is the model's forward output, i.e. after the final norm; the MTP output
after its own norm is both the logits input and the next step's hidden), deepseek_mtp.py (enorm,
hnorm, eh_proj, shared_head), transformers' MtpLayer (modeling_layers.py: embedding first unless
a config sets `mtp_hidden_states_first`), the DeepSeek-V3 report (section 2.2).

Host protocol (per sequence b; `hidden` rows are the target's h, fp32 [n, H], pre-final-norm):
    drafter = MtpDrafter(model, batch, max_seq_len, k)
    drafter.prefill(tokens, hidden)       prompt tokens t_0..t_{n-1} and h_0..h_{n-1}
    drafter.propose(accepted, hidden, bonus) -> k drafts per sequence
        accepted[b]: the input tokens the target committed in its last step (the previous
        bonus first, then the accepted drafts; [] on the first call after prefill), hidden[b]
        their h [len, H]; bonus[b]: the target's next input token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megakernel.layers import kind
from megakernel.models.config import MtpModule

from .layers import layer_class
from .layers.common import ReferenceError, linear, store
from .model import ReferenceModel, greedy

__all__ = ["MtpBlock", "MtpDrafter", "target_hidden"]


class MtpBlock:
    """One MTP module of `model` (weights from `model.w`, the model's mode and device) with a KV
    cache per sequence of the batch."""

    def __init__(self, model: ReferenceModel, module: MtpModule, batch: int, max_seq_len: int):
        cfg = model.cfg
        self.model, self.module, self.mode = model, module, model.mode
        for blk in module.blocks:
            kind(blk.kind).check(blk, cfg)
        self.ops = [layer_class(blk.kind).from_block(blk, cfg, model.w, model.mode, model.device)
                    for blk in module.blocks]
        self.caches = [op.new_cache(batch, max_seq_len, 0, model.device)
                       if op.state is not None else None for op in self.ops]
        if any(op.state == "recurrent" for op in self.ops):
            raise ReferenceError("an MTP decoder layer with a recurrent mixer is not supported")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        m = self.model
        return store(m.norm(x, m.w[name], m.cfg.rms_norm_eps), self.mode)

    def target_output(self, h: torch.Tensor) -> torch.Tensor:
        """The target's LM head input from its pre-final-norm hidden h [..., H] (what vLLM
        passes the MTP as the target's hidden states)."""
        return self._norm(h, self.model.cfg.final_norm_name)

    def forward(self, b: int, start: int, g: torch.Tensor, tokens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b: pairs (g[i], tokens[i]) at positions start + i, g [T, H] the hidden
        input (a target LM head input or a previous depth's output), tokens [T] the next
        tokens; writes the KV cache slots start .. start+T-1 -> (output g' [T, H], logits
        [T, V])."""
        m, mod = self.model, self.module
        e = m.embed[tokens.to(m.device)].to(torch.float32)
        x = linear(torch.cat((self._norm(e, mod.embed_norm), self._norm(g, mod.hidden_norm)),
                             dim=-1), m.w[mod.proj])[None]  # [1, T, H] residual stream, fp32
        lengths = torch.tensor([start], dtype=torch.int64, device=m.device)
        for blk, op, cache in zip(mod.blocks, self.ops, self.caches, strict=True):
            xn = self._norm(x, blk.norm)
            row = cache.row(b) if cache is not None else None  # type: ignore[attr-defined]
            x = x + op.forward(xn, row, lengths, False, False)
        out = self._norm(x[0], mod.final_norm)
        return out, linear(out, m.lm_head)


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # t_0 .. t_{N-1}, the last one the bonus
    hidden: list[torch.Tensor] = field(default_factory=list)  # target LM head inputs g_0 ..
    paired: int = 0  # MTP cache positions committed: pairs (g_p, t_{p+1}) for p < paired
    bonus: int | None = None  # the bonus of the last propose (the next accepted[0])


class MtpDrafter:
    """Greedy K-token drafts from the model's MTP modules (module docstring: the protocol)."""

    def __init__(self, model: ReferenceModel, batch: int, max_seq_len: int, k: int):
        mods = model.cfg.mtp
        if not mods:
            raise ReferenceError(f"{model.cfg.name or model.cfg.family} has no MTP modules "
                                 "enabled (load the checkpoint with mtp=True)")
        if len(mods) != 1:
            raise ReferenceError(f"drafting with {len(mods)} MTP modules is not implemented "
                                 "(every published checkpoint has one)")
        if batch < 1 or k < 1:
            raise ReferenceError(f"MtpDrafter needs batch >= 1 and k >= 1, got {batch}, {k}")
        self.model, self.k, self.max_seq_len = model, k, max_seq_len
        self.block = MtpBlock(model, mods[0], batch, max_seq_len)
        self.seqs = [_Seq() for _ in range(batch)]

    @torch.no_grad()
    def prefill(self, tokens: list[list[int]], hidden: list[torch.Tensor]) -> None:
        """Prompts and the target's h at their positions ([len, H] each); fills the MTP cache
        with the pairs (g_p, t_{p+1}) of each prompt."""
        self._check_batch(tokens, hidden)
        for b, (toks, h) in enumerate(zip(tokens, hidden, strict=True)):
            if not toks:
                raise ReferenceError(f"empty prompt {b}")
            self._check_hidden(b, h, len(toks))
            self.seqs[b] = _Seq()
            self._extend(b, list(toks), h)

    @torch.no_grad()
    def propose(self, accepted: list[list[int]], hidden: list[torch.Tensor], bonus: list[int]
                ) -> list[list[int]]:
        """After a target step: the committed input tokens and their h, and the bonus token;
        -> k greedy drafts per sequence (the tokens after the bonus)."""
        self._check_batch(accepted, hidden)
        if len(bonus) != len(self.seqs):
            raise ReferenceError(f"{len(bonus)} bonus tokens for a batch of {len(self.seqs)}")
        out = []
        for b, (acc, h, nxt) in enumerate(zip(accepted, hidden, bonus, strict=True)):
            s = self.seqs[b]
            if not s.tokens:
                raise ReferenceError(f"sequence {b} was not prefilled")
            self._check_hidden(b, h, len(acc))
            if s.bonus is not None:
                if not acc or acc[0] != s.bonus:
                    raise ReferenceError(f"sequence {b}: accepted tokens must start with the "
                                         f"last bonus token {s.bonus}, got {acc[:1]}")
                acc = acc[1:]
            elif acc:
                raise ReferenceError(f"sequence {b}: the first propose after prefill takes no "
                                     f"accepted tokens, got {len(acc)}")
            last = self._extend(b, [*acc, int(nxt)], h)
            s.bonus = int(nxt)
            out.append(self._draft(b, last))
        return out

    # ---- internals -------------------------------------------------------------------------------
    def _extend(self, b: int, tokens: list[int], h: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Append tokens and hidden rows, then run every pair that became complete -> the
        block's (output, logits) of those pairs (None when none did)."""
        s, vocab = self.seqs[b], self.model.cfg.vocab_size
        bad = [t for t in tokens if not 0 <= int(t) < vocab]
        if bad:
            raise ReferenceError(f"sequence {b}: token id {bad[0]} is outside [0, {vocab})")
        s.tokens += [int(t) for t in tokens]
        s.hidden += list(self.block.target_output(h.to(self.model.device, torch.float32)))
        n = min(len(s.hidden), len(s.tokens) - 1)  # pairs (g_p, t_{p+1}) known
        if n + self.k > self.max_seq_len:
            raise ReferenceError(f"sequence {b}: {n} positions + {self.k} drafts exceed the MTP "
                                 f"cache's max length {self.max_seq_len}")
        if n > s.paired:
            g = torch.stack(s.hidden[s.paired:n])
            toks = torch.tensor(s.tokens[s.paired + 1:n + 1], dtype=torch.int64)
            out = self.block.forward(b, s.paired, g, toks)
            s.paired = n
            return out
        return None

    def _draft(self, b: int, last: tuple[torch.Tensor, torch.Tensor] | None) -> list[int]:
        """k chained drafts after the last pair, (g_{n-1}, bonus) at position n - 1."""
        s = self.seqs[b]
        if last is None or len(s.tokens) != len(s.hidden) + 1 or s.paired != len(s.hidden):
            raise ReferenceError(f"sequence {b}: {len(s.tokens)} tokens and {len(s.hidden)} "
                                 "hidden states: each committed token needs its hidden state")
        g, logits = last
        g, tok = g[-1:], int(greedy(logits[-1]))
        drafts = [tok]
        for d in range(1, self.k):
            g, logits = self.block.forward(b, s.paired - 1 + d, g,
                                           torch.tensor([tok], dtype=torch.int64))
            tok = int(greedy(logits[-1]))
            drafts.append(tok)
        return drafts

    def _check_batch(self, tokens: list[list[int]], hidden: list[torch.Tensor]) -> None:
        if len(tokens) != len(self.seqs) or len(hidden) != len(self.seqs):
            raise ReferenceError(f"{len(tokens)} token lists and {len(hidden)} hidden states for "
                                 f"a batch of {len(self.seqs)}")

    def _check_hidden(self, b: int, h: torch.Tensor, n: int) -> None:
        want = (n, self.model.cfg.hidden_size)
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != want:
            got = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ReferenceError(f"sequence {b}: hidden states must be {list(want)}, got {got}")


@torch.no_grad()
def target_hidden(model: ReferenceModel, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the target from an empty cache (as `ReferenceModel.prefill` runs
    it) -> (h [T, H], its residual stream after the last block, before the final norm; logits
    [T, V]). The engine takes h from its own step; this is the reference's."""
    m = model
    cache = m.new_cache(1, len(tokens))
    ids = torch.as_tensor(tokens, dtype=torch.int64, device=m.device)[None]
    h = m.embed[ids].to(torch.float32)
    for blk, op in zip(m.cfg.blocks, m.ops, strict=True):
        xn = store(m.norm(h, m.w[blk.norm], m.cfg.rms_norm_eps), m.mode)
        layer_cache = cache.layers[blk.layer] if op.state is not None else None
        h = h + op.forward(xn, layer_cache, cache.lengths, False, True)
    out = store(m.norm(h, m.final_norm, m.cfg.rms_norm_eps), m.mode)
    return h[0], linear(out, m.lm_head)[0]
