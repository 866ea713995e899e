"""Reference layer implementations, one module per layer kind, registered by kind name.

Kinds (megakernel/layers/ declares the same ones for the kernel): attention (Llama, Qwen3, Qwen2,
Qwen3.5, Nemotron-H), mla (Kimi Linear), gdn (Qwen3.5), kda (Kimi Linear), mamba2 (Nemotron-H),
swiglu, relu2, moe. Shared math is in common.py, ReplaySSM and the recurrent-layer protocol in
replay.py, the layer interface and the registry in base.py.

`layer_class(kind)` returns the implementation (importing `reference.layers.<kind>` on first use);
`all_layers()` imports every module, so a new kind is one new module with `@register_layer`.
"""

from __future__ import annotations

from .base import LAYERS, ReferenceLayer, register_layer

__all__ = ["LAYERS", "ReferenceLayer", "all_layers", "layer_class", "register_layer"]


def layer_class(kind: str) -> type[ReferenceLayer]:
    """The reference layer registered for `kind`."""
    return LAYERS.find(kind)


def all_layers() -> dict[str, type[ReferenceLayer]]:
    """Every registered reference layer (imports each module of this package once)."""
    return dict(LAYERS.load_all())
