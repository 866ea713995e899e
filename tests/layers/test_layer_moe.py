"""megakernel/layers/moe.py: the mixture of experts with a shared expert (Kimi Linear).

Checkpoint shapes against the transformers module (per-expert tensors as save_pretrained writes
them; router weight and bias kept fp32), init roles, the config's refusals, packing (expert x:
gate/up interleaved in blocks of 16 from w1 / w3, down = w2; the shared expert last, as expert
E), the fp32 router row [W_r | bias], the buffers, the stages (router, every expert's gate/up,
every expert's down, combine), the records, the bytes, and one executor run.
"""

from __future__ import annotations

import struct

import pytest
import torch

from megakernel import isa
from megakernel.isa.records import GATEUP_BLOCK
from megakernel.layers import kind
from megakernel.layers.base import CONST, SCRATCH, StepShape
from megakernel.layers.moe import EXPERT_SLABS, MoEConfig
from megakernel.models import Block, ConfigError, ModelConfig, preset
from megakernel.program.bytes import step_bytes_by_category
from megakernel.program.verify import check_program
from tests.layers.helpers import (
    LOGIT_TOL,
    block_ids,
    block_records,
    blocks_of,
    build_context,
    check_cover,
    check_flow,
    check_pack_keys,
    check_read_bytes,
    check_roles,
    check_tables,
    executor_vs_reference,
    hf_block_tensors,
    pack_tagged,
    tiny_program,
)

MOE = kind("moe")
BLOCKS = blocks_of("moe")
IDS = block_ids("moe")
NAME = "kimi-linear-tiny"


def unshared() -> tuple[ModelConfig, Block]:
    cfg, blk = BLOCKS[0]
    e = blk.cfg
    c = MoEConfig(e.num_experts, e.top_k, e.intermediate_size, 0, e.routed_scaling_factor,
                  e.n_group, e.topk_group)
    return cfg, Block(blk.layer, blk.name, "moe", c, blk.prefix, blk.norm)


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Packed row r, j, i = divmod(r, 32): gate row 16 j + i for i < 16, else up row
    16 j + i - 16 (layers/swiglu.py)."""
    return torch.stack([gate[GATEUP_BLOCK * j + i] if i < GATEUP_BLOCK
                        else up[GATEUP_BLOCK * j + i - GATEUP_BLOCK]
                        for j, i in (divmod(r, 2 * GATEUP_BLOCK)
                                     for r in range(2 * gate.shape[0]))])


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    """transformers keeps the router weight and its bias in fp32: so does the kind."""
    hf = hf_block_tensors(cfg, blk)
    assert MOE.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}
    hf32 = {n for n, (_, dt) in hf.items() if dt == torch.float32}
    assert hf32 == set(MOE.fp32_params) == {"gate.weight", "gate.e_score_correction_bias"}


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    expect = {"gate.weight": "proj", "gate.e_score_correction_bias": "bias",
              "shared_experts.gate_proj.weight": "proj", "shared_experts.up_proj.weight": "proj",
              "shared_experts.down_proj.weight": "out"}
    for x in range(blk.cfg.num_experts):
        expect.update({f"experts.{x}.w1.weight": "proj", f"experts.{x}.w3.weight": "proj",
                       f"experts.{x}.w2.weight": "out"})
    check_roles(cfg, blk, expect)


def test_config_and_check_refuse_unsupported_routing() -> None:
    for args, kw, needle in [((7, 2, 32), {"n_group": 2}, "multiple of n_group"),
                             ((4, 1, 32), {"n_group": 4}, "at least 2 experts per group"),
                             ((8, 2, 32), {"n_group": 2, "topk_group": 3}, "topk_group"),
                             ((8, 5, 32), {"n_group": 2, "topk_group": 1}, "exceeds"),
                             ((8, 2, 32), {"num_shared_experts": -1}, "num_shared_experts")]:
        with pytest.raises(ConfigError, match=needle):
            MoEConfig(*args, **kw)
    cfg, blk = BLOCKS[0]
    with pytest.raises(ConfigError, match="at most one"):
        MOE.check(Block(1, "ffn", "moe", MoEConfig(8, 2, 32, 2), blk.prefix, blk.norm), cfg)
    with pytest.raises(ConfigError, match="multiple of 16"):
        MOE.check(Block(1, "ffn", "moe", MoEConfig(8, 2, 40), blk.prefix, blk.norm), cfg)
    MOE.check(blk, cfg)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS + [unshared()], ids=IDS + ["unshared"])
def test_pack_experts_then_the_shared_one(cfg: ModelConfig, blk: Block) -> None:
    check_pack_keys(blk, cfg)
    e, (w, packed) = blk.cfg, pack_tagged(blk, cfg)
    n = e.num_experts
    assert list(MOE.experts(e)) == list(range(n + (1 if e.num_shared_experts else 0)))
    assert e.slots == e.top_k + (1 if e.num_shared_experts else 0)
    for x in range(n):
        assert torch.equal(packed[f"x{x}.gateup"], interleaved(w[f"experts.{x}.w1.weight"],
                                                               w[f"experts.{x}.w3.weight"]))
        assert torch.equal(packed[f"x{x}.down"], w[f"experts.{x}.w2.weight"])
    if e.num_shared_experts:
        s = "shared_experts."
        assert torch.equal(packed[f"x{n}.gateup"], interleaved(w[s + "gate_proj.weight"],
                                                               w[s + "up_proj.weight"]))
        assert torch.equal(packed[f"x{n}.down"], w[s + "down_proj.weight"])
    else:
        assert f"x{n}.gateup" not in packed
    assert MOE.vectors(blk, cfg) == []


def test_router_table_is_fp32_weight_then_bias() -> None:
    check_tables(NAME, "moe", "router", ["gate.weight", "gate.e_score_correction_bias"])


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS + [unshared()], ids=IDS + ["unshared"])
def test_buffers(cfg: ModelConfig, blk: Block) -> None:
    e, h, n = blk.cfg, cfg.hidden_size, 6
    got = {(nd.arena, nd.name): (nd.shape, nd.group, nd.const, nd.persistent, nd.table)
           for nd in MOE.needs(blk, cfg, StepShape(3, 2, 40, 2, 8, 0))}
    assert got == {
        ("f32", "router"): ((e.num_experts * h + e.num_experts,), CONST, True, False, "moe"),
        ("f32", "moe_w"): ((n, e.top_k), SCRATCH, False, False, None),
        ("f32", "moe_y"): ((n, e.slots, h), SCRATCH, False, False, None),
        ("bf16", "act_moe"): ((n, e.slots, e.intermediate_size), SCRATCH, False, False, None),
        ("i32", "moe_ids"): ((n, e.top_k), SCRATCH, False, False, None)}
    assert not MOE.kv_cache and not MOE.recurrent and MOE.state(blk, cfg, 3, 4) == []


def test_flow_and_header() -> None:
    check_flow("moe", {"ROUTER": None, "EXPERT_GATEUP": "ROUTER",
                       "EXPERT_DOWN": "EXPERT_GATEUP", "MOE_COMBINE": "EXPERT_DOWN"},
               "MOE_COMBINE")
    cfg, blk = BLOCKS[0]
    e, hdr = blk.cfg, MOE.header(blk, cfg)
    scale = struct.unpack("<f", struct.pack("<i", hdr.pop("MOE_SCALE_F32_BITS")))[0]
    assert scale == struct.unpack("<f", struct.pack("<f", e.routed_scaling_factor))[0]
    assert hdr == dict(MOE_E=e.num_experts, MOE_TOPK=e.top_k, MOE_I=e.intermediate_size,
                       MOE_N_GROUP=e.n_group, MOE_TOPK_GROUP=e.topk_group, MOE_NORM=1,
                       MOE_SHARED=1)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_stages(cfg: ModelConfig, blk: Block) -> None:
    """ROUTER, then every expert's gate/up (the shared one last), every expert's down, then the
    combine; an expert matrix in at most EXPERT_SLABS slabs of whole block pairs / 16 rows."""
    e, h = blk.cfg, cfg.hidden_size
    ctx = build_context(cfg, batch=3)
    stages, end = MOE.stages(blk, ctx, wait=-1)
    xs = list(MOE.experts(e))
    assert [s.op for s in stages] == ([isa.Op.ROUTER] + [isa.Op.EXPERT_GATEUP] * len(xs)
                                      + [isa.Op.EXPERT_DOWN] * len(xs) + [isa.Op.MOE_COMBINE])
    router, comb = stages[0], stages[-1]
    assert router.units == 1 and not router.divisible
    r = router.make(0, 1).operands
    reg = ctx.buf.f32["router"]
    assert r["ROUTER_OFF"] == reg.offset + ctx.buf.row("moe", blk.layer) * reg.shape[1]
    assert r["IDS_OFF"] == ctx.buf.i32["moe_ids"].offset
    for x, gu, dn in zip(xs, stages[1:1 + len(xs)], stages[1 + len(xs):-1], strict=True):
        assert gu.units <= EXPERT_SLABS and gu.unit_rows % (2 * GATEUP_BLOCK) == 0
        assert gu.units * gu.unit_rows == 2 * e.intermediate_size
        assert dn.units <= EXPERT_SLABS and dn.unit_rows % 16 == 0
        assert dn.units * dn.unit_rows == h
        assert gu.make(0, 1).operands["EXPERT"] == dn.make(0, 1).operands["EXPERT"] == x
        assert gu.make(0, 1).operands["W"] == ctx.lay[f"{blk.key}.x{x}.gateup"].offset
    assert (comb.units, comb.unit_rows) == (h // 16, 16)
    assert end == ctx.ctr.ids[f"L{blk.layer}.down"]


def test_expert_matrices_are_cut_into_at_most_8_slabs() -> None:
    """At the published size (256 experts, I = 1024, H = 2304) an expert's gate/up is 64 block
    pairs and its down 144 row groups: each is cut into 8 slabs, not one per SM."""
    cfg = preset("kimi-linear-48b-a3b")
    blk = next(b for b in cfg.blocks if b.kind == "moe")
    stages, _ = MOE.stages(blk, build_context(cfg, batch=1, max_seq_len=64), wait=-1)
    experts = [s for s in stages if s.op in (isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN)]
    assert len(experts) == 2 * 257
    assert {(s.op, s.units, s.unit_rows) for s in experts} == {
        (isa.Op.EXPERT_GATEUP, 8, 256), (isa.Op.EXPERT_DOWN, 8, 288)}


def test_program_and_bytes() -> None:
    """Records verify; the router runs once, the combine covers every column of h once; the
    shared expert's slabs are streamed in full, a routed expert's weighted by the chance that a
    row picks it; the router's fp32 table is the kind's own weight bytes."""
    prog = tiny_program(NAME)
    check_program(prog)
    blocks = [b for b in prog.cfg.blocks if b.kind == "moe"]
    assert len(blocks) == 2
    router = prog.buffers.f32["router"]
    for row, blk in enumerate(blocks):
        e, h = blk.cfg, prog.cfg.hidden_size
        recs = block_records(prog, blk)
        assert {d["OPCODE"].name for d in recs} == set(MOE.flow)
        (r,) = [d for d in recs if d["OPCODE"].name == "ROUTER"]
        assert r["ROUTER_OFF"] == router.offset + row * (e.num_experts * h + e.num_experts)
        assert MOE.coverage(blk, prog) == {"ROUTER": 1, "MOE_COMBINE": h}
        check_cover(prog, blk)
        assert MOE.step_bytes(blk, prog) == {"weights": (e.num_experts * h + e.num_experts) * 4}
        check_read_bytes(prog, blk)
        full = 2 * (2 * e.intermediate_size * h + h * e.intermediate_size)
        p_used = 1.0 - (1.0 - e.top_k / e.num_experts) ** prog.rows
        for x in MOE.experts(e):
            got = sum(i.w_bytes for i in prog.instrs if i.layer == blk.layer
                      and i.op in (isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN)
                      and i.operands["EXPERT"] == x)
            share = 1.0 if x == e.num_experts else p_used
            assert got == pytest.approx(full * share, abs=16), x
    experts = sum(i.w_bytes for i in prog.instrs if isa.spec(i.op).kind == "moe"
                  and isa.spec(i.op).slab)
    assert step_bytes_by_category(prog)["expert"] == experts > 0


def test_executor_matches_the_reference() -> None:
    cfg = preset(NAME).replace(layer_types=("mla",), first_k_dense=0)
    assert [b.kind for b in cfg.blocks] == ["mla", "moe"]
    assert executor_vs_reference(cfg, tokens=2) <= LOGIT_TOL
