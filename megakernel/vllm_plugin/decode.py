"""The megakernel side of the plugin: a paged program (program/paged.py) per batch bucket
(1, 2, 4, 8, ...) and tokens per sequence T, its arenas and counters, fed each step from vLLM's
metadata.

A step is a batch in which every sequence brings at most a few tokens: a decode step (one
each) or a speculative verify step (1 + its drafts each, ngram drafting; docs/VLLM.md). The
sequences are grouped by their query length T and each group runs the program of (bucket, T):
its rows (b, t) are sequence b's tokens at positions lengths[b] + t, and their fp32 logits go
back to vLLM's rows. One program serves only one T (a row past a sequence's own tokens is not
padding the program defines), hence one run per query length present.

vLLM owns the pages: each attention layer's cache is vLLM-CPU's [num_blocks, Hkv, block_size,
2 D] (K page [D, block_size], then V page [block_size, D], per block and kv head). The CPU path
stages them: before a step every layer's pages are copied into the programs' shared K and V
caches (one slot per layer), after it the pages of the step's slots are copied back, so vLLM's
own attention (prefill, mixed batches) sees what the megakernel wrote and the other way round.
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
    """Runs decode and verify steps of one model through torch.ops.megakernel.decode_step.
    `stats` counts the decode steps (one token per sequence) per bucket; `verify_stats` the
    program runs of verify steps per (bucket, T), `verify_steps` those steps."""

    def __init__(self, cfg: ModelConfig, packed, paged: PagedKV) -> None:  # noqa: ANN001
        self.cfg, self.packed, self.paged = cfg, packed, paged
        self.states: dict[tuple[int, int], object] = {}  # (bucket, T) -> DeviceState
        self.kernels: dict[tuple[int, int], int] = {}  # (bucket, T) -> decode_step's kernel id
        self.caches: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stats: Counter[int] = Counter()
        self.verify_stats: Counter[tuple[int, int]] = Counter()
        self.verify_steps = 0

    def _state(self, bucket: int, tokens: int = 1):  # noqa: ANN202
        """The program of (`bucket`, `tokens`) with its arenas (compiled on first use); every
        program shares the packed weights and the K/V caches."""
        key = (bucket, tokens)
        if key not in self.states:
            from megakernel.executor import executor_gpu
            from megakernel.launch.device_state import allocate_state
            from megakernel.launch.torch_op import register_program
            from megakernel.program.compiler import compile_program

            prog = compile_program(self.cfg, bucket, executor_gpu(), tokens=tokens,
                                   paged=self.paged)
            st = allocate_state(self.cfg, None, prog, "cpu", packed=self.packed,
                                caches=self.caches)
            self.caches = (st.k_cache, st.v_cache)
            self.states[key] = st
            self.kernels[key] = register_program(prog, self.packed)
        return self.states[key]

    def step(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor, layer_caches: list[torch.Tensor],
             query_lens: torch.Tensor | None = None) -> torch.Tensor:
        """One step of n sequences: query_lens [n] the tokens each brings (None: one each),
        input_ids and slot_mapping [sum(query_lens)] (each sequence's tokens in a run, in
        sequence order, as vLLM lays them out), seq_lens [n] (including this step's tokens),
        block_table [n, <= max_blocks], vLLM's per-layer caches in layer order. Returns fp32
        logits [sum(query_lens), V], one row per token."""
        if query_lens is None:
            query_lens = torch.ones_like(seq_lens)
        starts = torch.cumsum(query_lens, 0) - query_lens
        groups = []  # (T, its sequences, their token rows)
        for t in torch.unique(query_lens).tolist():
            seqs = (query_lens == t).nonzero().flatten()
            groups.append((t, seqs, (starts[seqs, None] + torch.arange(t)).flatten()))
            self._state(bucket_of(seqs.numel()), t)  # the shared caches exist from here on
        self._pages_in(layer_caches)
        parts = [(rows, self._run(input_ids[rows], seq_lens[seqs], block_table[seqs],
                                  slot_mapping[rows], t)) for t, seqs, rows in groups]
        self._pages_out(layer_caches, slot_mapping)
        self._count([(bucket_of(seqs.numel()), t) for t, seqs, _ in groups])
        out = parts[0][1].new_empty(input_ids.shape[0], parts[0][1].shape[1])
        for rows, logits in parts:
            out[rows] = logits
        return out

    def _count(self, runs: list[tuple[int, int]]) -> None:
        """A decode step under `stats`, a verify step (some sequence brings more than one
        token) under `verify_steps` and its runs under `verify_stats`."""
        if all(t == 1 for _, t in runs):
            self.stats[runs[0][0]] += 1
            return
        self.verify_steps += 1
        self.verify_stats.update(runs)

    def _run(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor, tokens: int) -> torch.Tensor:
        """The program of (bucket, `tokens`) on n sequences of `tokens` tokens each (pages
        staged): fp32 logits [n * tokens, V]; rows past n are padding (slot -1, length 0)."""
        n = seq_lens.shape[0]
        b = bucket_of(n)
        st = self._state(b, tokens)
        pad = b - n
        ids = torch.cat((input_ids, input_ids.new_zeros(pad * tokens)))
        lengths = torch.cat((seq_lens - tokens, seq_lens.new_zeros(pad)))
        table = torch.cat((block_table, block_table.new_zeros(pad, block_table.shape[1])))
        slots = torch.cat((slot_mapping, slot_mapping.new_full((pad * tokens,), -1)))
        write_step_meta(st.i32, st.prog.buffers, ids.view(b, tokens), lengths, table, slots)
        _, logits = torch.ops.megakernel.decode_step(*st.tensors().values(),
                                                     self.kernels[(b, tokens)], st.offsets,
                                                     True)
        return logits.view(b * tokens, -1)[: n * tokens]

    def _split(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's [num_blocks, Hkv, block_size, 2 D] as K [nb, Hkv, D, bs] and V [nb, Hkv, bs, D]
        views."""
        nb, h, bs, d2 = cache.shape
        pages = cache.view(nb, h, 2, bs * d2 // 2)
        return (pages[:, :, 0].view(nb, h, d2 // 2, bs), pages[:, :, 1].view(nb, h, bs, d2 // 2))

    def _pages_in(self, layer_caches: list[torch.Tensor]) -> None:
        k_cache, v_cache = self.caches
        for slot, cache in enumerate(layer_caches):
            k, v = self._split(cache)
            k_cache[slot].copy_(k)
            v_cache[slot].copy_(v)

    def _pages_out(self, layer_caches: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache = self.caches
        blocks = torch.unique(slot_mapping[slot_mapping >= 0] // self.paged.block_size)
        for slot, cache in enumerate(layer_caches):
            k, v = self._split(cache)
            k[blocks] = k_cache[slot, blocks]
            v[blocks] = v_cache[slot, blocks]
