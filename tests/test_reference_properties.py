"""Properties of the reference model that do not need Hugging Face.

- batching: a ragged batch equals each sequence run alone; T new tokens at once equal T single
  steps; a prefill split into prefill + multi-token decode equals one prefill;
- the cache: unwritten slots are never read; bad calls leave it untouched;
- the bf16 mirror against fp32 truth: an error band derived from bf16's unit roundoff, and greedy
  tokens that agree wherever fp32 is not near a tie;
- bad input: each error names the problem.

Weights come from `megakernel.weights.random_weights` in fp32; their values are bf16-representable,
so "fp32" and "bf16" modes run the same model and differ only by activation rounding.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.config import preset
from megakernel.weights import random_weights
from reference import KVCache, ReferenceError, ReferenceModel, generate, greedy

TINY = ("llama-tiny", "qwen3-tiny")  # GQA 2 / D 64 / tied / llama3 rope; GQA 4 / D 128 / untied
FP32_RTOL = 1e-5  # batching changes only fp32 summation order


def _model(name: str, mode: str = "fp32", seed: int = 0) -> ReferenceModel:
    cfg = preset(name)
    return ReferenceModel(cfg, random_weights(cfg, seed, dtype=torch.float32), mode=mode)


def _prompts(vocab: int, lens: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]


def _assert_close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = FP32_RTOL) -> None:
    """max |a - b| <= rtol * max |b| (a relative error on the tensor's scale)."""
    scale = b.abs().max().item()
    assert scale > 0, f"{what}: reference tensor is all zeros"
    err = (a - b).abs().max().item()
    assert err <= rtol * scale, f"{what}: max err {err:.3g} > {rtol} * scale {scale:.3g}"


def _assert_cache_equal(a: KVCache, b: KVCache, rows: list[int], what: str) -> None:
    """Valid positions of a's sequences `rows` equal b's sequences 0.. (same lengths)."""
    for j, i in enumerate(rows):
        n = int(a.lengths[i])
        assert int(b.lengths[j]) == n, f"{what}: lengths differ"
        _assert_close(a.k[:, i, :, :n], b.k[:, j, :, :n], f"{what}: k of sequence {i}")
        _assert_close(a.v[:, i, :, :n], b.v[:, j, :, :n], f"{what}: v of sequence {i}")


def _clone(cache: KVCache) -> KVCache:
    return KVCache(cache.k.clone(), cache.v.clone(), cache.lengths.clone())


# ---- batching -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_ragged_batch_equals_single_sequences(name):
    model = _model(name)
    vocab = model.cfg.vocab_size
    prompts = _prompts(vocab, (5, 1, 9), seed=1)
    steps = torch.randint(vocab, (6, 3, 1), generator=torch.Generator().manual_seed(2))

    batch = model.new_cache(3, 32)
    batch_logits = [model.prefill(batch, prompts)[:, None]]  # [B, 1, V]
    batch_logits += [model.decode(batch, steps[i]) for i in range(len(steps))]
    batch_logits = torch.cat(batch_logits, dim=1)  # [B, 1 + steps, V]
    assert batch.lengths.tolist() == [11, 7, 15]

    for b, prompt in enumerate(prompts):
        single = model.new_cache(1, 32)
        logits = [model.prefill(single, [prompt])[:, None]]
        logits += [model.decode(single, steps[i, b : b + 1]) for i in range(len(steps))]
        _assert_close(batch_logits[b], torch.cat(logits, dim=1)[0], f"sequence {b} logits")
        _assert_cache_equal(batch, single, [b], f"sequence {b} cache")


@pytest.mark.parametrize("name", TINY)
def test_multi_token_decode_equals_single_steps(name):
    model = _model(name, seed=3)
    vocab = model.cfg.vocab_size
    cache = model.new_cache(2, 24)
    model.prefill(cache, _prompts(vocab, (7, 2), seed=4))  # ragged start positions
    tokens = torch.randint(vocab, (2, 4), generator=torch.Generator().manual_seed(5))

    stepwise = _clone(cache)
    at_once = model.decode(cache, tokens)  # [B, 4, V]
    one_by_one = torch.cat([model.decode(stepwise, tokens[:, t : t + 1]) for t in range(4)], 1)
    assert at_once.shape == (2, 4, vocab) and at_once.dtype == torch.float32
    _assert_close(at_once, one_by_one, "T=4 decode vs 4 single steps")
    _assert_cache_equal(cache, stepwise, [0, 1], "T=4 decode vs 4 single steps")


@pytest.mark.parametrize("name", TINY)
def test_split_prefill_equals_prefill(name):
    model = _model(name, seed=6)
    prompt = _prompts(model.cfg.vocab_size, (12,), seed=7)[0]
    whole = model.new_cache(1, 16)
    last = model.prefill(whole, [prompt])  # [1, V]
    split = model.new_cache(1, 16)
    model.prefill(split, [prompt[:5]])
    rest = model.decode(split, torch.tensor([prompt[5:]]))  # [1, 7, V]
    _assert_close(rest[:, -1], last, "prefill(5) + decode(7) vs prefill(12)")
    _assert_cache_equal(whole, split, [0], "split prefill")


# ---- the cache ----------------------------------------------------------------------------------
def test_unwritten_cache_slots_stay_poisoned_and_unread():
    model = _model("llama-tiny")
    cache = model.new_cache(2, 20)
    logits = model.prefill(cache, _prompts(model.cfg.vocab_size, (3, 8), seed=8))
    logits2 = model.decode(cache, torch.tensor([[1, 2], [3, 4]]))
    assert torch.isfinite(logits).all() and torch.isfinite(logits2).all()
    for b, n in enumerate(cache.lengths.tolist()):
        for t in (cache.k, cache.v):
            assert torch.isfinite(t[:, b, :, :n]).all(), f"sequence {b}: a valid slot is not finite"
            assert torch.isnan(t[:, b, :, n:]).all(), f"sequence {b}: a slot past {n} was written"


def test_cache_layout_and_dtypes():
    for mode, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = _model("qwen3-tiny", mode)
        c = model.cfg
        cache = model.new_cache(3, 17)
        assert cache.k.shape == (c.num_layers, 3, c.num_kv_heads, 17, c.head_dim)
        assert cache.v.shape == cache.k.shape
        assert cache.k.dtype == cache.v.dtype == dtype
        assert cache.lengths.dtype == torch.int64 and cache.lengths.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "call",
    ["vocab", "length", "batch"],
)
def test_bad_call_leaves_cache_untouched(call):
    model = _model("llama-tiny")
    cache = model.new_cache(2, 8)
    model.prefill(cache, [[1, 2, 3], [4]])
    before = _clone(cache)
    bad = {
        "vocab": torch.tensor([[1], [model.cfg.vocab_size]]),
        "length": torch.ones(2, 6, dtype=torch.int64),
        "batch": torch.ones(3, 1, dtype=torch.int64),
    }[call]
    with pytest.raises(ReferenceError):
        model.decode(cache, bad)
    assert torch.equal(cache.lengths, before.lengths)
    assert torch.equal(cache.k.nan_to_num(7.0), before.k.nan_to_num(7.0))
    assert torch.equal(cache.v.nan_to_num(7.0), before.v.nan_to_num(7.0))


# ---- greedy -------------------------------------------------------------------------------------
def test_greedy_takes_lowest_index_on_ties():
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0, 3.0]])
    assert greedy(logits).tolist() == [1, 0]


def test_generate_is_the_greedy_loop():
    model = _model("qwen3-tiny", seed=9)
    prompts = _prompts(model.cfg.vocab_size, (4, 10), seed=10)
    out = generate(model, prompts, steps=6)
    assert [len(o) for o in out] == [6, 6]

    cache = model.new_cache(2, 16)
    tok = greedy(model.prefill(cache, prompts))
    manual = [tok.tolist()]
    for _ in range(5):
        tok = greedy(model.decode(cache, tok[:, None]))[:, 0]
        manual.append(tok.tolist())
    assert out == [list(x) for x in zip(*manual, strict=True)]
    assert generate(model, prompts, steps=0) == [[], []]


# ---- bf16 mirror vs fp32 truth ------------------------------------------------------------------
# Band. bf16 keeps 8 significant bits: rounding to nearest changes a value by a relative error of
# at most u = 2^-9. The bf16 mode rounds at 7 points per layer (attention-norm output, q, k, v,
# attention output, MLP-norm output, silu(gate)*up) plus once at the final norm: N = 7 L + 1
# stores. To first order each store perturbs the logits by at most u times the logit scale (the
# RMSNorms renormalise, so each stage's gain is about 1), and the perturbations add at worst
# linearly, so
#     max |logits_bf16 - logits_fp32| <= N * u * max |logits_fp32|    (15 u = 0.029 for L = 2).
# The measured error is about a third of that. A floor of u / 4 checks that rounding happens.
U_BF16 = 2.0**-9


def _bf16_band(num_layers: int) -> float:
    return (7 * num_layers + 1) * U_BF16


@pytest.mark.parametrize("name", TINY)
def test_bf16_mirror_error_band_and_greedy_tokens(name, record_numerics):
    """Teacher-forced on the fp32 greedy stream: error band at every step; token agreement."""
    seed, steps = 3, 32  # a seed whose fp32 stream is clear of near-ties at most steps
    cfg = preset(name)
    fp32, bf16 = _model(name, "fp32", seed), _model(name, "bf16", seed)
    prompts = _prompts(cfg.vocab_size, (4, 9, 13), seed=seed)
    stream = torch.tensor(generate(fp32, prompts, steps))  # [B, steps], fp32 greedy tokens
    band = _bf16_band(cfg.num_layers)

    c32, c16 = fp32.new_cache(3, 48), bf16.new_cache(3, 48)
    l32, l16 = fp32.prefill(c32, prompts), bf16.prefill(c16, prompts)  # [B, V]
    worst, clear, agree = 0.0, 0, 0
    for i in range(steps):
        scale = l32.abs().amax(dim=-1)  # [B]
        err = (l16 - l32).abs().amax(dim=-1) / scale  # [B]
        assert (err <= band).all(), f"step {i}: bf16 error {err.max():.4f} > band {band:.4f}"
        assert (err >= U_BF16 / 4).all(), f"step {i}: bf16 error {err.min():.2e}: no rounding?"
        worst = max(worst, err.max().item())
        top2 = l32.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]) / scale  # [B], relative top-2 gap of the truth
        same = greedy(l16) == greedy(l32)
        assert same[margin > 2 * band].all(), f"step {i}: token differs despite a clear margin"
        clear += int((margin > 2 * band).sum())
        agree += int(same.sum())
        assert torch.equal(greedy(l32), stream[:, i]), "teacher stream is not fp32 greedy"
        if i + 1 < steps:
            l32 = fp32.decode(c32, stream[:, i : i + 1])[:, 0]
            l16 = bf16.decode(c16, stream[:, i : i + 1])[:, 0]
    total = steps * len(prompts)
    assert clear >= total // 2, f"only {clear}/{total} steps clear of a near-tie"
    assert agree >= 0.9 * total, f"tokens agree at only {agree}/{total} steps"
    record_numerics(
        f"bf16 mirror {name}",
        f"max|err|/max|logits| = {worst:.4f} (band {band:.4f}); tokens agree {agree}/{total}, "
        f"{clear}/{total} steps clear of near-ties",
    )


@pytest.mark.parametrize("name", TINY)
def test_bf16_free_running_generation_agrees(name):
    """Free-running greedy generation: same 32 tokens in both modes (seed chosen with margin)."""
    seed = 1
    prompts = _prompts(preset(name).vocab_size, (4, 9, 13), seed=seed)
    out32 = generate(_model(name, "fp32", seed), prompts, 32)
    out16 = generate(_model(name, "bf16", seed), prompts, 32)
    assert out16 == out32


# ---- devices ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_cuda_matches_cpu(mode):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        cfg = preset("qwen3-tiny")
        w = random_weights(cfg, 0, dtype=torch.float32)
        cpu = ReferenceModel(cfg, w, mode, "cpu")
        gpu = ReferenceModel(cfg, w, mode, "cuda")
        prompts = _prompts(cfg.vocab_size, (3, 7), seed=11)
        tok = torch.tensor([[5, 6], [7, 8]])
        c1, c2 = cpu.new_cache(2, 16), gpu.new_cache(2, 16)
        a = torch.cat([cpu.prefill(c1, prompts)[:, None], cpu.decode(c1, tok)], 1)
        b = torch.cat([gpu.prefill(c2, prompts)[:, None], gpu.decode(c2, tok)], 1)
        assert b.device.type == "cuda"
        # bf16 mode: a different fp32 summation order can flip a bf16 rounding (one ulp, 2^-8).
        _assert_close(b.cpu(), a, f"cuda vs cpu ({mode})", rtol=1e-5 if mode == "fp32" else 2e-2)
        if mode == "fp32":
            assert generate(cpu, prompts, 8) == generate(gpu, prompts, 8)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


# ---- bad input ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> ReferenceModel:
    return _model("llama-tiny")


def test_token_outside_vocab(tiny):
    v = tiny.cfg.vocab_size
    cache = tiny.new_cache(2, 8)
    with pytest.raises(ReferenceError, match=rf"token id {v} at sequence 1, index 2 .*\[0, {v}\)"):
        tiny.prefill(cache, [[1], [2, 3, v]])
    with pytest.raises(ReferenceError, match=r"token id -1 at sequence 0, index 0 .*vocabulary"):
        tiny.decode(cache, torch.tensor([[-1], [0]]))
    assert cache.lengths.tolist() == [0, 0]


def test_sequence_past_cache_length(tiny):
    cache = tiny.new_cache(2, 5)
    with pytest.raises(ReferenceError, match=r"sequence 1 would exceed the cache's max length: "
                                             r"0 cached \+ 6 new > 5"):
        tiny.prefill(cache, [[1, 2], [1, 2, 3, 4, 5, 6]])
    tiny.prefill(cache, [[1, 2, 3, 4], [1, 2]])
    tiny.decode(cache, torch.tensor([[9], [9]]))  # fills sequence 0 exactly
    with pytest.raises(ReferenceError, match=r"sequence 0 would exceed the cache's max length: "
                                             r"5 cached \+ 1 new > 5"):
        tiny.decode(cache, torch.tensor([[9], [9]]))
    with pytest.raises(ReferenceError, match="would exceed the cache's max length"):
        generate(tiny, [[1, 2, 3]], steps=4, max_seq_len=5)


def test_empty_prompt(tiny):
    with pytest.raises(ReferenceError, match="empty prompt: prompt 1 has no tokens"):
        tiny.prefill(tiny.new_cache(2, 8), [[1, 2], []])


def test_batch_mismatch(tiny):
    cache = tiny.new_cache(2, 8)
    with pytest.raises(ReferenceError, match="batch mismatch: 3 prompts for a cache of batch 2"):
        tiny.prefill(cache, [[1], [2], [3]])
    with pytest.raises(ReferenceError, match="batch mismatch: tokens have batch 1, cache has 2"):
        tiny.decode(cache, torch.tensor([[1]]))


def test_bad_token_tensor(tiny):
    cache = tiny.new_cache(1, 8)
    with pytest.raises(ReferenceError, match=r"tokens must be \[B, T\], got shape \(3,\)"):
        tiny.decode(cache, torch.tensor([1, 2, 3]))
    with pytest.raises(ReferenceError, match="token ids must be integers, got dtype torch.float32"):
        tiny.decode(cache, torch.tensor([[1.0]]))
    with pytest.raises(ReferenceError, match=r"no tokens: decode needs T >= 1"):
        tiny.decode(cache, torch.zeros(1, 0, dtype=torch.int64))


def test_cache_of_other_mode_or_model(tiny):
    other = _model("llama-tiny", "bf16")
    with pytest.raises(ReferenceError, match=r"cache dtype torch.bfloat16 does not match "
                                             r"torch.float32 \(fp32 mode\)"):
        tiny.decode(other.new_cache(1, 4), torch.tensor([[1]]))
    with pytest.raises(ReferenceError, match=r"do not match the model's \[L, B, Hkv, S_max, D\]"):
        tiny.decode(_model("qwen3-tiny").new_cache(1, 4), torch.tensor([[1]]))


def test_bad_mode_steps_and_cache_size(tiny):
    cfg = preset("llama-tiny")
    w = random_weights(cfg, 0, dtype=torch.float32)
    with pytest.raises(ReferenceError, match=r"unknown mode 'fp16'; expected one of \('fp32', "):
        ReferenceModel(cfg, w, mode="fp16")
    with pytest.raises(ReferenceError, match="steps must be >= 0, got -1"):
        generate(tiny, [[1]], steps=-1)
    with pytest.raises(ReferenceError, match="cache needs batch >= 1 and max_seq_len >= 1"):
        tiny.new_cache(0, 4)


def test_bad_weights():
    cfg = preset("llama-tiny")  # tied
    w = random_weights(cfg, 0, dtype=torch.float32)
    missing = {k: v for k, v in w.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ReferenceError, match=r"missing 1 tensors, e.g. \['model.layers.1.mlp.up"):
        ReferenceModel(cfg, missing)
    bad_shape = {**w, "model.norm.weight": torch.ones(7)}
    with pytest.raises(ReferenceError, match=r"norm.weight has shape \(7,\), expected \(256,"):
        ReferenceModel(cfg, bad_shape)
    extra = {**w, "model.layers.2.input_layernorm.weight": torch.ones(256)}
    with pytest.raises(ReferenceError, match=r"1 unexpected tensors, e.g. \['model.layers.2.input"):
        ReferenceModel(cfg, extra)
    head = {**w, "lm_head.weight": w["model.embed_tokens.weight"] + 1}
    with pytest.raises(ReferenceError, match="ties word embeddings but lm_head.weight differs"):
        ReferenceModel(cfg, head)
    same = {**w, "lm_head.weight": w["model.embed_tokens.weight"].clone()}
    ReferenceModel(cfg, same)  # a stored duplicate of the tied head is accepted


def test_any_integer_token_dtype_and_fp32_logits():
    model = _model("llama-tiny", "bf16")
    cache = model.new_cache(1, 4)
    out = model.decode(cache, torch.tensor([[3, 4]], dtype=torch.int32))
    assert out.dtype == torch.float32 and out.shape == (1, 2, model.cfg.vocab_size)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    assert cache.lengths.tolist() == [2]
