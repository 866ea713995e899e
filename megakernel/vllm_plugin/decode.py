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

A hybrid model's recurrent layers keep their state in vLLM's state slots (one per request,
`StateSlots`); the program's state is per batch row. The CPU path stages it the same way: before
a run the slots of its sequences are copied into the program's rows (padding rows zeroed), after
it copied back. A recurrent layer commits every token of a step, so such a model is served
decode steps only (one token per sequence): a verify step would commit its rejected drafts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from megakernel.models.config import ModelConfig
from megakernel.program.paged import PagedKV, write_step_meta


def bucket_of(n: int) -> int:
    """The smallest power of two >= n: the batch a program is compiled for."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class StateSlots:
    """The caller's recurrent state of one step: per recurrent layer (decoder layer index) its
    tensors by the program's state region names, each [num_slots, *that region's row shape]
    (a view of the caller's slots in the program's layout; any dtype), and the slot of each
    sequence of the step in that layer's tensors, in sequence order (vLLM: per KV cache group,
    so per layer)."""

    layers: dict[int, dict[str, torch.Tensor]]
    index: dict[int, torch.Tensor]  # layer -> [n] int: sequence b's state is in slot index[b]


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
             query_lens: torch.Tensor | None = None,
             states: StateSlots | None = None) -> torch.Tensor:
        """One step of n sequences: query_lens [n] the tokens each brings (None: one each),
        input_ids and slot_mapping [sum(query_lens)] (each sequence's tokens in a run, in
        sequence order, as vLLM lays them out), seq_lens [n] (including this step's tokens),
        block_table [n, <= max_blocks], vLLM's per-layer caches in attention layer order,
        `states` the recurrent layers' slots (a hybrid model; read and written back). Returns
        fp32 logits [sum(query_lens), V], one row per token."""
        if query_lens is None:
            query_lens = torch.ones_like(seq_lens)
        self._check_states(states, query_lens)
        starts = torch.cumsum(query_lens, 0) - query_lens
        groups = []  # (T, its sequences, their token rows)
        for t in torch.unique(query_lens).tolist():
            seqs = (query_lens == t).nonzero().flatten()
            groups.append((t, seqs, (starts[seqs, None] + torch.arange(t)).flatten()))
            self._state(bucket_of(seqs.numel()), t)  # the shared caches exist from here on
        self._pages_in(layer_caches)
        parts = [(rows, self._run(input_ids[rows], seq_lens[seqs], block_table[seqs],
                                  slot_mapping[rows], t, states, seqs))
                 for t, seqs, rows in groups]
        self._pages_out(layer_caches, slot_mapping)
        self._count([(bucket_of(seqs.numel()), t) for t, seqs, _ in groups])
        out = parts[0][1].new_empty(input_ids.shape[0], parts[0][1].shape[1])
        for rows, logits in parts:
            out[rows] = logits
        return out

    def _check_states(self, states: StateSlots | None, query_lens: torch.Tensor) -> None:
        """The caller's state slots cover exactly the model's recurrent layers, one slot per
        sequence, and the step brings one token per sequence (module docstring)."""
        want = self.cfg.recurrent_layers()
        if states is None:
            if want:
                raise ValueError(f"{self.cfg.name or self.cfg.family}: recurrent layers {want} "
                                 "need the caller's state slots")
            return
        for what, layers in (("state slots", states.layers), ("slot indices", states.index)):
            if sorted(layers) != sorted(want):
                raise ValueError(f"{what} for layers {sorted(layers)}, the model's recurrent "
                                 f"layers are {sorted(want)}")
        for layer, index in states.index.items():
            if index.shape != query_lens.shape:
                raise ValueError(f"layer {layer}: {tuple(index.shape)} state slots for "
                                 f"{query_lens.numel()} sequences")
        if bool((query_lens != 1).any()):
            raise ValueError("a step of a model with recurrent layers brings one token per "
                             f"sequence (it commits every token), got {query_lens.tolist()}")

    def _count(self, runs: list[tuple[int, int]]) -> None:
        """A decode step under `stats`, a verify step (some sequence brings more than one
        token) under `verify_steps` and its runs under `verify_stats`."""
        if all(t == 1 for _, t in runs):
            self.stats[runs[0][0]] += 1
            return
        self.verify_steps += 1
        self.verify_stats.update(runs)

    def _run(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor, tokens: int, states: StateSlots | None = None,
             seqs: torch.Tensor | None = None) -> torch.Tensor:
        """The program of (bucket, `tokens`) on n sequences of `tokens` tokens each (pages
        staged; `seqs` [n] which of the step's sequences they are, for their slots in
        `states`): fp32 logits [n * tokens, V]; rows past n are padding (slot -1, length 0,
        zero state)."""
        n = seq_lens.shape[0]
        b = bucket_of(n)
        st = self._state(b, tokens)
        rows = self._state_rows(st, states, seqs)
        for mine, theirs, index in rows:
            mine[:n] = theirs[index]
            mine[n:] = 0
        pad = b - n
        ids = torch.cat((input_ids, input_ids.new_zeros(pad * tokens)))
        lengths = torch.cat((seq_lens - tokens, seq_lens.new_zeros(pad)))
        table = torch.cat((block_table, block_table.new_zeros(pad, block_table.shape[1])))
        slots = torch.cat((slot_mapping, slot_mapping.new_full((pad * tokens,), -1)))
        write_step_meta(st.i32, st.prog.buffers, ids.view(b, tokens), lengths, table, slots)
        _, logits = torch.ops.megakernel.decode_step(*st.tensors().values(),
                                                     self.kernels[(b, tokens)], st.offsets,
                                                     True)
        for mine, theirs, index in rows:
            theirs[index] = mine[:n].to(theirs.dtype)
        return logits.view(b * tokens, -1)[: n * tokens]

    @staticmethod
    def _state_rows(st, states: StateSlots | None,  # noqa: ANN001 (DeviceState)
                    seqs: torch.Tensor | None
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per (recurrent layer, state region): the program's rows [B, ...], the caller's
        slots, the slot of each of the sequences `seqs`."""
        if states is None:
            return []
        out = []
        for layer, regions in states.layers.items():
            want = set(st.prog.buffers.state[layer])
            if set(regions) != want:
                raise ValueError(f"layer {layer}: state slots of {sorted(regions)}, the "
                                 f"program keeps {sorted(want)}")
            for name, theirs in regions.items():
                mine = st.state_region(layer, name)
                if tuple(theirs.shape[1:]) != tuple(mine.shape[1:]):
                    raise ValueError(f"layer {layer} {name}: state slots of shape "
                                     f"{tuple(theirs.shape[1:])}, the program's rows are "
                                     f"{tuple(mine.shape[1:])}")
                out.append((mine, theirs, states.index[layer][seqs]))
        return out

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
