"""megakernel/layers/moe.py: the mixture of experts with a shared expert (Kimi Linear).

What only the MoE does: packing (expert x: gate/up interleaved in blocks
of 16 from w1 / w3, down = w2; the shared expert last, as expert E), the header, the stages
(router, every expert's gate/up, every expert's down, combine; an expert matrix in at most 8
slabs), and the bytes of its experts (a routed expert's slabs weighted by the chance a row picks
it). What every kind answers for (the config's refusals, shapes with the router kept fp32,
the fp32 router row [W_r | bias], buffers, records, executor): test_layers_contract.py.
"""

from __future__ import annotations

import struct

import pytest
import torch

from megakernel import isa
from megakernel.isa.records import GATEUP_BLOCK
from megakernel.layers import kind
from megakernel.layers.moe import EXPERT_SLABS
from megakernel.models import Block, ModelConfig, preset
from megakernel.program.bytes import step_bytes_by_category
from tests.layers.helpers import (
    block_records,
    blocks_of,
    build_context,
    cases,
    interleaved,
    pack_tagged,
    tiny_program,
)

MOE = kind("moe")


def test_header() -> None:
    cfg, blk = blocks_of("moe")[0]
    e, hdr = blk.cfg, MOE.header(blk, cfg)
    scale = struct.unpack("<f", struct.pack("<i", hdr.pop("MOE_SCALE_F32_BITS")))[0]
    assert scale == struct.unpack("<f", struct.pack("<f", e.routed_scaling_factor))[0]
    assert hdr == dict(MOE_E=e.num_experts, MOE_TOPK=e.top_k, MOE_I=e.intermediate_size,
                       MOE_N_GROUP=e.n_group, MOE_TOPK_GROUP=e.topk_group, MOE_NORM=1,
                       MOE_SHARED=1)


@pytest.mark.parametrize(("cfg", "blk"), cases("moe"))
def test_pack_experts_then_the_shared_one(cfg: ModelConfig, blk: Block) -> None:
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


@pytest.mark.parametrize(("cfg", "blk"), cases("moe", variants=False))
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


def test_router_rows_and_expert_bytes() -> None:
    """In the compiled program: each block's router record reads its row of the router table;
    the shared expert's slabs are streamed in full, a routed expert's weighted by the chance
    that a row picks it."""
    prog = tiny_program("kimi-linear-tiny")
    router = prog.buffers.f32["router"]
    for row, blk in enumerate(b for b in prog.cfg.blocks if b.kind == "moe"):
        e, h = blk.cfg, prog.cfg.hidden_size
        (r,) = [d for d in block_records(prog, blk) if d["OPCODE"].name == "ROUTER"]
        assert r["ROUTER_OFF"] == router.offset + row * (e.num_experts * h + e.num_experts)
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
