"""The interface of a reference layer and the registry of layer implementations by kind name.

A model block (`megakernel.models.Block`) is `h += op(norm(h))`; the reference runs `op` with the
`ReferenceLayer` registered under the block's kind (`@register_layer` in the kind's module). What
a layer keeps between steps is its per-layer cache, which the model stores in `Cache.layers`:

    state = None          feed-forward blocks (SwiGLU, relu^2, MoE): no cache
    state = "kv"          attention (`KVLayerCache`) and MLA (`MLACache`): one slot per position
    state = "recurrent"   GDN, KDA, Mamba2 (`SSMLayerCache`, replay.py): conv window, state, ring
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from megakernel.common.registry import Registry

from .common import ReferenceError

if TYPE_CHECKING:
    from megakernel.models.config import Block, ModelConfig

LAYERS: Registry[type[ReferenceLayer]] = Registry("megakernel.reference.layers",
                                                  "reference layer kind",
                                                  skip=("base", "common", "replay"))


def register_layer(cls: type[ReferenceLayer]) -> type[ReferenceLayer]:
    """Class decorator: register a reference layer under `cls.kind`."""
    return LAYERS.add(cls.kind, cls)


class ReferenceLayer:
    """One block's op as the reference runs it: fp32 math, `store` at the kernel's bf16 stores."""

    kind: ClassVar[str] = ""
    state: ClassVar[str | None] = None  # None, "kv" or "recurrent" (module docstring)

    @classmethod
    def from_block(cls, blk: Block, model: ModelConfig, w: dict[str, torch.Tensor], mode: str,
                   device: torch.device) -> ReferenceLayer:
        """The layer of block `blk` of `model`; `w` holds every weight (Hugging Face names)."""
        raise NotImplementedError

    def new_cache(self, batch: int, max_seq_len: int, ring_capacity: int,
                  device: torch.device) -> Any:
        """An empty per-layer cache (None for layers without one)."""
        return None

    def check_cache(self, cache: Any, batch: int, max_seq_len: int, ring_capacity: int,
                    device: torch.device) -> None:
        """ReferenceError unless `cache` is what `new_cache` would make for these sizes."""

    def forward(self, xn: torch.Tensor, cache: Any, lengths: torch.Tensor, replay: bool,
                prefill: bool) -> torch.Tensor:
        """Normed (stored) input [B, T, D] -> the block's output [B, T, D] fp32 (added to h).

        Tokens sit at positions lengths[b] .. lengths[b]+T-1; the caller advances `lengths`.
        `replay`: recurrent layers run ReplaySSM (replay.py); `prefill`: the prompt pass."""
        raise NotImplementedError


def check_tensor(what: str, t: Any, layout: str, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, why: str) -> None:
    """ReferenceError naming `what` unless `t` is a tensor of `shape` (whose dims `layout` names),
    `dtype` (for the reason `why`, e.g. "fp32 mode") and `device`."""
    if not isinstance(t, torch.Tensor):
        raise ReferenceError(f"{what} is not a tensor but {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ReferenceError(f"{what} shape {tuple(t.shape)} does not match the model's {layout} "
                             f"= {shape}")
    if t.dtype != dtype:
        raise ReferenceError(f"cache dtype {t.dtype} does not match {dtype} ({why}): {what}")
    if t.device != device:
        raise ReferenceError(f"cache is on {t.device}, model on {device}: {what}")
