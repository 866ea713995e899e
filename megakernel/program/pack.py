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

FP8 models (`cfg.quant`, docs/FP8.md): every block matrix (and the LM head when the format says so)
is an "fp8" entry of one byte per weight (R*K/2 elements), its fp32 scales right before it, rows
in reverse order (`scale_span`); the offset of an entry is that of its first weight.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from megakernel.kernel.host.arena import align, scale_span
from megakernel.layers import kind
from megakernel.layers.frame import padded_vocab
from megakernel.models.fp8 import E4M3, Fp8Format, scale_name, spread


class PackError(ValueError):
    """Weights that do not fit the packed layout (a missing tensor or a wrong shape)."""


@dataclass(frozen=True)
class Entry:
    offset: int  # element offset in the arena (an fp8 entry: its first weight byte / 2)
    shape: tuple[int, ...]
    dtype: str = "bf16"  # "bf16" or "fp8"
    chunks: int = 0  # fp8: scales per row (C), stored before `offset`
    chunk: int = 0  # fp8: inputs per scale (K for channel scales, 128 for block; the last short)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def span(self) -> int:
        """Arena elements its values occupy from `offset`."""
        return self.numel if self.dtype == "bf16" else -(-self.numel // 2)

    @property
    def scale_offset(self) -> int:
        """Element offset of its scale block ([R, C] fp32, rows reversed), ending at `offset`."""
        return self.offset - scale_span(self.shape[0], self.chunks)

    def w(self, row0: int) -> int:
        """A record's W: the element offset of row `row0` (fp8: its first byte / 2)."""
        return self.offset + (row0 * self.shape[1] if self.dtype == "bf16"
                              else row0 * self.shape[1] // 2)

    def row_bytes(self, k: int) -> int:
        """Bytes a GEMV streams per row: the weights plus (fp8) the row's scales."""
        return 2 * k if self.dtype == "bf16" else k + 4 * self.chunks


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

    @functools.cached_property
    def _starts(self) -> tuple[list[int], list[Entry]]:
        es = sorted(self.entries.values(), key=lambda e: e.offset)
        return [e.offset for e in es], es

    def entry_at(self, off: int) -> Entry:
        """The entry whose values hold element offset `off`."""
        starts, es = self._starts
        i = bisect.bisect_right(starts, off) - 1
        if i < 0 or not es[i].offset <= off < es[i].offset + es[i].span:
            raise PackError(f"weight offset {off} is in no packed tensor")
        return es[i]


class LayoutBuilder:
    """Places tensors one after another in the arena, each start ALIGN-aligned unless it follows
    the previous entry directly."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.end = 0  # end of the last entry
        self.off = 0  # next aligned start

    def put(self, key: str, shape: tuple[int, ...], follow: bool = False,
            quant: Fp8Format | None = None) -> None:
        """Place `key`; with `quant` as an fp8 matrix, its scale block first (aligned)."""
        if key in self.entries:
            raise ValueError(f"packed key {key!r} placed twice")
        if quant is None:
            e = Entry(self.end if follow else self.off, tuple(shape))
        else:
            if follow or len(shape) != 2 or shape[1] % 2:
                raise ValueError(f"fp8 matrix {key!r} {shape}: a 2-D matrix with even rows")
            c = quant.chunks(shape[1])
            e = Entry(self.off + align(scale_span(shape[0], c)), tuple(shape), "fp8", c,
                      quant.chunk(shape[1]))
        self.entries[key] = e
        self.end = e.offset + e.span
        self.off = align(self.end)

    def done(self) -> WeightLayout:
        return WeightLayout(self.entries, self.off)


def _layers(cfg) -> dict[int, list]:  # noqa: ANN001
    out: dict[int, list] = {}
    for blk in cfg.blocks:
        out.setdefault(blk.layer, []).append(blk)
    return out


def _put_all(lay: LayoutBuilder, prefix: str, items, quant: Fp8Format | None = None  # noqa: ANN001
             ) -> None:
    for item in items:
        suffix, shape = item[0], item[1]
        follow = len(item) > 2 and item[2]  # a bias after its matrix: bf16
        lay.put(f"{prefix}.{suffix}", shape, follow=follow,
                quant=quant if len(shape) == 2 and not follow else None)


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
    q = cfg.quant
    for blk in cfg.blocks:
        _put_all(lay, blk.key, kind(blk.kind).matrices(blk, cfg), q)
    if not cfg.tie_word_embeddings:
        lay.put("lm_head", (vpad, h), quant=q if q is not None and q.lm_head else None)
    return lay.done()


@dataclass
class PackedWeights:
    layout: WeightLayout
    arena: torch.Tensor  # [numel] bf16
    tables: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # fp32 rows

    def view(self, key: str) -> torch.Tensor:
        """Entry `key` as stored: bf16, or the e4m3 codes of an fp8 matrix."""
        e = self.layout[key]
        raw = self.arena[e.offset : e.offset + e.span]
        return raw.view(e.shape) if e.dtype == "bf16" else raw.view(E4M3)[: e.numel].view(e.shape)

    def set_scales(self, key: str, s: torch.Tensor) -> None:
        e = self.layout[key]
        self.arena[e.scale_offset : e.offset].view(torch.float32).view(
            e.shape[0], e.chunks).copy_(s.flip(0))

    def slab(self, w: int, row0: int, nrows: int, k: int) -> tuple[torch.Tensor, int]:
        """Rows [row0, row0 + nrows) of the matrix whose record W is `w`, as fp32 weights
        (fp8: code * scale, exactly the reference's dequantization), and the bytes a GEMV
        streams for them."""
        e = self.layout.entry_at(w)
        if e.dtype == "bf16":
            return self.arena[w : w + nrows * k].view(nrows, k).float(), nrows * k * 2
        if e.w(row0) != w or e.shape[1] != k:
            raise PackError(f"an fp8 slab at W={w}, row {row0} of K={k} does not start a row of "
                            f"the matrix at {e.offset} {e.shape}")
        codes = self.arena[w : w + nrows * k // 2].view(E4M3).view(nrows, k)
        s = self.arena[e.scale_offset : e.offset].view(torch.float32).view(-1, e.chunks)
        rows = s.flip(0)[row0 : row0 + nrows]
        return codes.float() * spread(rows, e.chunk, k), nrows * e.row_bytes(k)


def pack_weights(cfg, weights: Mapping[str, torch.Tensor],  # noqa: ANN001
                 device: str | torch.device = "cpu") -> PackedWeights:
    """Repack Hugging Face-named weights (any mapping: models.weights.LazyRandomWeights draws
    each on read) into an arena on `device` (bf16; padding is zero). An FP8 model's mapping holds
    the quantized matrices as e4m3 codes plus their `_scale` grids (models/fp8.py): the codes
    go through the kinds' `pack` exactly (every e4m3 value is a bf16 one), and so do the scales,
    one run per row, so a packed row keeps its own scales whatever the packing does to rows."""
    lay = weight_layout(cfg)
    packed = PackedWeights(lay, torch.zeros(lay.numel, dtype=torch.bfloat16, device=device))
    q = cfg.quant

    def get(name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if name not in weights:
            raise PackError(f"weight {name!r} is missing")
        return weights[name].to(dtype)

    def get_scales(name: str) -> torch.Tensor:
        """The row-wise scales of a quantized matrix [R, C]; other tensors as `get`."""
        t = get(name)
        if t.dim() != 2 or scale_name(name) not in weights:
            return t
        return q.row_scales(weights[scale_name(name)], t.shape[0], t.shape[1])

    def put(key: str, t: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        e = lay[key]
        dst = packed.view(key)
        if tuple(t.shape) != tuple(dst.shape):
            if not (key in ("embed", "lm_head") and tuple(t.shape[1:]) == tuple(dst.shape[1:])
                    and t.shape[0] <= dst.shape[0]):
                raise PackError(f"packed {key}: shape {tuple(t.shape)}, expected "
                                f"{tuple(dst.shape)}")
            t = torch.cat((t, t.new_zeros(dst.shape[0] - t.shape[0], *t.shape[1:])))
            if scales is not None:  # vocab padded to ROW_ALIGN rows (zeros)
                scales = torch.cat((scales, scales.new_zeros(t.shape[0] - scales.shape[0],
                                                             scales.shape[1])))
        if e.dtype == "bf16":
            dst.copy_(t)
            return
        codes = t.to(E4M3)
        if not torch.equal(codes.to(t.dtype), t):
            raise PackError(f"packed {key}: not e4m3 codes (a source matrix is not quantized)")
        dst.copy_(codes)
        packed.set_scales(key, scales)

    for blk in cfg.blocks:
        kd = kind(blk.kind)
        put(f"{blk.key}.norm", get(blk.norm))
        tensors = kd.pack(blk, cfg, lambda n, p=blk.prefix: get(p + n))
        scales = (kd.pack(blk, cfg, lambda n, p=blk.prefix: get_scales(p + n))
                  if q is not None else {})
        for suffix, t in tensors.items():
            key = f"{blk.key}.{suffix}"
            put(key, t, scales[suffix] if lay[key].dtype == "fp8" else None)
        tables = kd.tables(blk, cfg, lambda n, p=blk.prefix: get(p + n, torch.float32))
        for region, t in tables.items():
            packed.tables[(region, blk.layer)] = t.reshape(-1).to(torch.float32)
    put("final_norm", get(cfg.final_norm_name))
    put("embed", get(cfg.embed_name))
    if not cfg.tie_word_embeddings:
        head = lay["lm_head"]
        put("lm_head", get(cfg.lm_head_name),
            get_scales(cfg.lm_head_name) if head.dtype == "fp8" else None)
    return packed
