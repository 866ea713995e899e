"""The torch reference decode model: the truth every kernel output is diffed against.

One class for every model family: `ReferenceModel` runs `cfg.blocks` (megakernel.models), each
block `h += op(norm(h))` with `op` the reference layer of the block's kind (reference/layers/).
Plain and readable over fast: one block at a time, attention one sequence at a time. Runs on any
torch device that supports float64 (CPU, CUDA); on CUDA keep TF32 matmuls off (torch's default),
or "fp32" mode does not compute in fp32.

API
    model = ReferenceModel(cfg, weights, mode="fp32" | "bf16", device="cpu",
                           replay_window=None | L)
    cache = model.new_cache(batch, max_seq_len, max_step_tokens=8)
    model.prefill(cache, prompts)   -> [B, V] fp32 logits at each prompt's last token
    model.decode(cache, tokens)     -> [B, T, V] (tokens [B, T] integer ids; all T are committed)
    model.verify(cache, tokens)     -> [B, T, V] speculative step, nothing committed yet (ReplaySSM)
    model.commit(cache, accepted)   keep 1 + accepted[b] of the T verified tokens of sequence b
    model.recurrent_state(cache, layer) -> [B, ...] the state the recurrent update would hold
    generate(model, prompts, steps) -> greedy new tokens (`greedy`: lowest index wins ties)

Recurrent layers (GDN, KDA, Mamba2) run either recurrently (`replay_window=None`: state updated
every token) or as ReplaySSM with window L (layers/replay.py): outputs from the committed state plus
a ring of inputs, folded every L committed tokens. Prefill always runs recurrently and leaves an
empty ring.

Cache layout (`Cache`)
    lengths [B] int64: tokens committed per sequence (= the next position).
    layers[i] for each decoder layer i with a cached block:
      attention: KVLayerCache k, v [B, Hkv, S_max, D] (layers/attention.py)
      MLA:       MLACache c [B, S_max, r], k_rope [B, S_max, d_rope] (layers/mla.py)
      GDN/KDA/Mamba2: SSMLayerCache conv [B, C, K-1], state, ring, count (layers/replay.py); fp32.
    KV and latent caches are NaN in unwritten slots (a read of one shows up as NaN), fp32 in "fp32"
    mode and bf16 in "bf16" mode. `attention_kv()` stacks the attention layers' k, v as
    [n_attention_layers, B, Hkv, S_max, D] (what the kernel keeps in its KV arena).
A step of T tokens writes KV slots lengths[b] .. lengths[b]+T-1; `commit` advances lengths by the
kept count, so slots of rejected drafts are overwritten by the next step. Sequences may sit at
different lengths.

Modes
    "fp32": the truth. Weights upcast to fp32, every activation fp32, no rounding anywhere.
    "bf16": the bf16 mirror of the kernel. Weights bf16, except those transformers keeps (or
    computes from) in fp32 (`megakernel.models.weights.keep_fp32`: MoE router weight and bias,
    dt_bias, A_log, D) and an FP8 model's quantized matrices, dequantized exactly (code * scale
    in fp32) in both modes and never rounded again (docs/FP8.md). Every matvec multiplies these
    weights by bf16-valued inputs with fp32 accumulation. Activations are rounded to bf16
    (`store`) exactly where the kernel stores bf16, and nowhere else:
      1. the residual stream h is fp32 throughout (embedding row bf16 -> fp32; block outputs are
         added in fp32, never rounded);
      2. every RMSNorm runs in fp32, times the (bf16) weight in fp32, and is rounded (it is a
         matvec input); the same for the final norm before the LM head;
      3. attention: q, k after projection (+ bias), q/k norm and RoPE, all fp32 (cos/sin from
         float64 angles rounded once to fp32), rounded (q kept, k into the cache); v rounded into
         the cache; the output gate fp32; scores, softmax and the weighted sum fp32; the output
         (times sigmoid(gate)) rounded (the o_proj input);
      4. MLA: q, the latent c after its norm and k_rope rounded (cache), the q_a intermediate
         rounded; the attention output rounded;
      5. SwiGLU / expert: silu(gate) * up in fp32, rounded (down_proj input); relu^2 likewise;
         MoE router, routing weights and the expert sum fp32;
      6. recurrent layers: convs, gates, decays, states, ring entries fp32; low-rank
         intermediates (KDA f_a, g_a) and the gated-norm output (out_proj input) rounded;
      7. logits fp32; the greedy token is the argmax, lowest index on ties.

`ReferenceError` deliberately shares its name with Python's builtin weakref error (the API
contract fixes it); import it from this package.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from megakernel.models import ConfigError, ModelConfig, fp8, validate
from megakernel.models.weights import WeightError, check_weights, expected_shapes, keep_fp32

from .layers import ReferenceLayer, layer_class
from .layers.attention import KVLayerCache
from .layers.common import MODES, ReferenceError, linear, model_norm, store
from .layers.mla import MLACache
from .layers.replay import (
    DEFAULT_WINDOW,
    commit_layer,
    effective_state,
)

__all__ = ["Cache", "DEFAULT_WINDOW", "ReferenceError", "ReferenceModel", "generate", "greedy"]


class ReferenceWeightError(ReferenceError, WeightError):
    """Weights that do not fit the config (both a ReferenceError and a WeightError)."""


class ReferenceConfigError(ReferenceError, ConfigError):
    """A config megakernel does not support (both a ReferenceError and a ConfigError)."""


@dataclass
class Cache:
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

    def row(self, b: int) -> Cache:
        """A batch-1 view of sequence b; writes through it land in this cache."""
        return Cache(self.lengths[b : b + 1],
                     {i: c.row(b) for i, c in self.layers.items()},  # type: ignore[attr-defined]
                     self.max_seq_len, self.replay_window, self.ring_capacity, self.pending)

    def clone(self) -> Cache:
        """An independent copy (tensors copied)."""
        return copy.deepcopy(self)

    def attention_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [n_attention_layers, B, Hkv, S_max, D] of the attention layers, in layer order
        (copies; the layout the kernel keeps in its KV arena)."""
        kv = [c for _, c in sorted(self.layers.items()) if isinstance(c, KVLayerCache)]
        if not kv:
            raise ReferenceError("the cache holds no attention layers")
        return torch.stack([c.k for c in kv]), torch.stack([c.v for c in kv])

    def kv_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [slots, B, heads, S_max, dims] of every layer with a KV or latent cache, in layer
        order (layer_kv): the layout of the kernel's KV arena, MLA layers included."""
        kv = [layer_kv(c) for _, c in sorted(self.layers.items())
              if isinstance(c, (KVLayerCache, MLACache))]
        if not kv:
            raise ReferenceError("the cache holds no attention or MLA layers")
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])


def layer_kv(c: KVLayerCache | MLACache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, heads, S_max, dims] of one layer's cache as the kernel's KV arena holds it:
    attention (k, v); MLA (the latent c [B, S, r] and k_rope [B, S, dr], as one head)."""
    if isinstance(c, MLACache):
        return c.c[:, None], c.k_rope[:, None]
    return c.k, c.v


class ReferenceModel:
    """Greedy-decode reference for one model config and one weight dict (Hugging Face names)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], mode: str = "fp32",
                 device: torch.device | str = "cpu", replay_window: int | None = None) -> None:
        if mode not in MODES:
            raise ReferenceError(f"unknown mode {mode!r}; expected one of {MODES}")
        if replay_window is not None and (
                not isinstance(replay_window, int) or isinstance(replay_window, bool)
                or replay_window < 1):
            raise ReferenceError(f"replay_window must be a positive integer, got "
                                 f"{replay_window!r}")
        try:
            validate(cfg)
        except ConfigError as e:
            raise ReferenceConfigError(str(e)) from e
        if cfg.quant is not None:  # the FP8 model's truth: each weight dequantized exactly
            try:
                weights = fp8.dequantized(cfg, weights)
            except fp8.Fp8Error as e:
                raise ReferenceWeightError(str(e)) from None
        _check_weights(cfg, weights)
        self.cfg, self.mode, self.replay_window = cfg, mode, replay_window
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors say
        fp32 = keep_fp32(cfg) | set(fp8.quantized_names(cfg))  # dequantized FP8: never rounded
        self.w = {n: weights[n].to(device=self.device, dtype=torch.float32 if mode == "fp32"
                                   or n in fp32 else torch.bfloat16)
                  for n in expected_shapes(cfg)}
        self.embed = self.w[cfg.embed_name]
        self.final_norm = self.w[cfg.final_norm_name]
        self.lm_head = self.w[cfg.embed_name if cfg.tie_word_embeddings else cfg.lm_head_name]
        self.norm = model_norm(cfg.norm_kind)
        self.ops: list[ReferenceLayer] = [
            layer_class(blk.kind).from_block(blk, cfg, self.w, mode, self.device)
            for blk in cfg.blocks]
        self.cached: dict[int, ReferenceLayer] = {}  # decoder layer -> its block with a cache
        for blk, op in zip(cfg.blocks, self.ops, strict=True):
            if op.state is not None:
                if blk.layer in self.cached:
                    raise ReferenceError(f"layer {blk.layer} has two blocks with a cache")
                self.cached[blk.layer] = op

    # ---- cache ---------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_seq_len: int, max_step_tokens: int = 8) -> Cache:
        """An empty cache for `batch` sequences of up to `max_seq_len` tokens each. With ReplaySSM
        the ring holds replay_window - 1 + max_step_tokens entries: a step may verify up to
        max_step_tokens tokens."""
        if batch < 1 or max_seq_len < 1:
            raise ReferenceError(f"cache needs batch >= 1 and max_seq_len >= 1, got {batch} and "
                                 f"{max_seq_len}")
        if max_step_tokens < 1:
            raise ReferenceError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        if max_seq_len > self.cfg.max_position_embeddings:
            raise ReferenceError(f"max_seq_len {max_seq_len} exceeds max_position_embeddings "
                                 f"{self.cfg.max_position_embeddings}")
        capacity = 0 if self.replay_window is None else self.replay_window - 1 + max_step_tokens
        layers = {i: op.new_cache(batch, max_seq_len, capacity, self.device)
                  for i, op in self.cached.items()}
        return Cache(torch.zeros(batch, dtype=torch.int64, device=self.device), layers,
                     max_seq_len, self.replay_window, capacity)

    # ---- public API ------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, cache: Cache, prompts: list[list[int]]) -> torch.Tensor:
        """Run prompt b into the empty sequence b, recurrently and one sequence at a time;
        -> [B, V] fp32 logits at each prompt's last token."""
        self._check_cache(cache)
        if len(prompts) != cache.batch:
            raise ReferenceError(f"batch mismatch: {len(prompts)} prompts for a cache of batch "
                                 f"{cache.batch}")
        for b, p in enumerate(prompts):
            if len(p) == 0:
                raise ReferenceError(f"empty prompt: prompt {b} has no tokens")
        if int(cache.lengths.max()) != 0:
            raise ReferenceError("prefill needs an empty cache (use decode to continue a "
                                 "sequence)")
        rows = [torch.as_tensor(p, dtype=torch.int64, device=self.device)[None] for p in prompts]
        for b, row in enumerate(rows):  # validate all before writing anything
            self._check_tokens(cache.row(b), row, first_row=b)
        out = []
        for b, row in enumerate(rows):
            seq = cache.row(b)
            out.append(self._forward(seq, row, replay=False, prefill=True)[0, -1])
            seq.lengths += row.shape[1]
        return torch.stack(out, dim=0)

    @torch.no_grad()
    def decode(self, cache: Cache, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, T] (T >= 1, causal among themselves), all committed;
        -> logits [B, T, V] fp32."""
        tokens = self._step_tokens(cache, tokens)
        if self.replay_window is None:
            logits = self._forward(cache, tokens, replay=False, prefill=False)
            cache.lengths += tokens.shape[1]
            return logits
        logits = self.verify(cache, tokens)
        self.commit(cache, torch.full((cache.batch,), tokens.shape[1] - 1, dtype=torch.int64))
        return logits

    @torch.no_grad()
    def verify(self, cache: Cache, tokens: torch.Tensor) -> torch.Tensor:
        """Speculative step (ReplaySSM only): logits [B, T, V] of 1 + k tokens per sequence from
        the committed state plus the ring; nothing is committed until `commit`."""
        if self.replay_window is None:
            raise ReferenceError("verify needs a ReplaySSM model (replay_window set); the "
                                 "recurrent update keeps no committed state to return to")
        tokens = self._step_tokens(cache, tokens)
        t = tokens.shape[1]
        recurrent = [i for i, op in self.cached.items() if op.state == "recurrent"]
        for layer in recurrent[:1]:  # every recurrent layer has the same count
            n = int(cache.layers[layer].count.max())  # type: ignore[attr-defined]
            if n + t > cache.ring_capacity:
                raise ReferenceError(
                    f"ReplaySSM ring overflow: {n} committed + {t} new entries exceed the ring "
                    f"capacity {cache.ring_capacity} (replay_window {self.replay_window} - 1 + "
                    "max_step_tokens); create the cache with a larger max_step_tokens")
        logits = self._forward(cache, tokens, replay=True, prefill=False)
        cache.pending = t
        return logits

    @torch.no_grad()
    def commit(self, cache: Cache, accepted: torch.Tensor | list[int]) -> None:
        """Keep the verified token plus accepted[b] drafts of each sequence of the last step."""
        if cache.pending is None:
            raise ReferenceError("nothing to commit: no verified step is pending")
        acc = torch.as_tensor(accepted, dtype=torch.int64).reshape(-1)
        if acc.numel() != cache.batch:
            raise ReferenceError(f"accepted has {acc.numel()} entries for batch {cache.batch}")
        t = cache.pending
        if (acc < 0).any() or (acc > t - 1).any():
            bad = int(acc[(acc < 0) | (acc > t - 1)][0])
            raise ReferenceError(f"cannot accept {bad} drafts: the step proposed {t} tokens "
                                 f"(1 verified + {t - 1} drafts), so 0 <= accepted <= {t - 1}")
        keep = acc + 1
        assert self.replay_window is not None  # pending is only set by verify
        for layer, op in self.cached.items():
            if op.state == "recurrent":
                commit_layer(op, cache.layers[layer], keep, self.replay_window)  # type: ignore[arg-type]
        cache.lengths += keep.to(cache.lengths.device)
        cache.pending = None

    def recurrent_state(self, cache: Cache, layer: int) -> torch.Tensor:
        """State [B, ...] of recurrent layer `layer` as the recurrent update would hold it (the
        committed state with committed ring entries folded in under ReplaySSM); a copy."""
        op = self.cached.get(layer)
        if op is None or op.state != "recurrent":
            raise ReferenceError(f"layer {layer} is not a recurrent layer")
        return effective_state(op, cache.layers[layer])  # type: ignore[arg-type]

    # ---- the forward pass ----------------------------------------------------------------------
    def _forward(self, cache: Cache, tokens: torch.Tensor, replay: bool, prefill: bool
                 ) -> torch.Tensor:
        """tokens [B, T] at positions lengths[b] + t -> logits [B, T, V]; writes the caches but
        does not advance lengths."""
        h = self.embed[tokens].to(torch.float32)  # [B, T, D] residual stream, fp32
        for blk, op in zip(self.cfg.blocks, self.ops, strict=True):
            xn = store(self.norm(h, self.w[blk.norm], self.cfg.rms_norm_eps), self.mode)
            layer_cache = cache.layers[blk.layer] if op.state is not None else None
            h = h + op.forward(xn, layer_cache, cache.lengths, replay, prefill)
        out = store(self.norm(h, self.final_norm, self.cfg.rms_norm_eps), self.mode)
        return linear(out, self.lm_head)

    # ---- input checks ----------------------------------------------------------------------------
    def _check_cache(self, cache: Cache) -> None:
        if not isinstance(cache, Cache):
            raise ReferenceError(f"cache must be a reference Cache (new_cache), got "
                                 f"{type(cache).__name__}")
        if cache.replay_window != self.replay_window:
            raise ReferenceError(f"the cache was made for replay_window {cache.replay_window}, "
                                 f"this model runs replay_window {self.replay_window}")
        lengths = cache.lengths
        if lengths.dim() != 1 or lengths.dtype != torch.int64:
            raise ReferenceError(f"cache lengths must be [B] int64, got shape "
                                 f"{tuple(lengths.shape)} and {lengths.dtype}")
        if lengths.device != self.device:
            raise ReferenceError(f"cache is on {lengths.device}, model on {self.device}")
        if sorted(cache.layers) != sorted(self.cached):
            raise ReferenceError(f"cache has layers {sorted(cache.layers)}, the model caches "
                                 f"layers {sorted(self.cached)} (a cache of another model?)")
        for layer, op in self.cached.items():
            try:
                op.check_cache(cache.layers[layer], cache.batch, cache.max_seq_len,
                               cache.ring_capacity, self.device)
            except ReferenceError as e:
                raise ReferenceError(f"layer {layer}: {e}") from None

    def _step_tokens(self, cache: Cache, tokens: torch.Tensor) -> torch.Tensor:
        """Checked tokens [B, T] of a decode or verify step, as int64 on the model's device."""
        self._check_cache(cache)
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 2:
            raise ReferenceError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if tokens.shape[0] != cache.batch:
            raise ReferenceError(f"batch mismatch: tokens have batch {tokens.shape[0]}, cache "
                                 f"has {cache.batch}")
        self._check_tokens(cache, tokens)
        return tokens.to(device=self.device, dtype=torch.int64)

    def _check_tokens(self, cache: Cache, tokens: torch.Tensor, first_row: int = 0) -> None:
        """tokens [B, T]: integer ids in [0, vocab) that fit in the cache, with nothing pending."""
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ReferenceError(f"token ids must be integers, got dtype {tokens.dtype}")
        if tokens.shape[1] < 1:
            raise ReferenceError("no tokens: decode needs T >= 1 tokens per sequence")
        if cache.pending is not None:
            raise ReferenceError(f"the previous step of {cache.pending} tokens is not committed "
                                 "yet; call commit first")
        vocab = self.cfg.vocab_size
        ids = tokens.to(torch.int64)
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ReferenceError(
                f"token id {int(ids[b, t])} at sequence {first_row + b}, index {t} is outside "
                f"the vocabulary [0, {vocab})")
        t_new = tokens.shape[1]
        for b, n in enumerate(cache.lengths.tolist()):
            if n + t_new > cache.max_seq_len:
                raise ReferenceError(
                    f"sequence {first_row + b} would exceed the cache's max length: {n} cached + "
                    f"{t_new} new > {cache.max_seq_len}")


def _check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """ReferenceWeightError naming what does not fit (`check_weights`, plus a clearer message
    for a stored LM head of a tied model that differs from the embedding)."""
    head = weights.get(cfg.lm_head_name)
    embed = weights.get(cfg.embed_name)
    if (cfg.tie_word_embeddings and head is not None and embed is not None
            and not (head.shape == embed.shape and torch.equal(head, embed))):
        raise ReferenceWeightError(f"config ties word embeddings but {cfg.lm_head_name} differs "
                                   f"from {cfg.embed_name}")
    try:
        check_weights(cfg, weights)
    except WeightError as e:
        raise ReferenceWeightError(str(e)) from None


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim; the lowest index wins ties."""
    return torch.argmax(logits, dim=-1)


@torch.no_grad()
def generate(model: ReferenceModel, prompts: list[list[int]], steps: int,
             max_seq_len: int | None = None) -> list[list[int]]:
    """Greedy generation of `steps` new tokens per prompt (prompt tokens not included)."""
    if steps < 0:
        raise ReferenceError(f"steps must be >= 0, got {steps}")
    if not prompts:
        raise ReferenceError("no prompts given")
    if steps == 0:
        return [[] for _ in prompts]
    if max_seq_len is None:
        max_seq_len = max(len(p) for p in prompts) + steps - 1
    from megakernel.common.finite import check_logits

    cache = model.new_cache(len(prompts), max_seq_len)
    logits = model.prefill(cache, prompts)  # [B, V]
    check_logits(logits, 0, "reference")
    token = greedy(logits)  # [B]
    out = [token]
    for step in range(1, steps):
        logits = model.decode(cache, token[:, None])  # [B, 1, V]
        check_logits(logits, step, "reference")
        token = greedy(logits)[:, 0]
        out.append(token)
    return torch.stack(out, dim=1).tolist()
