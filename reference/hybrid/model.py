"""The hybrid reference model: blocks (norm -> mixer or FFN -> residual add) over a cache.

API (same shape as the dense reference):
    model = Qwen35Model(cfg, weights, mode="fp32" | "bf16", replay_window=None | L)
    cache = model.new_cache(batch, max_seq_len, max_step_tokens=8)
    model.prefill(cache, prompts)   -> [B, V] fp32 logits at each prompt's last token
    model.decode(cache, tokens)     -> [B, T, V] (tokens [B, T] int64; all T are committed)
    model.verify(cache, tokens)     -> [B, T, V] speculative step, nothing committed yet (ReplaySSM)
    model.commit(cache, accepted)   keep 1 + accepted[b] of the T verified tokens of sequence b
    generate(model, prompts, steps) -> greedy new tokens

Recurrent layers run either recurrently (`replay_window=None`: state updated every token) or as
ReplaySSM with window L (replay.py): outputs from the committed state plus a ring of inputs, folded
every L committed tokens. Prefill always runs recurrently and leaves an empty ring.

Cache layout (`HybridCache`)
    lengths [B] int64: tokens committed per sequence (= the next position).
    layers[i] for each layer with state:
      attention: KVLayerCache k, v [B, Hkv, S_max, D] (attention.py)
      MLA:       MLACache c [B, S_max, r], k_rope [B, S_max, dr] (mla.py)
      GDN/KDA/Mamba2: SSMLayerCache conv [B, C, K-1], state, ring, count (replay.py); fp32.
A step of T tokens writes KV slots lengths[b] .. lengths[b]+T-1; `commit` advances lengths by the
kept count, so slots of rejected drafts are overwritten by the next step.

Modes
    "fp32": the truth; every weight upcast, every activation fp32.
    "bf16": bf16 mirror. Weights bf16 (except the router weight and bias, dt_bias, A_log and D,
    which transformers keeps or computes in fp32); matvecs bf16 x bf16 with fp32 accumulation;
    the residual stream, norms, gates, decays, convs, recurrent states, ring entries, softmax,
    router and logits fp32. Rounded to bf16 (`store`) exactly at: every matvec input (RMSNorm
    outputs, low-rank intermediates (KDA f_a / g_a, MLA q_a), gated-norm outputs before
    out_proj / o_proj, attention outputs after the output gate, MLP / expert intermediates),
    attention q and the KV cache entries (k after q/k norm and RoPE, v), the MLA latent cache
    (c after its norm, k_rope).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megakernel.hybrid.config import HybridConfig
from megakernel.hybrid.weights import check_weights, embed_name, final_norm_name

from .common import MODES, HybridError, linear, rms_norm, store
from .replay import (
    DEFAULT_WINDOW,
    RecurrentMixer,
    SSMLayerCache,
    commit_layer,
    effective_state,
    new_layer_cache,
    run_layer,
)

# Parameters transformers keeps in fp32 (or computes in fp32 from): not rounded in "bf16" mode.
KEEP_FP32 = re.compile(r"((^|\.)gate\.weight|e_score_correction_bias|dt_bias|A_log|\.D)$")


@dataclass
class HybridCache:
    """Per-layer caches of a batch of sequences; layout in the module docstring."""

    lengths: torch.Tensor  # [B] int64
    layers: dict[int, object]
    max_seq_len: int
    replay_window: int | None = None
    ring_capacity: int = 0  # ReplaySSM ring entries per layer and sequence (0: recurrent)
    pending: int | None = None  # T of the verified step awaiting commit

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    def row(self, b: int) -> HybridCache:
        """A batch-1 view of sequence b; writes through it land in this cache."""
        return HybridCache(self.lengths[b : b + 1],
                           {i: c.row(b) for i, c in self.layers.items()},  # type: ignore[attr-defined]
                           self.max_seq_len, self.replay_window, self.ring_capacity, self.pending)


@dataclass
class Block:
    """norm -> op -> residual add. `kind` selects how the op uses the cache."""

    layer: int
    kind: str  # "recurrent" | "kv" (attention, MLA) | "ffn"
    norm: Callable[[torch.Tensor], torch.Tensor]
    op: object


class HybridModel:
    """Base of the three family models; subclasses build `self.blocks`."""

    def __init__(self, cfg: HybridConfig, weights: dict[str, torch.Tensor], mode: str = "fp32",
                 device: torch.device | str = "cpu", replay_window: int | None = None):
        if mode not in MODES:
            raise HybridError(f"unknown mode {mode!r}; use one of {MODES}")
        if replay_window is not None and (not isinstance(replay_window, int)
                                          or replay_window < 1):
            raise HybridError(f"replay_window must be a positive integer, got {replay_window!r}")
        check_weights(cfg, weights)
        self.cfg, self.mode, self.device, self.replay_window = cfg, mode, device, replay_window
        self.w = {n: self._convert(n, t) for n, t in weights.items()}
        self.embed = self.w[embed_name(cfg)]
        self.final_norm = self.w[final_norm_name(cfg)]
        self.lm_head = self.w[embed_name(cfg) if cfg.tie_word_embeddings else "lm_head.weight"]
        self.blocks: list[Block] = self.build_blocks()

    def _convert(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.mode == "fp32" or KEEP_FP32.search(name):
            return t.to(device=self.device, dtype=torch.float32)
        return t.to(device=self.device, dtype=torch.bfloat16)

    # ---- family hooks --------------------------------------------------------------------------
    def build_blocks(self) -> list[Block]:
        raise NotImplementedError

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The family's RMSNorm (fp32), before rounding."""
        return rms_norm(x, w, self.cfg.rms_norm_eps)

    def _normed(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        w = self.w[name]
        return lambda h: store(self.norm(h, w), self.mode)

    # ---- cache ---------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_seq_len: int, max_step_tokens: int = 8) -> HybridCache:
        """An empty cache. With ReplaySSM the ring holds replay_window - 1 + max_step_tokens
        entries: a step may verify up to max_step_tokens tokens."""
        if batch < 1 or max_seq_len < 1 or max_step_tokens < 1:
            raise HybridError("batch, max_seq_len and max_step_tokens must be positive")
        if max_seq_len > self.cfg.max_position_embeddings:
            raise HybridError(f"max_seq_len {max_seq_len} exceeds max_position_embeddings "
                              f"{self.cfg.max_position_embeddings}")
        capacity = 0 if self.replay_window is None else self.replay_window - 1 + max_step_tokens
        layers: dict[int, object] = {}
        for blk in self.blocks:
            if blk.kind == "recurrent":
                layers[blk.layer] = new_layer_cache(blk.op, batch, capacity, self.device)  # type: ignore[arg-type]
            elif blk.kind == "kv":
                layers[blk.layer] = blk.op.new_cache(batch, max_seq_len, self.device)  # type: ignore[attr-defined]
        return HybridCache(torch.zeros(batch, dtype=torch.int64, device=self.device), layers,
                           max_seq_len, self.replay_window, capacity)

    # ---- the forward pass ----------------------------------------------------------------------
    def _forward(self, cache: HybridCache, tokens: torch.Tensor, replay: bool, prefill: bool
                 ) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V]; writes caches but does not advance lengths."""
        h = self.embed[tokens].to(torch.float32)  # [B, T, D] residual stream, fp32
        for blk in self.blocks:
            xn = blk.norm(h)
            if blk.kind == "recurrent":
                h = h + run_layer(blk.op, cache.layers[blk.layer], xn, replay, prefill)  # type: ignore[arg-type]
            elif blk.kind == "kv":
                h = h + blk.op(xn, cache.layers[blk.layer], cache.lengths)  # type: ignore[operator]
            else:
                h = h + blk.op(xn)  # type: ignore[operator]
        out = store(self.norm(h, self.final_norm), self.mode)
        return linear(out, self.lm_head)

    def _check_tokens(self, cache: HybridCache, tokens: torch.Tensor) -> None:
        if cache.replay_window != self.replay_window:
            raise HybridError(f"the cache was made for replay_window {cache.replay_window}, this "
                              f"model runs replay_window {self.replay_window}")
        if cache.pending is not None:
            raise HybridError(f"the previous step of {cache.pending} tokens is not committed yet; "
                              "call commit first")
        if tokens.dim() != 2 or tokens.shape[0] != cache.batch or tokens.shape[1] < 1:
            raise HybridError(f"tokens must be [B={cache.batch}, T>=1], got "
                              f"{list(tokens.shape)}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise HybridError(f"tokens must be integer, got {tokens.dtype}")
        bad = (tokens < 0) | (tokens >= self.cfg.vocab_size)
        if bad.any():
            raise HybridError(f"token id {int(tokens[bad][0])} is outside the vocabulary "
                              f"[0, {self.cfg.vocab_size})")
        longest = int(cache.lengths.max()) + tokens.shape[1]
        if longest > cache.max_seq_len:
            raise HybridError(f"{tokens.shape[1]} more tokens would reach length {longest}, past "
                              f"the cache's max_seq_len {cache.max_seq_len}")

    @torch.no_grad()
    def prefill(self, cache: HybridCache, prompts: list[list[int]]) -> torch.Tensor:
        """Run each prompt (recurrently) into an empty cache; returns last-token logits [B, V]."""
        if len(prompts) != cache.batch:
            raise HybridError(f"{len(prompts)} prompts for a cache of batch {cache.batch}")
        if int(cache.lengths.max()) != 0:
            raise HybridError("prefill needs an empty cache (use decode to continue a sequence)")
        if any(len(p) == 0 for p in prompts):
            raise HybridError("empty prompt: every prompt needs at least one token")
        out = []
        for b, p in enumerate(prompts):
            row = cache.row(b)
            toks = torch.tensor([p], dtype=torch.int64, device=self.device)
            self._check_tokens(row, toks)
            logits = self._forward(row, toks, replay=False, prefill=True)
            row.lengths += len(p)
            out.append(logits[0, -1])
        return torch.stack(out, dim=0)

    @torch.no_grad()
    def decode(self, cache: HybridCache, tokens: torch.Tensor) -> torch.Tensor:
        """T tokens per sequence, all committed: logits [B, T, V]."""
        if self.replay_window is None:
            self._check_tokens(cache, tokens)
            logits = self._forward(cache, tokens, replay=False, prefill=False)
            cache.lengths += tokens.shape[1]
            return logits
        logits = self.verify(cache, tokens)
        self.commit(cache, torch.full((cache.batch,), tokens.shape[1] - 1, dtype=torch.int64))
        return logits

    @torch.no_grad()
    def verify(self, cache: HybridCache, tokens: torch.Tensor) -> torch.Tensor:
        """Speculative step (ReplaySSM only): logits [B, T, V] of 1 + k tokens per sequence from
        the committed state plus the ring; nothing is committed until `commit`."""
        if self.replay_window is None:
            raise HybridError("verify needs a ReplaySSM model (replay_window set); the recurrent "
                              "update keeps no committed state to return to")
        self._check_tokens(cache, tokens)
        t = tokens.shape[1]
        for blk in self.blocks:
            if blk.kind == "recurrent":
                count = cache.layers[blk.layer].count  # type: ignore[attr-defined]
                n = int(count.max())
                if n + t > cache.ring_capacity:
                    raise HybridError(
                        f"ReplaySSM ring overflow: {n} committed + {t} new entries exceed the "
                        f"ring capacity {cache.ring_capacity} (replay_window "
                        f"{self.replay_window} - 1 + max_step_tokens); create the cache with a "
                        "larger max_step_tokens")
                break  # every recurrent layer has the same count
        logits = self._forward(cache, tokens, replay=True, prefill=False)
        cache.pending = tokens.shape[1]
        return logits

    @torch.no_grad()
    def commit(self, cache: HybridCache, accepted: torch.Tensor | list[int]) -> None:
        """Keep the verified token plus accepted[b] drafts of each sequence of the last step."""
        if cache.pending is None:
            raise HybridError("nothing to commit: no verified step is pending")
        acc = torch.as_tensor(accepted, dtype=torch.int64).reshape(-1)
        if acc.numel() != cache.batch:
            raise HybridError(f"accepted has {acc.numel()} entries for batch {cache.batch}")
        t = cache.pending
        if (acc < 0).any() or (acc > t - 1).any():
            bad = int(acc[(acc < 0) | (acc > t - 1)][0])
            raise HybridError(f"cannot accept {bad} drafts: the step proposed {t} tokens "
                              f"(1 verified + {t - 1} drafts), so 0 <= accepted <= {t - 1}")
        keep = acc + 1
        assert self.replay_window is not None
        for blk in self.blocks:
            if blk.kind == "recurrent":
                commit_layer(blk.op, cache.layers[blk.layer], keep, self.replay_window)  # type: ignore[arg-type]
        cache.lengths += keep.to(cache.lengths.device)
        cache.pending = None

    def recurrent_state(self, cache: HybridCache, layer: int) -> torch.Tensor:
        """State [B, ...] of recurrent layer `layer` as the recurrent update would hold it (the
        committed state with committed ring entries folded in under ReplaySSM)."""
        for blk in self.blocks:
            if blk.layer == layer and blk.kind == "recurrent":
                return effective_state(blk.op, cache.layers[layer])  # type: ignore[arg-type]
        raise HybridError(f"layer {layer} is not a recurrent layer")


@torch.no_grad()
def generate(model: HybridModel, prompts: list[list[int]], steps: int,
             max_seq_len: int | None = None) -> list[list[int]]:
    """Greedy decoding (lowest index wins ties); returns the `steps` new tokens per prompt."""
    if steps < 0:
        raise HybridError(f"steps must be >= 0, got {steps}")
    longest = max((len(p) for p in prompts), default=0) + steps
    cache = model.new_cache(len(prompts), max_seq_len or max(longest, 1))
    logits = model.prefill(cache, prompts)
    out: list[list[int]] = [[] for _ in prompts]
    for s in range(steps):
        tok = logits.argmax(dim=-1)  # torch.argmax returns the first maximal index
        for b, t in enumerate(tok.tolist()):
            out[b].append(int(t))
        if s + 1 < steps:
            logits = model.decode(cache, tok[:, None])[:, -1]
    return out


__all__ = ["HybridCache", "HybridModel", "Block", "generate", "DEFAULT_WINDOW", "RecurrentMixer",
           "SSMLayerCache"]
