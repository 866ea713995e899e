"""megakernel/layers/swiglu.py: the SwiGLU MLP (Llama, Qwen, Qwen3.5, Kimi's dense layers).

What only SwiGLU does: the interleaved gate/up packing (blocks of 16 gate rows, then the 16
matching up rows), the stages' operands (a gate/up slab is whole block pairs) and the header.
What every kind answers for (refusals of unsupported sizes among them):
test_layers_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.layers.swiglu import gateup_rows
from megakernel.models import Block, ModelConfig
from tests.layers.helpers import (
    block_records,
    build_context,
    cases,
    interleaved,
    pack_tagged,
    presets_with,
    tagged,
    tiny_program,
)

MLP = kind("swiglu")


def test_gateup_rows_of_three_blocks() -> None:
    w = tagged({"g": (48, 8), "u": (48, 8)})
    assert torch.equal(gateup_rows(w["g"], w["u"]), interleaved(w["g"], w["u"]))


@pytest.mark.parametrize(("cfg", "blk"), cases("swiglu"))
def test_pack_interleaves_gate_and_up_blocks(cfg: ModelConfig, blk: Block) -> None:
    w, packed = pack_tagged(blk, cfg)
    assert torch.equal(packed["gateup"], interleaved(w["gate_proj.weight"], w["up_proj.weight"]))
    assert torch.equal(packed["down"], w["down_proj.weight"])


@pytest.mark.parametrize(("cfg", "blk"), cases("swiglu"))
def test_stages(cfg: ModelConfig, blk: Block) -> None:
    """GATEUP in whole block pairs of 32 rows (gate and up, normed input), DOWN in rows of 16 on
    the activation; the header holds I."""
    ctx = build_context(cfg, batch=3)
    (gu, dn), end = MLP.stages(blk, ctx, wait=-1)
    i = blk.cfg.intermediate_size
    assert (gu.op, gu.units, gu.unit_rows, gu.divisible) == (isa.Op.GATEUP, i // 16, 32, True)
    assert (dn.op, dn.units, dn.unit_rows) == (isa.Op.DOWN, cfg.hidden_size // 16, 16)
    assert end == ctx.ctr.ids[f"L{blk.layer}.down"]
    ins = gu.make(1, 3)  # block pairs 1 and 2: gate/up rows 32 .. 95
    assert (ins.operands["ROW0"], ins.operands["NROWS"], ins.operands["K"]) == (32, 64,
                                                                                cfg.hidden_size)
    assert ins.operands["W"] == ctx.lay[f"{blk.key}.gateup"].offset + 32 * cfg.hidden_size
    assert ins.operands["NORM_OFF"] == ctx.lay[f"{blk.key}.norm"].offset
    d = dn.make(0, dn.units)
    assert (d.operands["K"], d.operands["IN_OFF"]) == (i, ctx.buf.bf16["act"].offset)
    assert MLP.header(blk, cfg) == {"I": i}


@pytest.mark.parametrize("name", presets_with("swiglu"))
def test_gateup_slabs_are_whole_block_pairs(name: str) -> None:
    """In a compiled program a gate/up slab is whole block pairs (its output columns ROW0/2 ..)."""
    prog = tiny_program(name)
    for blk in (b for b in prog.cfg.blocks if b.kind == "swiglu"):
        gateup = [d for d in block_records(prog, blk) if d["OPCODE"].name == "GATEUP"]
        assert gateup and all(d["ROW0"] % 32 == 0 and d["NROWS"] % 32 == 0 for d in gateup)
