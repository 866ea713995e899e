"""Paged KV (program/paged.py) on the CPU executor against the reference and the contiguous cache.

The reference's bf16 cache after a ragged prefill is scattered into pages in a shuffled block
order (so a wrong block-table lookup reads another sequence's keys); each step the host writes
input ids, lengths, the block table and the slot mapping, as vLLM does. The paged program must
give the contiguous program's logits exactly at the same batch (only the addressing differs) and
the reference's within the dense executor tests' bound; padding rows (slot -1) must leave every
page untouched and their logits finite. In a hybrid model the recurrent layers' state stays per
batch row (the host stages the caller's state slots into it, vllm_plugin/decode.py).
"""

from __future__ import annotations

import pytest
import torch

from megakernel.executor import Executor, executor_gpu
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights
from megakernel.program.paged import PagedKV, write_step_meta
from megakernel.reference.model import ReferenceModel, greedy
from tests.executor.helpers import check_logits

LOGIT_TOL = 0.04  # the dense executor tests' bound (test_executor_dense.py)
STEPS = 5
BLOCK = 4  # small pages: every sequence spans several


def _pages(prog, c16, table: torch.Tensor, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference cache's K/V of the first `real` sequences in the paged layout."""
    b, pg = prog.buffers, prog.buffers.paged
    k = torch.randn(b.kv_shape).to(torch.bfloat16)  # never-written pages: random, not zeros
    v = torch.randn(b.v_shape).to(torch.bfloat16)
    for layer, slot in b.kv_slot.items():
        ck, cv = c16.layers[layer].k, c16.layers[layer].v  # [B, Hkv, S, D]
        for s in range(real):
            for j in range(int(c16.lengths[s])):
                blk, o = int(table[s, j // pg.block_size]), j % pg.block_size
                k[slot, blk, :, :, o] = ck[s, :, j]
                v[slot, blk, :, o] = cv[s, :, j]
    return k, v


@pytest.mark.parametrize("name, batch, real, n_splits", [
    ("llama-tiny", 3, 3, None), ("qwen3-tiny", 4, 3, 3), ("qwen2-tiny", 2, 1, None),
    ("nemotron-h-tiny", 3, 3, None), ("qwen3.5-tiny", 4, 3, None)])
def test_paged_matches_contiguous_and_reference(name: str, batch: int, real: int,
                                                n_splits: int | None) -> None:
    cfg = preset(name)
    seed = 7 * batch + real
    w = random_weights(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 10, (real,), generator=g).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    max_blocks = -(-(max(lens) + STEPS) // BLOCK)
    paged = PagedKV(num_blocks=batch * max_blocks + 3, block_size=BLOCK, max_blocks=max_blocks)
    s_max = paged.max_seq_len
    ref16, ref32 = ReferenceModel(cfg, w, mode="bf16"), ReferenceModel(cfg, w, mode="fp32")
    c16, c32 = ref16.new_cache(real, s_max), ref32.new_cache(real, s_max)
    tok = greedy(ref16.prefill(c16, prompts))[:, None]  # [real, 1]
    ref32.prefill(c32, prompts)
    packed = pack_weights(cfg, w)
    gpu = executor_gpu()
    prog = compile_program(cfg, batch, gpu, max_seq_len=s_max, n_splits=n_splits, paged=paged)
    flat = compile_program(cfg, real, gpu, max_seq_len=s_max, n_splits=n_splits)
    ex_p, ex_c = Executor(prog, packed), Executor(flat, packed)
    ex_c.load_cache(c16)
    table = torch.randperm(paged.num_blocks, generator=g)[: batch * max_blocks]
    table = table.view(batch, max_blocks)
    k, v = _pages(prog, c16, table, real)
    ex_p.k.copy_(k)
    ex_p.v.copy_(v)
    for layer, regs in prog.buffers.state.items():  # recurrent layers: the state rows
        for name in regs:
            ex_p.state_region(layer, name)[:real].copy_(getattr(c16.layers[layer], name))
    for step in range(STEPS):
        lengths = torch.zeros(batch, dtype=torch.int64)
        lengths[:real] = c16.lengths
        slots = torch.full((batch,), -1, dtype=torch.int64)  # rows >= real: padding
        for s in range(real):
            n = int(lengths[s])
            slots[s] = table[s, n // BLOCK] * BLOCK + n % BLOCK
        tokens = torch.zeros(batch, 1, dtype=torch.int64)
        tokens[:real] = tok
        write_step_meta(ex_p.i32, prog.buffers, tokens, lengths, table, slots)
        before = (ex_p.k.clone(), ex_p.v.clone())
        ex_p.step(seed=step)
        ex_c.step(tok, seed=step)
        if batch == real:  # one program shape: only the addressing differs
            assert torch.equal(ex_p.logits, ex_c.logits), f"step {step}: paged != contiguous"
        assert torch.isfinite(ex_p.logits).all()
        assert torch.equal(ex_p.lengths, lengths.to(torch.int32)), "a paged step moved lengths"
        l16, l32 = ref16.decode(c16, tok)[:, 0], ref32.decode(c32, tok)[:, 0]
        check_logits(step, ex_p.logits[:real], l16, l32, LOGIT_TOL)
        for new, old in zip((ex_p.k, ex_p.v), before, strict=True):
            changed = (new != old).flatten(2).any(-1)  # [slots, blocks]
            used = {int(s) // BLOCK for s in slots[:real]}
            assert set(changed.any(0).nonzero().flatten().tolist()) <= used, \
                f"step {step}: a page outside the slot mapping was written"
        tok = greedy(l16)[:, None]


def test_a_paged_program_runs_recurrent_layers_by_the_recurrent_update() -> None:
    """The caller's state slots hold a state, not a ReplaySSM ring: a paged program with a
    replay window is refused by name."""
    from megakernel.isa.stages import PlanError

    with pytest.raises(PlanError, match="recurrent update"):
        compile_program(preset("nemotron-h-tiny"), 2, executor_gpu(), paged=PagedKV(8, 4, 4),
                        replay_window=4)
