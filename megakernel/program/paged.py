"""Paged KV cache: a program whose attention reads K/V through a block table and whose QKV
epilogue writes the new K/V through a slot mapping, the way vLLM lays out its cache.

The page layout is the one of vLLM-CPU's attention backend (vllm 0.32.0,
`vllm/v1/attention/backends/cpu_attn.py`, ISA "vec"): a layer's cache is
[num_blocks, Hkv, block_size, 2 D], per (block, kv head) a K page then a V page; its
`cpu_attn_reshape_and_cache` stores K transposed, [D, block_size], and V plain,
[block_size, D] (checked by writing known values through it). One program's caches hold those
pages per cache slot (attention layer, in layer order):

    K  [slots, num_blocks, Hkv, D, block_size]   (bf16)
    V  [slots, num_blocks, Hkv, block_size, D]   (bf16)

Sequence b's key j lives in block `block_table[b, j // block_size]` at offset `j % block_size`;
the new token of activation row n goes to slot `slot_mapping[n]` = block * block_size + offset.
A row whose slot is negative is padding: it writes no K/V and its attention output is zero. A
paged program takes its step metadata from the caller (vLLM's persistent buffers): input ids,
lengths (tokens cached before this step), block table and slot mapping are written by the host
before each step; the step neither advances lengths nor feeds tokens back, and the caller reads
the fp32 logits (vLLM samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.models.config import ConfigError

__all__ = ["PagedKV", "load_pages", "page_runs", "slots_of", "write_step_meta"]


@dataclass(frozen=True)
class PagedKV:
    """The page pool of a paged program: `num_blocks` blocks of `block_size` positions, at most
    `max_blocks` per sequence (the block table's width)."""

    num_blocks: int
    block_size: int
    max_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"paged KV: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_seq_len(self) -> int:
        """Positions one sequence can hold: the program's S_max."""
        return self.max_blocks * self.block_size

    def page_shapes(self, num_kv_heads: int, head_dim: int
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One cache slot of K [num_blocks, Hkv, D, block_size] and of V
        [num_blocks, Hkv, block_size, D]."""
        nb, bs = self.num_blocks, self.block_size
        return (nb, num_kv_heads, head_dim, bs), (nb, num_kv_heads, bs, head_dim)

    def header(self) -> dict[str, int]:
        return dict(PAGED=1, PAGE_BLOCKS=self.num_blocks, PAGE_SIZE=self.block_size,
                    PAGE_MAX_BLOCKS=self.max_blocks)


def page_runs(table: torch.Tensor, block_size: int, j0: int, j1: int
              ) -> list[tuple[int, int, int, int]]:
    """Keys [j0, j1) of one sequence as runs within a page: (block, first offset, end offset,
    first key) per page touched, in key order; `table` [max_blocks] int is its block table."""
    out = []
    j = j0
    while j < j1:
        page, o0 = divmod(j, block_size)
        o1 = min(block_size, o0 + j1 - j)
        out.append((int(table[page]), o0, o1, j))
        j += o1 - o0
    return out


def write_step_meta(i32: torch.Tensor, buffers, tokens: torch.Tensor,  # noqa: ANN001
                    lengths: torch.Tensor, block_table: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """The host's part of a paged step: tokens [B, T] (input ids), lengths [B] (tokens cached
    before this step), block_table [B, <= max_blocks] and slot_mapping [B T] into the program's
    i32 arena (`buffers`: its BufferPlan). Padding rows: slot -1, length 0, any valid token."""
    def put(name: str, t: torch.Tensor) -> None:
        r = buffers.i32[name]
        view = i32[r.offset : r.offset + r.numel].view(r.shape)
        if t.dim() == 2 and t.shape[1] < view.shape[1]:  # a narrower block table
            view[:, t.shape[1]:] = 0
            view = view[:, : t.shape[1]]
        view.copy_(t.reshape(view.shape).to(torch.int32))

    put("tokens_in", tokens.reshape(-1))
    put("lengths", lengths)
    put("block_table", block_table)
    put("slot_mapping", slot_mapping)


def slots_of(table: torch.Tensor, lengths: torch.Tensor, tokens: int, block_size: int,
             live: int) -> torch.Tensor:
    """slot_mapping [B T] of a step: row (b, t) of the first `live` sequences goes to position
    lengths[b] + t through the block table [B, max_blocks]; the other rows are padding (-1)."""
    out = torch.full((table.shape[0], tokens), -1, dtype=torch.int64)
    for b in range(live):
        for t in range(tokens):
            j = int(lengths[b]) + t
            out[b, t] = int(table[b, j // block_size]) * block_size + j % block_size
    return out.reshape(-1)


def load_pages(k: torch.Tensor, v: torch.Tensor, kv_slot: dict[int, int], cache,  # noqa: ANN001
               table: torch.Tensor, block_size: int) -> None:
    """Scatter a reference cache (reference.model.Cache) of the table's sequences (its first
    table.shape[0]) into pages: K
    [slots, blocks, Hkv, D, bs], V [slots, blocks, Hkv, bs, D] (`kv_slot`: decoder layer ->
    cache slot), key j of sequence b at block table[b, j // bs], offset j % bs."""
    for layer, slot in kv_slot.items():
        ck, cv = cache.layers[layer].k, cache.layers[layer].v  # [B, Hkv, S, D]
        for b in range(table.shape[0]):
            for j in range(int(cache.lengths[b])):
                blk, o = int(table[b, j // block_size]), j % block_size
                k[slot, blk, :, :, o] = ck[b, :, j].to(k.device)
                v[slot, blk, :, o] = cv[b, :, j].to(v.device)
