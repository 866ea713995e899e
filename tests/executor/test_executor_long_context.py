"""128K positions on every path of the program: a cut model (llama-tiny's shapes with Llama-3.2's
131072 positions) decodes one step on the CPU executor from a cache of 131071 and 65537 cached
tokens (random keys and values), against the bf16 reference on the same cache: the KV offsets
past 2^31 bytes' worth of rows per head, the split count and ranges at long context, the RoPE
table at the last positions and the merge."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel.executor import Executor
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.pack import pack_weights
from megakernel.reference.model import ReferenceModel

S_MAX = 131072
LENGTHS = [S_MAX - 1, 65537]


@pytest.mark.slow  # ~2 minutes: two sequences of 128K random keys through the executor
def test_a_cut_model_decodes_at_128k_positions() -> None:
    cfg = dataclasses.replace(preset("llama-tiny"), max_position_embeddings=S_MAX)
    w = random_weights(cfg, seed=5)
    g = torch.Generator().manual_seed(5)
    ref = ReferenceModel(cfg, w, mode="bf16")
    cache = ref.new_cache(len(LENGTHS), S_MAX, max_step_tokens=1)
    for c in cache.layers.values():
        for t in (c.k, c.v):
            for b, n in enumerate(LENGTHS):
                t[b, :, :n] = torch.randn(t[b, :, :n].shape, generator=g).to(t.dtype)
    cache.lengths[:] = torch.tensor(LENGTHS)
    prog = compile_program(cfg, len(LENGTHS), gpu("h100").with_sms(8), max_seq_len=S_MAX,
                           context=S_MAX - 1)
    assert prog.n_splits > 1
    ex = Executor(prog, pack_weights(cfg, w))
    ex.load_cache(cache)
    tokens = torch.randint(0, cfg.vocab_size, (len(LENGTHS), 1), generator=g)
    out = ex.step(tokens)
    want = ref.decode(cache, tokens)[:, -1]
    got = ex.logits.view(len(LENGTHS), -1)[:, : cfg.vocab_size]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) < 0.05 * scale
    assert ex.lengths.tolist() == [n + 1 for n in LENGTHS]
    clear = (want.topk(2).values[:, 0] - want.topk(2).values[:, 1]) > 0.05 * scale
    assert torch.equal(out[:, 0][clear], want.argmax(-1)[clear])
