"""Layer kinds: one module per kind of residual block (attention, MLA, gated delta rule, KDA,
Mamba2, SwiGLU MLP, relu^2 MLP, MoE), each holding everything the host knows about it: its config,
its checkpoint tensors and their init, its packing into the weight arena, the buffers, caches and
recurrent state it declares, its opcodes and stage builder, and its bytes for the cost model.

`kind(name)` returns the registered `LayerKind` (importing `megakernel.layers.<name>` on first
use); `all_kinds()` imports every module of this package, so a new kind is one new module.
"""

from __future__ import annotations

from megakernel.layers.base import KINDS, LayerKind, register_kind

__all__ = ["KINDS", "LayerKind", "all_kinds", "kind", "register_kind"]


def kind(name: str) -> type[LayerKind]:
    """The layer kind registered as `name`."""
    return KINDS.find(name)


def all_kinds() -> dict[str, type[LayerKind]]:
    """Every layer kind (imports each module of this package once, the frame's opcodes too)."""
    return dict(KINDS.load_all())
