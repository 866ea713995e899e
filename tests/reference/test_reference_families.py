"""One reference model class for every model family, composed from the layer registry.

- every registered family's tiny preset runs through `ReferenceModel`, with the layer of each
  block taken from the registry by the block's kind and one per-layer cache per cached layer;
- the registry has a reference layer for every layer kind megakernel declares.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.layers import all_kinds
from megakernel.models import load_all, presets
from megakernel.models.weights import random_weights
from megakernel.reference import (
    Cache,
    KVLayerCache,
    MLACache,
    ReferenceError,
    ReferenceModel,
    SSMLayerCache,
    all_layers,
    generate,
    layer_class,
)

CACHE_TYPES = {"attention": KVLayerCache, "mla": MLACache, "gdn": SSMLayerCache,
               "kda": SSMLayerCache, "mamba2": SSMLayerCache}


def _tiny_presets() -> dict[str, str]:
    """family -> its tiny preset."""
    return {cfg.family: name for name, cfg in presets().items() if name.endswith("-tiny")}


def test_every_family_has_a_tiny_preset():
    assert set(_tiny_presets()) == set(load_all())


@pytest.mark.parametrize("name", sorted(_tiny_presets().values()))
def test_one_model_class_serves_every_family(name: str) -> None:
    cfg = presets()[name]
    weights = random_weights(cfg, 3, dtype=torch.float32)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    for mode, kv_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = ReferenceModel(cfg, weights, mode)
        assert type(model) is ReferenceModel
        assert [type(op) for op in model.ops] == [layer_class(b.kind) for b in cfg.blocks]

        cache = model.new_cache(2, 16)
        assert isinstance(cache, Cache)
        cached = {b.layer: b.kind for b in cfg.blocks if b.kind in CACHE_TYPES}
        assert sorted(cache.layers) == sorted(cached)
        for layer, kind in cached.items():
            assert type(cache.layers[layer]) is CACHE_TYPES[kind], (layer, kind)

        first = model.prefill(cache, prompts)
        step = model.decode(cache, torch.tensor([[7, 8], [6, 5]]))
        assert first.shape == (2, cfg.vocab_size) and step.shape == (2, 2, cfg.vocab_size)
        assert first.dtype == step.dtype == torch.float32
        assert torch.isfinite(first).all() and torch.isfinite(step).all()
        assert cache.lengths.tolist() == [7, 4]

        attn = [b for b in cfg.blocks if b.kind == "attention"]
        if attn:
            k, v = cache.attention_kv()
            a = attn[0].cfg
            assert k.shape == v.shape == (len(attn), 2, a.num_kv_heads, 16, a.head_dim)
            assert k.dtype == v.dtype == kv_dtype
            assert torch.isfinite(k[:, 0, :, :7]).all() and torch.isnan(k[:, 0, :, 7:]).all()
        else:
            with pytest.raises(ReferenceError, match="no attention layers"):
                cache.attention_kv()
        mla = [b for b in cfg.blocks if b.kind == "mla"]
        if mla:  # the kernel's KV arena: one slot per attention or MLA layer, MLA's latent
            k, v = cache.kv_slots()
            m = mla[0].cfg
            assert len(k) == len(attn) + len(mla)
            assert k.shape[1:] == (2, 1, 16, m.kv_lora_rank)
            assert v.shape[1:] == (2, 1, 16, m.qk_rope_head_dim)
            assert torch.allclose(k[0, :, 0], cache.layers[mla[0].layer].c, 0, 0, equal_nan=True)
    tokens = generate(model, prompts, 4)
    assert [len(t) for t in tokens] == [4, 4]
    assert all(0 <= t < cfg.vocab_size for row in tokens for t in row)


def test_layer_registry_covers_every_kind():
    assert set(all_layers()) == set(all_kinds())
    for kind, cls in all_layers().items():
        assert cls.kind == kind and layer_class(kind) is cls
    with pytest.raises(KeyError, match="unknown reference layer kind 'nope'"):
        layer_class("nope")


def test_cache_of_another_model_is_refused():
    """Every step checks the cache against the model, layer by layer, before writing anything."""
    q35 = presets()["qwen3.5-tiny"]
    w = random_weights(q35, 0, dtype=torch.float32)
    fp32, bf16 = ReferenceModel(q35, w, "fp32"), ReferenceModel(q35, w, "bf16")
    kimi = presets()["kimi-linear-tiny"]
    other = ReferenceModel(kimi, random_weights(kimi, 0, dtype=torch.float32))
    tok = torch.tensor([[1]])
    with pytest.raises(ReferenceError, match=r"cache has layers \[0, 1, 2\], the model caches "
                                             r"layers \[0, 1, 2, 3\]"):
        fp32.decode(other.new_cache(1, 8), tok)
    with pytest.raises(ReferenceError, match=r"layer 2: cache dtype torch.float32 does not match "
                                             r"torch.bfloat16 \(bf16 mode\): cache k"):
        bf16.decode(fp32.new_cache(1, 8), tok)
    cache = fp32.new_cache(1, 8)
    cache.layers[0].state = cache.layers[0].state.to(torch.bfloat16)
    with pytest.raises(ReferenceError, match=r"layer 0: cache dtype torch.bfloat16 does not "
                                             r"match torch.float32 \(recurrent state is fp32"):
        fp32.decode(cache, tok)
    with pytest.raises(ReferenceError, match="cache must be a reference Cache"):
        fp32.decode(object(), tok)  # type: ignore[arg-type]
    with pytest.raises(ReferenceError, match="layer 2 is not a recurrent layer"):
        fp32.recurrent_state(fp32.new_cache(1, 8), 2)


def test_speculative_steps_on_a_dense_model():
    """verify + commit also serve a model without recurrent layers: the KV slots of rejected
    drafts are overwritten by the next step, so it equals decoding only the kept tokens."""
    cfg = presets()["llama-tiny"]
    w = random_weights(cfg, 5, dtype=torch.float32)
    spec, plain = ReferenceModel(cfg, w, replay_window=4), ReferenceModel(cfg, w)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6]]
    cs, cp = spec.new_cache(2, 32), plain.new_cache(2, 32)
    spec.prefill(cs, prompts)
    plain.prefill(cp, prompts)
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        tokens = torch.randint(cfg.vocab_size, (2, 3), generator=g)
        accepted = torch.randint(0, 3, (2,), generator=g)
        logits = spec.verify(cs, tokens)
        spec.commit(cs, accepted)
        for b in range(2):
            kept = tokens[b : b + 1, : int(accepted[b]) + 1]
            want = plain.decode(cp.row(b), kept)[0]
            torch.testing.assert_close(logits[b, : kept.shape[1]], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cs.lengths, cp.lengths)
    tail = plain.decode(cp, torch.tensor([[7], [8]]))
    torch.testing.assert_close(spec.decode(cs, torch.tensor([[7], [8]])), tail, rtol=1e-5,
                               atol=1e-5)
