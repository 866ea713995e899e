"""megakernel/layers/relu2.py: the relu^2 MLP (Nemotron-H `-` blocks), no gate.

Checkpoint shapes against the transformers modules, init roles, packing (up and down as they
are), the activation buffer, the stages, the records, the bytes, and one executor run of a model
whose only block is a relu^2 MLP.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.layers.base import SCRATCH, StepShape
from megakernel.layers.relu2 import Relu2Config
from megakernel.models import Block, ConfigError, ModelConfig, preset
from megakernel.program.verify import check_program
from tests.layers.helpers import (
    LOGIT_TOL,
    block_ids,
    block_records,
    blocks_of,
    build_context,
    check_flow,
    check_pack_keys,
    check_read_bytes,
    check_roles,
    check_slab_bytes,
    executor_vs_reference,
    hf_block_tensors,
    pack_tagged,
    tiny_program,
)

MLP = kind("relu2")
BLOCKS = blocks_of("relu2")
IDS = block_ids("relu2")


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    hf = hf_block_tensors(cfg, blk)
    assert MLP.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    check_roles(cfg, blk, {"up_proj.weight": "proj", "down_proj.weight": "out"})


def test_config_and_check_refuse_unsupported_sizes() -> None:
    with pytest.raises(ConfigError, match="intermediate_size"):
        Relu2Config(-16)
    cfg, blk = BLOCKS[0]
    with pytest.raises(ConfigError, match="multiple of 16"):
        MLP.check(Block(1, "mixer", "relu2", Relu2Config(24), blk.prefix, blk.norm), cfg)
    MLP.check(blk, cfg)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    check_pack_keys(blk, cfg)
    w, packed = pack_tagged(blk, cfg)
    assert torch.equal(packed["up"], w["up_proj.weight"])
    assert torch.equal(packed["down"], w["down_proj.weight"])
    assert MLP.tables(blk, cfg, w.__getitem__) == {}


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_buffers(cfg: ModelConfig, blk: Block) -> None:
    shape = StepShape(3, 2, 40, 2, 8, 0)
    (nd,) = MLP.needs(blk, cfg, shape)
    assert (nd.arena, nd.name, nd.shape, nd.group) == ("bf16", "act",
                                                       (6, blk.cfg.intermediate_size), SCRATCH)
    assert not MLP.kv_cache and not MLP.recurrent and MLP.state(blk, cfg, 3, 4) == []
    assert MLP.constants(blk, cfg, shape) == {}


def test_flow() -> None:
    check_flow("relu2", {"UP_RELU2": None, "DOWN": "UP_RELU2"}, "DOWN")


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_stages(cfg: ModelConfig, blk: Block) -> None:
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


def test_program() -> None:
    prog = tiny_program("nemotron-h-tiny")
    check_program(prog)
    blocks = [b for b in prog.cfg.blocks if b.kind == "relu2"]
    assert len(blocks) == 2
    for blk in blocks:
        assert {d["OPCODE"].name for d in block_records(prog, blk)} == set(MLP.flow)
        assert MLP.coverage(blk, prog) == {} and MLP.step_bytes(blk, prog) == {}
        check_slab_bytes(prog, blk)
        check_read_bytes(prog, blk)


def test_executor_matches_the_reference() -> None:
    cfg = preset("nemotron-h-tiny").replace(layer_types=("mlp",))
    assert [b.kind for b in cfg.blocks] == ["relu2"]
    assert executor_vs_reference(cfg) <= LOGIT_TOL
