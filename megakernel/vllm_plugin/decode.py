"""The megakernel side of the plugin: a paged program (program/paged.py) per batch bucket
(1, 2, 4, 8, ...), its arenas and counters, fed each decode step from vLLM's metadata.

vLLM owns the pages: each attention layer's cache is vLLM-CPU's [num_blocks, Hkv, block_size,
2 D] (K page [D, block_size], then V page [block_size, D], per block and kv head). The CPU path
stages them: before a step every layer's pages are copied into the program's K and V caches
(one slot per layer), after it the pages of the step's slots are copied back, so vLLM's own
attention (prefill, mixed batches) sees what the megakernel wrote and the other way round.
"""

from __future__ import annotations

from collections import Counter

import torch

from megakernel.models.config import ModelConfig
from megakernel.program.paged import PagedKV, write_step_meta


def bucket_of(n: int) -> int:
    """The smallest power of two >= n: the batch a program is compiled for."""
    return 1 << max(0, (n - 1).bit_length())


class PagedDecoder:
    """Runs uniform decode steps (one token per sequence) of one model through
    torch.ops.megakernel.decode_step; `stats` counts the steps per bucket."""

    def __init__(self, cfg: ModelConfig, packed, paged: PagedKV) -> None:  # noqa: ANN001
        self.cfg, self.packed, self.paged = cfg, packed, paged
        self.states: dict[int, object] = {}  # bucket -> device_state.DeviceState
        self.kernels: dict[int, int] = {}  # bucket -> decode_step's kernel id
        self.caches: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stats: Counter[int] = Counter()

    def _state(self, bucket: int):  # noqa: ANN202
        """The program of `bucket` with its arenas (compiled on first use); every bucket shares
        the packed weights and the K/V caches."""
        if bucket not in self.states:
            from megakernel.device_state import allocate_state
            from megakernel.executor import executor_gpu
            from megakernel.program.compiler import compile_program
            from megakernel.torch_op import register_program

            prog = compile_program(self.cfg, bucket, executor_gpu(), paged=self.paged)
            st = allocate_state(self.cfg, None, prog, "cpu", packed=self.packed,
                                caches=self.caches)
            self.caches = (st.k_cache, st.v_cache)
            self.states[bucket] = st
            self.kernels[bucket] = register_program(prog, self.packed)
        return self.states[bucket]

    def step(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor, layer_caches: list[torch.Tensor]) -> torch.Tensor:
        """One decode step of n sequences: input_ids [n], seq_lens [n] (including this token),
        block_table [n, <= max_blocks], slot_mapping [n], vLLM's per-layer caches in layer
        order. Returns fp32 logits [n, V]; rows n .. bucket - 1 are padding (slot -1)."""
        n = input_ids.shape[0]
        b = bucket_of(n)
        st = self._state(b)
        pad = b - n
        tokens = torch.cat((input_ids, input_ids.new_zeros(pad)))
        lengths = torch.cat((seq_lens - 1, seq_lens.new_zeros(pad)))
        table = torch.cat((block_table, block_table.new_zeros(pad, block_table.shape[1])))
        slots = torch.cat((slot_mapping, slot_mapping.new_full((pad,), -1)))
        write_step_meta(st.i32, st.prog.buffers, tokens, lengths, table, slots)
        self._pages_in(st, layer_caches)
        _, logits = torch.ops.megakernel.decode_step(*st.tensors().values(), self.kernels[b],
                                                     st.offsets, True)
        self._pages_out(st, layer_caches, slot_mapping)
        self.stats[b] += 1
        return logits[:n]

    def _split(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's [num_blocks, Hkv, block_size, 2 D] as K [nb, Hkv, D, bs] and V [nb, Hkv, bs, D]
        views."""
        nb, h, bs, d2 = cache.shape
        pages = cache.view(nb, h, 2, bs * d2 // 2)
        return (pages[:, :, 0].view(nb, h, d2 // 2, bs), pages[:, :, 1].view(nb, h, bs, d2 // 2))

    def _pages_in(self, st, layer_caches: list[torch.Tensor]) -> None:  # noqa: ANN001
        for slot, cache in enumerate(layer_caches):
            k, v = self._split(cache)
            st.k_cache[slot].copy_(k)
            st.v_cache[slot].copy_(v)

    def _pages_out(self, st, layer_caches: list[torch.Tensor],  # noqa: ANN001
                   slot_mapping: torch.Tensor) -> None:
        blocks = torch.unique(slot_mapping[slot_mapping >= 0] // self.paged.block_size)
        for slot, cache in enumerate(layer_caches):
            k, v = self._split(cache)
            k[blocks] = st.k_cache[slot, blocks]
            v[blocks] = st.v_cache[slot, blocks]
