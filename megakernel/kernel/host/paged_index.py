"""Index arithmetic of the paged KV cache on the device (KernelSpec.paged), no DSL.

A paged build keeps K/V in vLLM-CPU's page layout, one cache slot per attention layer:

    K  [slots, num_blocks, Hkv, D, block_size]   a key's D dims are block_size elements apart
    V  [slots, num_blocks, Hkv, block_size, D]   a value row is D contiguous elements

Key j of sequence b lives in block `block_table[b, j // block_size]` at offset j % block_size; the
QKV epilogue stores the new K/V of activation row n at `slot_mapping[n]` = block * block_size +
offset, nothing when the slot is negative (a padding row, whose attention sees no keys). The
block table and the slot mapping are i32 regions whose offsets, like the pool's shape, the build
bakes in (checked against the program header: launch.checks.check_header).

In ATTN_PARTIAL lane = key, so a K page serves the warp's scores with coalesced loads: for each
head dim, the 32 lanes read consecutive offsets of one page row (a chunk of 32 keys may straddle
pages: each lane looks up its own key's block). The value rows then go one key at a time, the
key's slot broadcast from its lane.

Plain arithmetic on ints here and in the host emulation
(tests/kernel/test_kernel_paged_emulation.py), on Int32/Int64 in the kernel: the same functions
index both.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGED_FIELDS = ("num_blocks", "block_size", "max_blocks", "table_off", "slot_off")


@dataclass(frozen=True)
class PagedShape:
    """A paged build's constants (KernelSpec.paged, in PAGED_FIELDS order) and the cache's heads."""

    num_blocks: int
    block_size: int
    max_blocks: int
    table_off: int  # i32 element offset of block_table [B, max_blocks]
    slot_off: int  # i32 element offset of slot_mapping [N]
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, paged: tuple[int, ...], kv_heads: int, head_dim: int) -> PagedShape:
        return cls(*paged, kv_heads, head_dim)

    @property
    def page_elems(self) -> int:
        """Elements of one (block, kv head) page of K or of V: D * block_size."""
        return self.head_dim * self.block_size

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks * self.block_size

    def header(self) -> dict[str, int]:
        """The program header entries a program must have to run on this build."""
        return dict(PAGED=1, PAGE_BLOCKS=self.num_blocks, PAGE_SIZE=self.block_size,
                    PAGE_MAX_BLOCKS=self.max_blocks, I32_BLOCK_TABLE_OFF=self.table_off,
                    I32_SLOT_MAPPING_OFF=self.slot_off)


def table_entry(b, key, block_size: int, max_blocks: int):
    """(i32 element of block_table[b, key // block_size] relative to the table, offset of the key
    in its block)."""
    page = key // block_size
    return b * max_blocks + page, key - page * block_size


def slot_block(slot, block_size: int):
    """(block, offset) of a slot_mapping entry (block * block_size + offset, >= 0)."""
    blk = slot // block_size
    return blk, slot - blk * block_size


def page_base(cslot, blk, g, num_blocks: int, kv_heads: int, page_elems: int):
    """First element of the (cache slot, block, kv head) page of K or of V (both pages hold
    D * block_size elements; Int64 in the kernel)."""
    return ((cslot * num_blocks + blk) * kv_heads + g) * page_elems


def k_elem(base, d, o, block_size: int):
    """Element of head dim d of the key at offset o of a K page [D, block_size] (transposed)."""
    return base + d * block_size + o


def v_elem(base, o, d, head_dim: int):
    """Element of head dim d of the value at offset o of a V page [block_size, D]."""
    return base + o * head_dim + d


def check_paged(p: PagedShape) -> str:
    """Why a build cannot serve this page pool ('' when it can)."""
    if min(p.num_blocks, p.block_size, p.max_blocks) < 1:
        return f"paged KV: num_blocks, block_size, max_blocks must be >= 1, got {p}"
    if p.table_off < 0 or p.slot_off < 0:
        return "paged KV: the block table and slot mapping offsets must be known (>= 0)"
    return ""
