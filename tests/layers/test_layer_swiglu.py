"""megakernel/layers/swiglu.py: the SwiGLU MLP (Llama, Qwen, Qwen3.5, Kimi's dense layers).

Checkpoint shapes against the transformers modules, init roles, the interleaved gate/up packing
(blocks of 16 gate rows, then the 16 matching up rows), the activation buffer, the stages (a
gate/up slab is whole block pairs), the records, the bytes, and one executor run.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.isa.records import GATEUP_BLOCK
from megakernel.layers import kind
from megakernel.layers.base import SCRATCH, StepShape
from megakernel.layers.swiglu import SwiGLUConfig, gateup_rows
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
    presets_with,
    tagged,
    tiny_program,
)

MLP = kind("swiglu")
BLOCKS = blocks_of("swiglu")
IDS = block_ids("swiglu")


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The documented order, row by row: packed row r is, with j, i = divmod(r, 32), gate row
    16 j + i for i < 16, else up row 16 j + i - 16."""
    rows = []
    for r in range(2 * gate.shape[0]):
        j, i = divmod(r, 2 * GATEUP_BLOCK)
        rows.append(gate[GATEUP_BLOCK * j + i] if i < GATEUP_BLOCK
                    else up[GATEUP_BLOCK * j + i - GATEUP_BLOCK])
    return torch.stack(rows)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    hf = hf_block_tensors(cfg, blk)
    assert MLP.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    check_roles(cfg, blk, {"gate_proj.weight": "proj", "up_proj.weight": "proj",
                           "down_proj.weight": "out"})


def test_config_and_check_refuse_unsupported_sizes() -> None:
    with pytest.raises(ConfigError, match="intermediate_size"):
        SwiGLUConfig(0)
    cfg, blk = BLOCKS[0]
    with pytest.raises(ConfigError, match="multiple of 16"):
        MLP.check(Block(0, "mlp", "swiglu", SwiGLUConfig(40), blk.prefix, blk.norm), cfg)
    MLP.check(blk, cfg)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_pack_interleaves_gate_and_up_blocks(cfg: ModelConfig, blk: Block) -> None:
    check_pack_keys(blk, cfg)
    w, packed = pack_tagged(blk, cfg)
    assert torch.equal(packed["gateup"], interleaved(w["gate_proj.weight"], w["up_proj.weight"]))
    assert torch.equal(packed["down"], w["down_proj.weight"])
    assert MLP.vectors(blk, cfg) == [] and MLP.tables(blk, cfg, w.__getitem__) == {}


def test_gateup_rows_of_three_blocks() -> None:
    w = tagged({"g": (48, 8), "u": (48, 8)})
    assert torch.equal(gateup_rows(w["g"], w["u"]), interleaved(w["g"], w["u"]))


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_buffers(cfg: ModelConfig, blk: Block) -> None:
    (nd,) = MLP.needs(blk, cfg, StepShape(3, 2, 40, 2, 8, 0))
    assert (nd.arena, nd.name, nd.shape, nd.group) == ("bf16", "act",
                                                       (6, blk.cfg.intermediate_size), SCRATCH)
    assert not (nd.const or nd.persistent or nd.table)
    assert not MLP.kv_cache and not MLP.recurrent and MLP.state(blk, cfg, 3, 4) == []
    assert MLP.constants(blk, cfg, StepShape(3, 2, 40, 2, 8, 0)) == {}


def test_flow() -> None:
    check_flow("swiglu", {"GATEUP": None, "DOWN": "GATEUP"}, "DOWN")


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_stages(cfg: ModelConfig, blk: Block) -> None:
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
def test_program(name: str) -> None:
    """Records verify; a gate/up slab is whole block pairs (its output columns ROW0/2 ..); the
    matrices are streamed once; no other bytes."""
    prog = tiny_program(name)
    check_program(prog)
    for blk in prog.cfg.blocks:
        if blk.kind != "swiglu":
            continue
        recs = block_records(prog, blk)
        assert {d["OPCODE"].name for d in recs} == set(MLP.flow)
        for d in recs:
            if d["OPCODE"].name == "GATEUP":
                assert d["ROW0"] % 32 == 0 and d["NROWS"] % 32 == 0
        assert MLP.coverage(blk, prog) == {} and MLP.step_bytes(blk, prog) == {}
        check_slab_bytes(prog, blk)
        check_read_bytes(prog, blk)


def test_executor_matches_the_reference() -> None:
    assert executor_vs_reference(preset("llama-tiny").replace(num_layers=1)) <= LOGIT_TOL
