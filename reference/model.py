"""Torch reference decode model for Llama and Qwen3: the truth that the kernel is checked against.

Plain and readable over fast: one layer at a time, attention one sequence at a time. Runs on any
torch device that supports float64 (CPU, CUDA); on CUDA, keep TF32 matmuls off (torch's default)
or "fp32" mode is no longer fp32.

KV cache layout (`KVCache`)
    k, v:    [L, B, Hkv, S_max, D]   layer, sequence, kv head, position, head dim
    lengths: [B] int64               tokens already cached per sequence
    For sequence b, positions 0 .. lengths[b]-1 hold valid keys/values (k after RoPE, and after
    the q/k norm for Qwen3). Slots at and past lengths[b] are NaN when the cache is created and
    are never read, so a read of an unwritten slot shows up as NaN. The dtype is fp32 in "fp32"
    mode and bf16 in "bf16" mode. A step with T new tokens writes positions lengths[b] ..
    lengths[b]+T-1 and then adds T to lengths[b]; sequences may sit at different lengths.

Modes
    "fp32": the truth. Weights upcast to fp32, every activation fp32, no rounding anywhere.
    "bf16": the bf16 mirror of the kernel. Weights are bf16; every matvec multiplies bf16 weights
    by bf16-valued inputs with fp32 accumulation; activations are rounded to bf16 exactly where
    the kernel stores bf16, and nowhere else:
      1. residual stream h: fp32 throughout (embedding row bf16 -> fp32; o_proj and down_proj
         outputs are added in fp32, never rounded);
      2. RMSNorm in fp32, times the bf16 weight in fp32, rounded to bf16 (the matvec input);
         the same for the final norm before the LM head;
      3. q, k: projection (fp32) -> Qwen3 per-head RMSNorm (fp32) -> RoPE (fp32; cos/sin from
         float64 angles rounded once to fp32) -> rounded to bf16 (q kept, k into the bf16 cache);
         v: projection rounded to bf16 into the cache;
      4. attention scores, softmax and weighted sum in fp32; the output is rounded to bf16
         (the o_proj input);
      5. MLP: gate and up in fp32, silu(gate) * up in fp32, rounded to bf16 (down_proj input);
      6. logits fp32; the greedy token is the argmax, lowest index on ties.

`ReferenceError` deliberately shares its name with Python's builtin weakref error (the API
contract fixes it); import it from this package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.config import ModelConfig
from megakernel.weights import expected_shapes as expected_weight_shapes

from .layers import MODES, causal_attention, linear, rms_norm, store
from .rope import apply_rope, inv_freq_tensor, rope_cos_sin


class ReferenceError(ValueError):  # noqa: A001 (name fixed by the API contract)
    """Bad input to the reference model (token ids, cache capacity, prompts, shapes, weights)."""


@dataclass
class KVCache:
    """Per-layer keys and values of a batch of sequences; layout in the module docstring."""

    k: torch.Tensor  # [L, B, Hkv, S_max, D]
    v: torch.Tensor  # [L, B, Hkv, S_max, D]
    lengths: torch.Tensor  # [B] int64

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def sequence(self, b: int) -> KVCache:
        """A view of sequence b as a batch-1 cache; writes through it land in this cache."""
        return KVCache(self.k[:, b : b + 1], self.v[:, b : b + 1], self.lengths[b : b + 1])


def _checked_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights the model needs, after checking names and shapes."""
    want = expected_weight_shapes(cfg)
    missing = [n for n in want if n not in weights]
    if missing:
        raise ReferenceError(f"weights are missing {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ReferenceError(
                f"weight {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
    extra = [n for n in weights if n not in want]
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        # Some checkpoints store the tied head anyway; accept it only if it is the embedding.
        if not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]):
            raise ReferenceError("config ties word embeddings but lm_head.weight differs from them")
        extra.remove("lm_head.weight")
    if extra:
        raise ReferenceError(f"weights hold {len(extra)} unexpected tensors, e.g. {extra[:3]}")
    return {n: weights[n] for n in want}


class ReferenceModel:
    """Greedy-decode reference for one `ModelConfig` and one weight dict (Hugging Face names)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        mode: str = "fp32",
        device: torch.device | str = "cpu",
    ) -> None:
        if mode not in MODES:
            raise ReferenceError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.cfg = cfg
        self.mode = mode
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report
        self.weight_dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        self.cache_dtype = self.weight_dtype
        self.w = {
            name: t.to(device=self.device, dtype=self.weight_dtype)
            for name, t in _checked_weights(cfg, weights).items()
        }
        self.inv_freq = inv_freq_tensor(cfg, self.device)  # [D/2] float64

    @property
    def lm_head(self) -> torch.Tensor:
        name = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        return self.w[name]

    # ---- public API ------------------------------------------------------------------------------
    def new_cache(self, batch: int, max_seq_len: int) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_seq_len` tokens each."""
        if batch < 1 or max_seq_len < 1:
            raise ReferenceError(
                f"cache needs batch >= 1 and max_seq_len >= 1, got {batch} and {max_seq_len}"
            )
        c = self.cfg
        shape = (c.num_layers, batch, c.num_kv_heads, max_seq_len, c.head_dim)
        nan = float("nan")
        return KVCache(
            k=torch.full(shape, nan, dtype=self.cache_dtype, device=self.device),
            v=torch.full(shape, nan, dtype=self.cache_dtype, device=self.device),
            lengths=torch.zeros(batch, dtype=torch.int64, device=self.device),
        )

    def prefill(self, cache: KVCache, prompts: list[list[int]]) -> torch.Tensor:
        """Append prompt b to sequence b, one sequence at a time; -> [B, V] last-token logits."""
        self._check_cache(cache)
        if len(prompts) != cache.batch:
            raise ReferenceError(
                f"batch mismatch: {len(prompts)} prompts for a cache of batch {cache.batch}"
            )
        for b, p in enumerate(prompts):
            if len(p) == 0:
                raise ReferenceError(f"empty prompt: prompt {b} has no tokens")
        rows = [torch.as_tensor(p, dtype=torch.int64, device=self.device)[None] for p in prompts]
        for b, row in enumerate(rows):  # validate all before writing anything
            self._check_tokens(cache.sequence(b), row, first_row=b)
        logits = [self._forward(cache.sequence(b), row)[:, -1] for b, row in enumerate(rows)]
        return torch.cat(logits, dim=0)  # [B, V]

    def decode(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, T] (T >= 1, causal among themselves); -> logits [B, T, V] fp32."""
        self._check_cache(cache)
        tokens = torch.as_tensor(tokens)
        if tokens.dim() != 2:
            raise ReferenceError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if tokens.shape[0] != cache.batch:
            raise ReferenceError(
                f"batch mismatch: tokens have batch {tokens.shape[0]}, cache has {cache.batch}"
            )
        tokens = tokens.to(self.device)
        self._check_tokens(cache, tokens)
        return self._forward(cache, tokens)

    # ---- input checks ----------------------------------------------------------------------------
    def _check_cache(self, cache: KVCache) -> None:
        c = self.cfg
        want = (c.num_layers, cache.batch, c.num_kv_heads, cache.max_seq_len, c.head_dim)
        if tuple(cache.k.shape) != want or tuple(cache.v.shape) != want:
            raise ReferenceError(
                f"cache k/v shapes {tuple(cache.k.shape)}/{tuple(cache.v.shape)} do not match "
                f"the model's [L, B, Hkv, S_max, D] = {want}"
            )
        if cache.k.dtype != self.cache_dtype or cache.v.dtype != self.cache_dtype:
            raise ReferenceError(
                f"cache dtype {cache.k.dtype} does not match {self.cache_dtype} ({self.mode} mode)"
            )
        if cache.k.device != self.device:
            raise ReferenceError(f"cache is on {cache.k.device}, model on {self.device}")
        if tuple(cache.lengths.shape) != (cache.batch,):
            raise ReferenceError(
                f"cache lengths must have shape [{cache.batch}], got {tuple(cache.lengths.shape)}"
            )

    def _check_tokens(self, cache: KVCache, tokens: torch.Tensor, first_row: int = 0) -> None:
        """tokens [B, T]: integer ids in [0, vocab) that fit in the cache."""
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ReferenceError(f"token ids must be integers, got dtype {tokens.dtype}")
        if tokens.shape[1] < 1:
            raise ReferenceError("no tokens: decode needs T >= 1 tokens per sequence")
        vocab = self.cfg.vocab_size
        bad = (tokens < 0) | (tokens >= vocab)
        if bad.any():
            b, t = (int(i) for i in bad.nonzero()[0])
            raise ReferenceError(
                f"token id {int(tokens[b, t])} at sequence {first_row + b}, index {t} is outside "
                f"the vocabulary [0, {vocab})"
            )
        needed = cache.lengths.cpu() + tokens.shape[1]
        for b, n in enumerate(needed.tolist()):
            if n > cache.max_seq_len:
                raise ReferenceError(
                    f"sequence {first_row + b} would exceed the cache's max length: "
                    f"{n - tokens.shape[1]} cached + {tokens.shape[1]} new > {cache.max_seq_len}"
                )

    # ---- the step --------------------------------------------------------------------------------
    def _forward(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        """Run tokens [B, T] at positions lengths[b] + t, fill the cache; -> logits [B, T, V]."""
        c, m = self.cfg, self.mode
        t = tokens.shape[1]
        positions = cache.lengths[:, None] + torch.arange(t, device=self.device)  # [B, T]
        cos, sin = rope_cos_sin(self.inv_freq, positions)  # [B, T, D] fp32
        h = self.w["model.embed_tokens.weight"][tokens].to(torch.float32)  # [B, T, hidden]
        for layer in range(c.num_layers):
            h = h + self._attention(layer, h, cache, cos, sin)
            h = h + self._mlp(layer, h)
        x = store(rms_norm(h, self.w["model.norm.weight"], c.rms_norm_eps), m)
        logits = linear(x, self.lm_head)  # [B, T, V]
        cache.lengths += t
        return logits

    def _attention(
        self, layer: int, h: torch.Tensor, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Attention block: returns the o_proj output [B, T, hidden] (fp32) to add to h."""
        c, m, w = self.cfg, self.mode, self.w
        p = f"model.layers.{layer}."
        bsz, t, _ = h.shape
        x = store(rms_norm(h, w[p + "input_layernorm.weight"], c.rms_norm_eps), m)
        q = linear(x, w[p + "self_attn.q_proj.weight"]).view(bsz, t, c.num_heads, c.head_dim)
        k = linear(x, w[p + "self_attn.k_proj.weight"]).view(bsz, t, c.num_kv_heads, c.head_dim)
        v = linear(x, w[p + "self_attn.v_proj.weight"]).view(bsz, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:  # per-head RMSNorm over D, before RoPE
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        q = store(apply_rope(q, cos, sin), m)  # [B, T, Hq, D]
        k = apply_rope(k, cos, sin)  # [B, T, Hkv, D]

        out = torch.empty_like(q)  # [B, T, Hq, D]
        for b, start in enumerate(cache.lengths.tolist()):
            end = start + t
            cache.k[layer, b, :, start:end] = k[b].transpose(0, 1).to(cache.k.dtype)
            cache.v[layer, b, :, start:end] = v[b].transpose(0, 1).to(cache.v.dtype)
            out[b] = causal_attention(
                q[b], cache.k[layer, b, :, :end], cache.v[layer, b, :, :end], start
            )
        o = store(out.reshape(bsz, t, c.q_size), m)
        return linear(o, w[p + "self_attn.o_proj.weight"])

    def _mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU block: returns the down_proj output [B, T, hidden] (fp32) to add to h."""
        c, m, w = self.cfg, self.mode, self.w
        p = f"model.layers.{layer}."
        x = store(rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps), m)
        gate = linear(x, w[p + "mlp.gate_proj.weight"])
        up = linear(x, w[p + "mlp.up_proj.weight"])
        act = store(torch.nn.functional.silu(gate) * up, m)  # [B, T, intermediate]
        return linear(act, w[p + "mlp.down_proj.weight"])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim; the lowest index wins ties."""
    return torch.argmax(logits, dim=-1)


def generate(
    model: ReferenceModel, prompts: list[list[int]], steps: int, max_seq_len: int | None = None
) -> list[list[int]]:
    """Greedy generation of `steps` new tokens per prompt (prompt tokens not included)."""
    if steps < 0:
        raise ReferenceError(f"steps must be >= 0, got {steps}")
    if not prompts:
        raise ReferenceError("no prompts given")
    if steps == 0:
        return [[] for _ in prompts]
    if max_seq_len is None:
        max_seq_len = max(len(p) for p in prompts) + steps - 1
    cache = model.new_cache(len(prompts), max_seq_len)
    token = greedy(model.prefill(cache, prompts))  # [B]
    out = [token]
    for _ in range(steps - 1):
        token = greedy(model.decode(cache, token[:, None]))[:, 0]
        out.append(token)
    return torch.stack(out, dim=1).tolist()
