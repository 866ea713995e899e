"""The FP8 packed layout and packing (docs/FP8.md): entries, scale blocks, slabs, bytes."""

from __future__ import annotations

import pytest
import torch

from megakernel.kernel.host.arena import ALIGN
from megakernel.layers import kind
from megakernel.models import fp8, preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.pack import PackError, pack_weights, weight_layout
from tests.registries import model

TINY = ("llama-tiny", "qwen2-tiny", "qwen3.5-tiny", "nemotron-h-tiny", "kimi-linear-tiny",
        "smollm-shaped")


def _fp8(name: str, granularity: str = "channel", lm_head: bool = False):
    cfg = model(name).replace(quant=fp8.Fp8Format(granularity, lm_head=lm_head))
    q = fp8.QuantizedWeights(cfg, random_weights(model(name), seed=1))
    return cfg, {n: q[n] for n in q}


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_layout_places_scale_blocks_in_free_aligned_space(name, granularity):
    cfg = model(name).replace(quant=fp8.Fp8Format(granularity, lm_head=True))
    lay = weight_layout(cfg)
    spans = []
    for key, e in lay.entries.items():
        start = e.scale_offset if e.dtype == "fp8" else e.offset
        spans.append((start, e.offset + e.span, key))
        if e.dtype == "fp8":
            assert e.offset % ALIGN == 0 and e.scale_offset >= 0, key
            assert e.chunks == cfg.quant.chunks(e.shape[1]), key
    spans.sort()
    for (a0, a1, ka), (b0, _, kb) in zip(spans, spans[1:], strict=False):
        assert a1 <= b0, f"{ka} [{a0}, {a1}) overlaps {kb} from {b0}"
    assert spans[-1][1] <= lay.numel
    blocks = {f"{b.key}.{m[0]}" for b in cfg.blocks for m in kind(b.kind).matrices(b, cfg)
              if len(m[1]) == 2}
    head = set() if cfg.tie_word_embeddings else {"lm_head"}  # a tied head is the embedding
    assert {k for k, e in lay.entries.items() if e.dtype == "fp8"} == blocks | head
    assert lay["embed"].dtype == "bf16"


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_packed_slabs_are_the_dequantized_packed_matrices(name, granularity):
    """Every packed FP8 matrix read back (codes times their reversed-row scales) equals the bf16
    packing of the exactly dequantized weights, through fused, interleaved and padded rows, from
    any row of the matrix."""
    cfg, w = _fp8(name, granularity)
    packed = pack_weights(cfg, w)
    deq = fp8.dequantized(cfg, w)
    for blk in cfg.blocks:
        want = kind(blk.kind).pack(blk, cfg, lambda n, p=blk.prefix: deq[p + n].float())
        for suffix, shape, *_ in kind(blk.kind).matrices(blk, cfg):
            e = packed.layout[f"{blk.key}.{suffix}"]
            if e.dtype != "fp8":
                continue
            r, k = shape
            got, nbytes = packed.slab(e.w(0), 0, r, k)
            assert torch.equal(got, want[suffix].float()), f"{blk.key}.{suffix}"
            assert nbytes == r * k + 4 * r * e.chunks
            r0 = r // 2 // 16 * 16  # a slab from the middle
            part, _ = packed.slab(e.w(r0), r0, 16, k)
            assert torch.equal(part, want[suffix][r0 : r0 + 16].float())


def test_lm_head_stays_bf16_unless_asked():
    name = next(n for n in TINY if not model(n).tie_word_embeddings)
    cfg, w = _fp8(name)
    assert pack_weights(cfg, w).layout["lm_head"].dtype == "bf16"
    cfg, w = _fp8(name, lm_head=True)
    packed = pack_weights(cfg, w)
    e = packed.layout["lm_head"]
    assert e.dtype == "fp8"
    got, _ = packed.slab(e.w(0), 0, cfg.vocab_size, cfg.hidden_size)
    want = fp8.dequantized(cfg, w)[cfg.lm_head_name]
    assert torch.equal(got, want)


def test_a_source_left_unquantized_is_refused():
    cfg, w = _fp8("llama-tiny")
    name = "model.layers.0.mlp.up_proj.weight"
    w[name] = fp8.dequantize(w[name], w[name + "_scale"], cfg.quant).to(torch.bfloat16) * 1.001
    with pytest.raises(PackError, match="not e4m3 codes"):
        pack_weights(cfg, w)


@pytest.mark.parametrize("name", ["llama-tiny", "kimi-linear-tiny"])
def test_program_bytes_are_the_fp8_bytes(name):
    """Matvec records stream one byte per weight plus 4 per scale; the verifier accepts the
    program (slab rule by dtype, MoE experts at the FP8 stride)."""
    cfg = preset(name).replace(quant=fp8.Fp8Format("block"))
    prog = compile_program(cfg, 2, gpu("h100").with_sms(8), max_seq_len=32)
    from megakernel import isa
    from megakernel.program.verify import check_program

    check_program(prog)
    seen = 0
    for ins in prog.instrs:
        s = isa.spec(ins.op)
        if s.matvec is None:
            continue
        d = ins.operands
        e = prog.layout.entry_at(d["W"])
        per_row = 2 * d["K"] if e.dtype == "bf16" else d["K"] + 4 * cfg.quant.chunks(d["K"])
        if s.kind == "moe" and d["SLOT"] >= 0:  # a routed slot: bytes times P(bound)
            assert 0 < ins.w_bytes <= d["NROWS"] * per_row, s.name
        else:
            assert ins.w_bytes == d["NROWS"] * per_row, s.name
        assert ins.converted == (d["NROWS"] * d["K"] if e.dtype == "fp8" else 0)
        seen += e.dtype == "fp8"
    assert seen
