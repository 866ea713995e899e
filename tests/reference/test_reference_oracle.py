"""Rung 1 against rung 0 for the dense families: the fp32 reference against Hugging Face
transformers (fp32, eager).

Each tiny random config is built with transformers (Llama, Qwen3, Qwen2; Qwen2's q/k/v biases drawn
away from zero), saved with save_pretrained (safetensors) and read back with
`megakernel.models.weights.load_checkpoint`; the reference runs a ragged batch (prefill, 16
single-token decode steps, then one 3-token step) while the HF model runs each sequence alone with
its DynamicCache. Pass: max |logits - hf| <= 1e-4 * max |hf logits| at every step, and the
reference KV cache equals HF's (keys after RoPE) on every valid position.
"""

from __future__ import annotations

import math

import pytest
import torch

from megakernel.models import RopeConfig
from megakernel.models.dense import DenseConfig
from megakernel.models.llama import LlamaConfig
from megakernel.models.qwen2 import Qwen2Config
from megakernel.models.qwen3 import Qwen3Config
from megakernel.reference import ReferenceModel

TOL = 1e-4  # max abs logit error, as a fraction of the logit scale max|logits|
PROMPT_LENS = (9, 3, 14)
DECODE_STEPS = 16
MULTI_T = 3  # the last step appends this many tokens at once
MAX_POS = max(PROMPT_LENS) + DECODE_STEPS + MULTI_T - 1  # largest position the test reaches

FAMILY = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config}


def _dense(family: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
           head_dim: int, inter: int, eps: float, rope: RopeConfig, tied: bool,
           max_pos: int) -> DenseConfig:
    return FAMILY[family](
        vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, rms_norm_eps=eps,
        rope=rope, tie_word_embeddings=tied, max_position_embeddings=max_pos)


# name -> (config, init std). GQA ratios 1, 2, 4; head_dim 64 and 128; tied and untied; llama3
# rope with original_max_position_embeddings small enough to scale frequencies at MAX_POS; hidden
# sizes other than heads * head_dim (multiples of 64, as megakernel supports).
CONFIGS: dict[str, tuple[DenseConfig, float]] = {
    "llama-gqa1-d64-untied": (
        _dense("llama", 320, 128, 2, 4, 4, 64, 256, 1e-5, RopeConfig(10000.0), False, 256),
        0.12,
    ),
    "llama-gqa2-d64-tied-llama3": (
        _dense("llama", 256, 128, 2, 4, 2, 64, 320, 1e-5,
               RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 32), True, 256),
        0.12,
    ),
    "llama-gqa4-d128-untied-llama3": (
        _dense("llama", 384, 192, 2, 8, 2, 128, 384, 1e-5,
               RopeConfig(5e5, "llama3", 4.0, 1.0, 4.0, 16), False, 256),
        0.1,
    ),
    "qwen3-gqa2-d128-tied": (
        _dense("qwen3", 256, 192, 2, 4, 2, 128, 384, 1e-6, RopeConfig(1e6), True, 256),
        0.1,
    ),
    "qwen3-gqa4-d64-untied": (
        _dense("qwen3", 320, 64, 3, 4, 1, 64, 256, 1e-6, RopeConfig(1e6), False, 256),
        0.14,
    ),
    "qwen3-gqa1-d128-llama3": (
        _dense("qwen3", 256, 128, 2, 2, 2, 128, 256, 1e-6,
               RopeConfig(1e4, "llama3", 8.0, 1.0, 4.0, 24), False, 256),
        0.12,
    ),
    "qwen2-gqa2-d64-tied": (
        _dense("qwen2", 256, 128, 2, 4, 2, 64, 320, 1e-6, RopeConfig(1e6), True, 256),
        0.12,
    ),
    "qwen2-gqa4-d128-untied": (
        _dense("qwen2", 320, 192, 3, 8, 2, 128, 384, 1e-6, RopeConfig(1e6), False, 256),
        0.1,
    ),
}
QWEN2 = [n for n in CONFIGS if n.startswith("qwen2")]


def _hf_step(hf, ids: list[int], cache):
    """One cached HF forward of `ids` for a single sequence -> (logits [T, V], cache)."""
    out = hf(torch.tensor([ids]), cache=cache, use_cache=True)
    return out.logits[0], out.cache


def _assert_rope_scaling_is_live(cfg: DenseConfig, hf) -> None:
    """HF's inv_freq equals ours, and llama3 scaling moves angles at the positions we test."""
    ours = torch.tensor(cfg.rope.inv_freq(cfg.head_dim), dtype=torch.float64)
    hf_inv = hf.model.rotary_emb.inv_freq.to(torch.float64)
    assert torch.allclose(hf_inv, ours, rtol=1e-6, atol=0), (hf_inv, ours)
    if cfg.rope.rope_type == "llama3":
        plain = RopeConfig(cfg.rope.theta).inv_freq(cfg.head_dim)
        shift = max(abs(a - b) * MAX_POS for a, b in zip(ours.tolist(), plain, strict=True))
        assert shift > 1.0, f"llama3 scaling moves angles by only {shift:.3g} rad at {MAX_POS}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp32_reference_matches_transformers(name, hf_checkpoint, record_numerics):
    cfg, init_std = CONFIGS[name]
    ckpt = hf_checkpoint(cfg, seed=len(name), init_std=init_std)
    assert ckpt.cfg.replace(name="") == cfg, "config did not survive save_pretrained + load"
    _assert_rope_scaling_is_live(cfg, ckpt.hf_model)

    model = ReferenceModel(ckpt.cfg, ckpt.weights, mode="fp32")
    gen = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    steps = [torch.randint(cfg.vocab_size, (len(prompts), 1), generator=gen)
             for _ in range(DECODE_STEPS)]
    steps.append(torch.randint(cfg.vocab_size, (len(prompts), MULTI_T), generator=gen))

    ratios: list[float] = []
    scales: list[float] = []

    def compare(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        scale = ref.abs().max().item()
        ratio = (ours - ref).abs().max().item() / scale
        ratios.append(ratio)
        scales.append(scale)
        assert ratio <= TOL, f"{name} {what}: max err / logit scale = {ratio:.3g} > {TOL}"

    with torch.no_grad():
        cache = model.new_cache(len(prompts), MAX_POS + 1)
        ours = model.prefill(cache, prompts)  # [B, V]
        hf_caches = []
        for b, p in enumerate(prompts):
            logits, c = _hf_step(ckpt.hf_model, p, None)
            hf_caches.append(c)
            compare(ours[b], logits[-1], f"prefill seq {b}")
        for i, tok in enumerate(steps):
            ours = model.decode(cache, tok)  # [B, T, V]
            for b in range(len(prompts)):
                logits, hf_caches[b] = _hf_step(ckpt.hf_model, tok[b].tolist(), hf_caches[b])
                compare(ours[b], logits, f"decode step {i} seq {b}")

    # The cache holds what HF holds: keys after RoPE (and q/k norm), values, at 0..len-1.
    expect = [n + DECODE_STEPS + MULTI_T for n in PROMPT_LENS]
    assert cache.lengths.tolist() == expect
    kv_err = 0.0
    k_all, v_all = cache.attention_kv()  # [L, B, Hkv, S_max, D]
    for b, n in enumerate(expect):
        for layer in range(cfg.num_layers):
            hf_layer = hf_caches[b].layers[layer]
            assert hf_layer.keys.shape[-2] == n
            for ours_t, hf_t in ((k_all, hf_layer.keys), (v_all, hf_layer.values)):
                ref = hf_t[0]  # [Hkv, n, D]
                err = (ours_t[layer, b, :, :n] - ref).abs().max().item() / ref.abs().max().item()
                kv_err = max(kv_err, err)
    assert kv_err <= TOL, f"{name}: KV cache differs from HF's by {kv_err:.3g} (relative)"

    worst = max(ratios)
    assert 1.0 <= min(scales) and max(scales) <= 50.0, f"logit scale out of range: {scales}"
    assert not math.isnan(worst)
    record_numerics(
        f"oracle {name}",
        f"max|err|/max|logits| = {worst:.2e} over {len(ratios)} comparisons "
        f"(logit scale {min(scales):.1f}..{max(scales):.1f}); KV cache rel err {kv_err:.2e}",
    )


@pytest.mark.parametrize("name", QWEN2)
def test_qwen2_biases_matter(name, hf_checkpoint):
    """The oracle's Qwen2 biases are far from zero and each of q, k, v's moves the logits by far
    more than the oracle's tolerance: a model that dropped any of them could not pass
    `test_fp32_reference_matches_transformers`."""
    cfg, init_std = CONFIGS[name]
    ckpt = hf_checkpoint(cfg, seed=len(name), init_std=init_std)
    biases = {n: t for n, t in ckpt.weights.items() if n.endswith("_proj.bias")}
    assert len(biases) == 3 * cfg.num_layers  # q, k, v per layer; o_proj has none
    assert all(t.std() > 0.2 for t in biases.values())
    prompts = [[1, 5, 9, 2], [7, 3]]

    def logits(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        model = ReferenceModel(ckpt.cfg, weights, mode="fp32")
        cache = model.new_cache(2, 8)
        first = model.prefill(cache, prompts)[:, None]
        return torch.cat([first, model.decode(cache, torch.tensor([[4, 6], [8, 0]]))], dim=1)

    want = logits(ckpt.weights)
    scale = want.abs().max().item()
    for drop in ("q_proj", "k_proj", "v_proj"):
        zeroed = {n: torch.zeros_like(t) if n.endswith(f"{drop}.bias") else t
                  for n, t in ckpt.weights.items()}
        ratio = (logits(zeroed) - want).abs().max().item() / scale
        assert ratio > 100 * TOL, f"{name}: zeroing the {drop} biases moves logits by {ratio:.2g}"
