"""megakernel/layers/relu2.py: the relu^2 MLP (Nemotron-H `-` blocks), no gate.

What only relu^2 does: packing (up and down as they are) and the stages' operands. What every
kind answers for (refusals of unsupported sizes among them): test_layers_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.models import Block, ModelConfig
from tests.layers.helpers import build_context, cases, pack_tagged

MLP = kind("relu2")


@pytest.mark.parametrize(("cfg", "blk"), cases("relu2"))
def test_pack_keeps_up_and_down(cfg: ModelConfig, blk: Block) -> None:
    w, packed = pack_tagged(blk, cfg)
    assert torch.equal(packed["up"], w["up_proj.weight"])
    assert torch.equal(packed["down"], w["down_proj.weight"])


@pytest.mark.parametrize(("cfg", "blk"), cases("relu2"))
def test_stages(cfg: ModelConfig, blk: Block) -> None:
    """UP_RELU2 in rows of 16 into the activation, then DOWN over all of it."""
    ctx = build_context(cfg, batch=3)
    (up, dn), end = MLP.stages(blk, ctx, wait=-1)
    i = blk.cfg.intermediate_size
    assert (up.op, up.units, up.unit_rows, up.divisible) == (isa.Op.UP_RELU2, i // 16, 16, True)
    assert (dn.op, dn.units) == (isa.Op.DOWN, cfg.hidden_size // 16)
    assert end == ctx.ctr.ids[f"L{blk.layer}.down"]
    ins = up.make(2, 4)
    assert ins.operands["ROW0"] == 32 and ins.operands["NROWS"] == 32
    assert ins.operands["OUT_OFF"] == ctx.buf.bf16["act"].offset
    assert dn.make(0, 1).operands["K"] == i
