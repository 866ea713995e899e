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
from reference import (
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
    tokens = generate(model, prompts, 4)
    assert [len(t) for t in tokens] == [4, 4]
    assert all(0 <= t < cfg.vocab_size for row in tokens for t in row)


def test_layer_registry_covers_every_kind():
    assert set(all_layers()) == set(all_kinds())
    for kind, cls in all_layers().items():
        assert cls.kind == kind and layer_class(kind) is cls
    with pytest.raises(KeyError, match="no reference layer for kind 'nope'"):
        layer_class("nope")
