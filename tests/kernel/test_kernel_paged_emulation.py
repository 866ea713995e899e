"""Host emulation of the paged build's KV addressing (kernel/host/paged_index.py) against the CPU
executor's paged path (executor/ops/attention.py): the QKV epilogue's store through the slot
mapping and ATTN_PARTIAL's reads through the block table, with the kernel's own index helpers.

Pages come in a shuffled block order and hold random values (a wrong block, offset, head or the
transposed K index reads other numbers); one sequence is padding (slot -1: nothing stored, no
keys, output 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megakernel.executor import Executor, executor_gpu
from megakernel.executor.ops.attention import write_kv
from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.host.dense_index import attn_scale, kv_slot
from megakernel.kernel.host.paged_index import k_elem, page_base, slot_block, table_entry, v_elem
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights
from megakernel.program.paged import PagedKV, slots_of, write_step_meta
from tests.kernel.test_kernel_index_emulation import _emulate_attention

# (model, batch, tokens, live sequences, attention splits)
CASES = [("llama-tiny", 3, 1, 2, None), ("qwen3-tiny", 2, 2, 1, 3), ("qwen3-tiny", 4, 1, 4, 2)]
BLOCK, MAX_BLOCKS = 4, 6


def _setup(name: str, batch: int, tokens: int, live: int, n_splits: int | None, seed: int):
    """(program, spec, executor with random pages and this step's metadata written, table,
    lengths, slots)."""
    cfg = preset(name)
    g = torch.Generator().manual_seed(seed)
    paged = PagedKV(num_blocks=batch * MAX_BLOCKS + 3, block_size=BLOCK, max_blocks=MAX_BLOCKS)
    prog = compile_program(cfg, batch, executor_gpu(), tokens=tokens, n_splits=n_splits,
                           paged=paged)
    spec = make_spec(cfg, batch, tokens, "sm_90a", paged=paged)
    ex = Executor(prog, pack_weights(cfg, random_weights(cfg, seed=seed)))
    ex.k.copy_(torch.randn(ex.k.shape, generator=g).to(torch.bfloat16))
    ex.v.copy_(torch.randn(ex.v.shape, generator=g).to(torch.bfloat16))
    table = torch.randperm(paged.num_blocks, generator=g)[: batch * MAX_BLOCKS]
    table = table.view(batch, MAX_BLOCKS)
    lengths = torch.zeros(batch, dtype=torch.int64)
    lengths[:live] = torch.randint(1, paged.max_seq_len - tokens + 1, (live,), generator=g)
    slots = slots_of(table, lengths, tokens, BLOCK, live)
    toks = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=g)
    write_step_meta(ex.i32, prog.buffers, toks, lengths, table, slots)
    return prog, spec, ex, table, lengths, slots


@pytest.mark.parametrize("name, batch, tokens, live, n_splits", CASES)
def test_kv_store_indexing_matches_the_executor(name, batch, tokens, live, n_splits):
    prog, spec, ex, _, _, slots = _setup(name, batch, tokens, live, n_splits, seed=batch + 7)
    pg = spec.paged_shape
    ex.check = False  # stores outside a step
    kf, vf = (t.float().flatten().numpy().copy() for t in (ex.k, ex.v))
    g = torch.Generator().manual_seed(3)
    for layer, slot in prog.buffers.kv_slot.items():
        cslot = kv_slot(layer, spec.attn_layers)
        assert cslot == slot
        for grp in range(spec.kv_heads):
            for buf, flat in (("k", kf), ("v", vf)):
                x = torch.randn(spec.rows, spec.head_dim, generator=g).to(torch.bfloat16)
                write_kv(ex, buf, slot, grp, x, torch.zeros(spec.rows, dtype=torch.long))
                for n in range(spec.rows):  # Matvec.store_kv, lane by lane
                    if slots[n] < 0:
                        continue
                    blk, o = slot_block(int(slots[n]), pg.block_size)
                    base = page_base(cslot, blk, grp, pg.num_blocks, spec.kv_heads,
                                     pg.page_elems)
                    for d in range(spec.head_dim):
                        e = (k_elem(base, d, o, pg.block_size) if buf == "k"
                             else v_elem(base, o, d, spec.head_dim))
                        flat[e] = float(x[n, d])
    np.testing.assert_array_equal(ex.k.float().flatten().numpy(), kf)
    np.testing.assert_array_equal(ex.v.float().flatten().numpy(), vf)


@pytest.mark.parametrize("name, batch, tokens, live, n_splits", CASES)
def test_paged_attention_indexing_matches_the_executor(name, batch, tokens, live, n_splits):
    prog, spec, ex, table, lengths, slots = _setup(name, batch, tokens, live, n_splits,
                                                   seed=batch * 5 + tokens)
    ex.step(seed=1)  # the last attention layer's q, cache and output stay in the arenas
    pg, D, hdr = spec.paged_shape, spec.head_dim, prog.header
    layer = max(prog.buffers.kv_slot)
    cslot = kv_slot(layer, spec.attn_layers)
    kf, vf = (t.double().flatten().numpy() for t in (ex.k, ex.v))
    tf = table.flatten().numpy()

    def fetch(b: int, g: int, key: int) -> tuple[np.ndarray, np.ndarray]:  # Attention.attend
        col, o = table_entry(b, key, pg.block_size, pg.max_blocks)
        base = page_base(cslot, int(tf[col]), g, pg.num_blocks, spec.kv_heads, pg.page_elems)
        krow = kf[[k_elem(base, d, o, pg.block_size) for d in range(D)]]
        return krow, vf[v_elem(base, o, 0, D):][:D]

    nq = spec.rows * spec.heads * D
    q = ex.bf16[hdr["BF16_Q_OFF"]:][:nq].double().numpy()
    live_rows = [int(slots[b * spec.tokens] >= 0) for b in range(spec.batch)]
    got = _emulate_attention(spec, attn_scale(D), q, None, None, lengths.tolist(), cslot,
                             prog.n_splits, fetch=fetch, live=live_rows)
    want = ex.bf16[hdr["BF16_ATTN_OFF"]:][:nq].double().numpy().reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)
    pad = [n for n in range(spec.rows) if slots[n] < 0]
    assert (got[pad] == 0).all() and (want[pad] == 0).all()
    assert len(pad) == (spec.batch - live) * spec.tokens


def test_paged_build_constants_are_the_programs():
    """The build bakes in the pool and the i32 offsets of the block table and slot mapping: a
    program of that pool passes launch.checks.check_header; another pool or a contiguous program
    (and a paged program on a contiguous build) is refused by name."""
    from megakernel.launch.checks import ArgumentError, check_header

    cfg, gpu = preset("qwen3-tiny"), executor_gpu()
    pool = PagedKV(num_blocks=20, block_size=8, max_blocks=5)
    paged = make_spec(cfg, 3, 2, "sm_100a", paged=pool).to_dict()
    flat = make_spec(cfg, 3, 2, "sm_100a").to_dict()
    check_header(compile_program(cfg, 3, gpu, tokens=2, paged=pool).header, paged)
    check_header(compile_program(cfg, 3, gpu, tokens=2).header, flat)
    other = PagedKV(num_blocks=21, block_size=8, max_blocks=5)
    for header, spec, what in (
            (compile_program(cfg, 3, gpu, tokens=2, paged=other).header, paged, "PAGE_BLOCKS"),
            (compile_program(cfg, 3, gpu, tokens=2).header, paged, "PAGED"),
            (compile_program(cfg, 3, gpu, tokens=2, paged=pool).header, flat, "PAGED")):
        with pytest.raises(ArgumentError, match=what):
            check_header(header, spec)
