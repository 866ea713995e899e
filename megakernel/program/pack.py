"""Weight packing: one flat bf16 arena in which every instruction streams one contiguous slab.

Layout (element offsets; every entry starts on a multiple of ALIGN elements = 128 bytes, except an
entry that must directly follow the previous one, such as a projection's bias after its matrix):

    head       per decoder layer: the input RMSNorm [H] of each of its blocks, then each block's
               small tensors (layers/*.py `vectors`: q/k norms, recurrent output norms, conv taps,
               MLA's kv_b ...); then the final norm [H]. First, so that the 32-bit operands that
               point at them (NORM_OFF, QK_NORM_OFF, CONV_W, ...) reach them in any model.
    embed      [V, H] (the LM head too when tied: then padded to ROW_ALIGN rows with zeros)
    per block  its matrices (layers/*.py `matrices`), row-major
    lm_head    [V padded to ROW_ALIGN, H] (untied models), zero rows past V

Every matrix is row-major, so rows [r0, r1) of it are one contiguous run: the tiling only picks
row ranges, and the arena does not depend on the GPU, the batch or the tiling. Keys are
"L{layer}.{block}.{name}" (the block's input norm: "L{layer}.{block}.norm"), "final_norm",
"embed", "lm_head".

fp32 constants that come with the checkpoint (SSM parameters, routers) are not in the bf16 arena:
`PackedWeights.tables[(region, layer)]` holds them for the program's f32 arena (layers `tables`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from megakernel.layers import kind
from megakernel.layers.frame import padded_vocab

ALIGN = 64  # elements (128 bytes): bulk copies and 16-byte vector loads need 16-byte alignment


class PackError(ValueError):
    """Weights that do not fit the packed layout (a missing tensor or a wrong shape)."""


@dataclass(frozen=True)
class Entry:
    offset: int  # element offset in the arena
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class WeightLayout:
    """Where every packed tensor lives (keys in the module docstring)."""

    entries: dict[str, Entry]
    numel: int

    def __getitem__(self, key: str) -> Entry:
        return self.entries[key]

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    @property
    def lm_head(self) -> Entry:
        return self.entries["lm_head"] if "lm_head" in self.entries else self.entries["embed"]

    @property
    def nbytes(self) -> int:
        return 2 * self.numel


class LayoutBuilder:
    """Places tensors one after another in the arena, each start ALIGN-aligned unless it follows
    the previous entry directly."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.end = 0  # end of the last entry
        self.off = 0  # next aligned start

    def put(self, key: str, shape: tuple[int, ...], follow: bool = False) -> None:
        if key in self.entries:
            raise ValueError(f"packed key {key!r} placed twice")
        e = Entry(self.end if follow else self.off, tuple(shape))
        self.entries[key] = e
        self.end = e.offset + e.numel
        self.off = (self.end + ALIGN - 1) // ALIGN * ALIGN

    def done(self) -> WeightLayout:
        return WeightLayout(self.entries, self.off)


def _layers(cfg) -> dict[int, list]:  # noqa: ANN001
    out: dict[int, list] = {}
    for blk in cfg.blocks:
        out.setdefault(blk.layer, []).append(blk)
    return out


def _put_all(lay: LayoutBuilder, prefix: str, items) -> None:  # noqa: ANN001
    for item in items:
        suffix, shape = item[0], item[1]
        lay.put(f"{prefix}.{suffix}", shape, follow=len(item) > 2 and item[2])


def weight_layout(cfg) -> WeightLayout:  # noqa: ANN001 (ModelConfig)
    """The packed layout of `cfg` (no tensors needed)."""
    h, lay = cfg.hidden_size, LayoutBuilder()
    for blocks in _layers(cfg).values():
        for blk in blocks:
            lay.put(f"{blk.key}.norm", (h,))
        for blk in blocks:
            _put_all(lay, blk.key, kind(blk.kind).vectors(blk, cfg))
    lay.put("final_norm", (h,))
    vpad = padded_vocab(cfg.vocab_size)
    lay.put("embed", (vpad if cfg.tie_word_embeddings else cfg.vocab_size, h))
    for blk in cfg.blocks:
        _put_all(lay, blk.key, kind(blk.kind).matrices(blk, cfg))
    if not cfg.tie_word_embeddings:
        lay.put("lm_head", (vpad, h))
    return lay.done()


@dataclass
class PackedWeights:
    layout: WeightLayout
    arena: torch.Tensor  # [numel] bf16
    tables: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # fp32 rows

    def view(self, key: str) -> torch.Tensor:
        e = self.layout[key]
        return self.arena[e.offset : e.offset + e.numel].view(e.shape)


def pack_weights(cfg, weights: Mapping[str, torch.Tensor],  # noqa: ANN001
                 device: str | torch.device = "cpu") -> PackedWeights:
    """Repack Hugging Face-named weights (any mapping: models.weights.LazyRandomWeights draws
    each on read) into an arena on `device` (bf16; padding is zero)."""
    lay = weight_layout(cfg)
    packed = PackedWeights(lay, torch.zeros(lay.numel, dtype=torch.bfloat16, device=device))

    def get(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if name not in weights:
            raise PackError(f"weight {name!r} is missing")
        return weights[name].to(dtype)

    def put(key: str, t: torch.Tensor) -> None:
        dst = packed.view(key)
        if tuple(t.shape) == tuple(dst.shape):
            dst.copy_(t)
        elif key in ("embed", "lm_head") and tuple(t.shape[1:]) == tuple(dst.shape[1:]) \
                and t.shape[0] <= dst.shape[0]:
            dst[: t.shape[0]].copy_(t)  # vocab padded to ROW_ALIGN rows (zeros)
        else:
            raise PackError(f"packed {key}: shape {tuple(t.shape)}, expected {tuple(dst.shape)}")

    for blk in cfg.blocks:
        kd = kind(blk.kind)
        put(f"{blk.key}.norm", get(blk.norm))
        for suffix, t in kd.pack(blk, cfg, lambda n, p=blk.prefix: get(p + n)).items():
            put(f"{blk.key}.{suffix}", t)
        tables = kd.tables(blk, cfg, lambda n, p=blk.prefix: get(p + n, torch.float32))
        for region, t in tables.items():
            packed.tables[(region, blk.layer)] = t.reshape(-1).to(torch.float32)
    put("final_norm", get(cfg.final_norm_name))
    put("embed", get(cfg.embed_name))
    if not cfg.tie_word_embeddings:
        put("lm_head", get(cfg.lm_head_name))
    return packed
