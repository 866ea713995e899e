"""megakernel/layers/frame.py: the model's frame (embedding gather, final norm + LM head with a
partial argmax, the argmax merge) and the matvecs several kinds share (the residual projections
OPROJ / DOWN, the fused input projection PROJ).

Its opcodes, its buffers, the stage builders (embedding chunks of <= 32 KiB, residual and PROJ
slabs of 16 rows, the LM head padded to 16 rows), the records of compiled programs, and one
executor run with a vocabulary that is not a multiple of 16.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.executor import Executor
from megakernel.isa.records import FLAG_ADVANCE, FLAG_FEEDBACK
from megakernel.layers import frame
from megakernel.layers.base import OUTPUT, STREAM, StepShape
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights, weight_layout
from megakernel.reference.model import ReferenceModel
from tests.layers.helpers import (
    LOGIT_TOL,
    TINY,
    build_context,
    executor_vs_reference,
    gpu8,
    tiny_program,
)

FRAME_OPS = {"END": 0, "EMBED": 1, "OPROJ": 5, "DOWN": 7, "LMHEAD": 8, "ARGMAX": 9, "PROJ": 16,
             "ACCEPT": 35, "NGRAM": 36}


def test_frame_opcodes() -> None:
    ours = {s.name: s for s in isa.specs() if s.kind == "frame"}
    assert {n: s.code for n, s in ours.items()} == FRAME_OPS
    assert {n for n, s in ours.items() if s.slab} == {"OPROJ", "DOWN", "PROJ", "LMHEAD"}
    assert {n: s.matvec for n, s in ours.items() if s.matvec} == {
        "OPROJ": "epilogues.Residual", "DOWN": "epilogues.Residual", "PROJ": "epilogues.Proj",
        "LMHEAD": "epilogues.LMHead"}
    assert all(s.device for s in ours.values())  # PROJ too: the proj epilogue


def test_padding_helpers() -> None:
    assert [frame.padded_vocab(v) for v in (1, 16, 250, 256, 257)] == [16, 16, 256, 256, 272]
    assert [frame.round_rows(x) for x in (0, 1, 136, 144)] == [0, 16, 144, 144]


@pytest.mark.parametrize("name", TINY)
def test_needs_and_lm_head_layout(name: str) -> None:
    cfg = preset(name)
    got = {(nd.arena, nd.name): (nd.shape, nd.group, nd.persistent)
           for nd in frame.needs(cfg, StepShape(3, 2, 40, 2, 8, 0))}
    h, v = cfg.hidden_size, cfg.vocab_size
    assert got == {("f32", "h"): ((6, h), STREAM, False),
                   ("f32", "logits"): ((6, v), OUTPUT, False),
                   ("f32", "part_argmax"): ((8, 6, 2), OUTPUT, False),
                   ("i32", "tokens_in"): ((6,), STREAM, False),
                   ("i32", "tokens_out"): ((6,), STREAM, False),
                   ("i32", "lengths"): ((3,), STREAM, True)}
    lay = weight_layout(cfg.replace(vocab_size=250))
    assert lay.lm_head.shape == (256, h)  # padded with zero rows (the embedding when tied)


@pytest.mark.parametrize("batch", [1, 32, 40])
def test_embedding_chunks(batch: int) -> None:
    """EMBED in chunks of <= 32 KiB of gathered bf16 rows, covering the N rows once."""
    cfg = preset("llama-mid")  # hidden 1024: 16 rows per chunk
    ctx = build_context(cfg, batch=batch, max_seq_len=64)
    st, c = frame.embed_stage(ctx)
    assert st.op == isa.Op.EMBED and not st.divisible and c == ctx.ctr.ids["embed"]
    spans = []
    for u in range(st.units):
        ins = st.make(u, u + 1)
        d = ins.operands
        assert (d["N1"] - d["N0"]) * cfg.hidden_size * 2 <= 32 * 1024
        assert ins.hbm_bytes == (d["N1"] - d["N0"]) * cfg.hidden_size * 2
        assert d["W"] == ctx.lay["embed"].offset and d["K"] == cfg.hidden_size
        spans.append((d["N0"], d["N1"]))
    assert [n for lo, hi in spans for n in range(lo, hi)] == list(range(batch))
    assert st.units == -(-batch // 16)


def test_residual_and_proj_stages() -> None:
    """OPROJ / DOWN: a block's closing matrix [H, k] in slabs of 16 rows on a bf16 input, added
    into h; PROJ: RMSNorm(h) -> the packed projection, OUT_W its padded width."""
    cfg = preset("qwen3.5-tiny")
    ctx = build_context(cfg)
    attn = next(b for b in cfg.blocks if b.kind == "attention")
    st, c = frame.residual_stage(ctx, frame.OPROJ, attn, "o", 256, 1234, wait=7, counter="x")
    assert (st.op, st.units, st.unit_rows, st.divisible) == (isa.Op.OPROJ, 4, 16, True)
    ins = st.make(1, 3)
    d = ins.operands
    assert d["W"] == ctx.lay[f"{attn.key}.o"].offset + 16 * 256
    assert (d["ROW0"], d["NROWS"], d["K"], d["NORM_OFF"], d["IN_OFF"]) == (16, 32, 256, -1, 1234)
    assert d["OUT_OFF"] == ctx.buf.f32["h"].offset and ins.wait == 7 and ins.signal == c
    gdn = next(b for b in cfg.blocks if b.kind == "gdn")
    st, c = frame.proj_stage(ctx, gdn, 144, wait=3)
    assert (st.op, st.units) == (isa.Op.PROJ, 9)
    d = st.make(0, 9).operands
    assert (d["OUT_W"], d["NROWS"], d["NORM_OFF"]) == (144, 144, ctx.lay[f"{gdn.key}.norm"].offset)
    assert d["OUT_OFF"] == ctx.buf.f32["proj"].offset


@pytest.mark.parametrize("tokens", [1, 2])
def test_head_stages(tokens: int) -> None:
    """LMHEAD over the padded vocabulary in slabs of 16 rows, then one ARGMAX that advances the
    lengths and (T = 1) feeds the tokens back."""
    cfg = preset("nemotron-h-tiny").replace(vocab_size=250)
    ctx = build_context(cfg, tokens=tokens)
    (lm, am), end = frame.head_stages(ctx, wait=5)
    assert end == lm.make(0, 16).signal
    assert (lm.op, lm.units, lm.unit_rows) == (isa.Op.LMHEAD, 16, 16)
    d = lm.make(0, 16).operands
    assert (d["NROWS"], d["NORM_OFF"]) == (256, ctx.lay["final_norm"].offset)
    assert (am.op, am.units) == (isa.Op.ARGMAX, 1)
    flags = am.make(0, 1).operands["FLAGS"]
    assert flags == FLAG_ADVANCE | (FLAG_FEEDBACK if tokens == 1 else 0)


@pytest.mark.parametrize("name", ["llama-tiny", "kimi-linear-tiny"])
def test_frame_records(name: str) -> None:
    """In a compiled program: EMBED covers the rows once, the LM-head slabs get the slots 0 ..
    n-1 which ARGMAX merges; every residual matvec adds a bf16 input into h, every PROJ reads
    RMSNorm(h) into proj."""
    prog = tiny_program(name)
    hdr, f32 = prog.header, prog.buffers.f32
    lm = [i for i in prog.instrs if i.op == isa.Op.LMHEAD]
    assert sorted(i.operands["TILE"] for i in lm) == list(range(len(lm)))
    assert len(lm) == hdr["N_LM_TILES"] <= prog.num_sms
    (am,) = [i for i in prog.instrs if i.op == isa.Op.ARGMAX]
    assert am.operands["N_TILES"] == len(lm)
    for i in prog.instrs:
        if i.op in (isa.Op.OPROJ, isa.Op.DOWN):
            assert i.operands["NORM_OFF"] == -1 and i.operands["OUT_OFF"] == f32["h"].offset
        elif i.op == isa.Op.PROJ:
            assert i.operands["NORM_OFF"] >= 0 and i.operands["OUT_OFF"] == f32["proj"].offset
    assert sum(i.operands["N1"] - i.operands["N0"] for i in prog.instrs
               if i.op == isa.Op.EMBED) == prog.rows


def test_padded_vocabulary_rows_never_win_the_argmax() -> None:
    """The LM head's rows past V are padding: with them set to 100x the rows of the tokens the
    reference picks (so that their logits would win), the executor still picks the reference's
    tokens, and the logits of a one-block model match."""
    cfg = preset("nemotron-h-tiny").replace(layer_types=("mlp",), vocab_size=250)
    assert executor_vs_reference(cfg) <= LOGIT_TOL
    w = random_weights(cfg, seed=1)
    ref = ReferenceModel(cfg, w, mode="bf16")
    cache = ref.new_cache(2, 8)
    tok = ref.prefill(cache, [[1, 2], [3]]).argmax(-1)[:, None]
    want = ref.decode(cache.clone(), tok)[:, 0]
    best = want.argmax(-1)
    assert bool((want.amax(-1) > 0).all())  # so that 100x the winner's row would win
    prog = compile_program(cfg, 2, gpu8(), max_seq_len=8)
    packed = pack_weights(cfg, w)
    head = packed.view("lm_head")
    assert head.shape[0] == 256 and not bool(head[250:].any())
    head[250:252] = 100 * head[best]
    ex = Executor(prog, packed)
    ex.load_cache(cache)
    assert torch.equal(ex.step(tok)[:, 0], best)
    assert (ex.logits - want).abs().max().item() <= LOGIT_TOL
