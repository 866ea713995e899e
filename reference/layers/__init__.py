"""Reference layer implementations, one module per layer kind, registered by kind name.

Kinds (megakernel/layers/ declares the same ones for the kernel): attention (Llama, Qwen3, Qwen2,
Qwen3.5, Nemotron-H), mla (Kimi Linear), gdn (Qwen3.5), kda (Kimi Linear), mamba2 (Nemotron-H),
swiglu, relu2, moe. Shared math is in common.py, ReplaySSM and the recurrent-layer protocol in
replay.py, the layer interface and the registry in base.py.

`layer_class(kind)` returns the implementation (importing `reference.layers.<kind>` on first use);
`all_layers()` imports every module, so a new kind is one new module with `@register_layer`.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import LAYERS, ReferenceLayer, register_layer

__all__ = ["LAYERS", "ReferenceLayer", "all_layers", "layer_class", "register_layer"]

_NOT_LAYERS = {"base", "common", "replay"}


def layer_class(kind: str) -> type[ReferenceLayer]:
    """The reference layer registered for `kind`."""
    if kind not in LAYERS:
        try:
            importlib.import_module(f"{__name__}.{kind}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{kind}":
                raise
    if kind not in LAYERS:
        all_layers()
        if kind not in LAYERS:
            raise KeyError(f"no reference layer for kind {kind!r}; known: "
                           f"{', '.join(sorted(LAYERS))}")
    return LAYERS[kind]


def all_layers() -> dict[str, type[ReferenceLayer]]:
    """Every registered reference layer (imports each module of this package once)."""
    for m in pkgutil.iter_modules(__path__):
        if m.name not in _NOT_LAYERS:
            importlib.import_module(f"{__name__}.{m.name}")
    return dict(LAYERS)
