"""megakernel/layers/moe.py: the mixture of experts with a shared expert (Kimi Linear).

What only the MoE does: packing (expert x: gate/up interleaved in blocks
of 16 from w1 / w3, down = w2; the shared expert last, as expert E), the header, the stages
(router logits over the experts, router, every work slot's gate/up and the shared expert's, the
same for down, combine; an expert matrix in at most 8 slabs), the work list, and the bytes of
its experts (the work slots' slabs weighted by the expected routed experts). What every kind
answers for (the config's refusals, shapes with the router kept fp32, the fp32 router row
[W_r | bias], buffers, records, executor): test_layers_contract.py.
"""

from __future__ import annotations

import struct

import pytest
import torch

from megakernel import isa
from megakernel.isa.records import GATEUP_BLOCK
from megakernel.layers import kind
from megakernel.layers.moe import EXPERT_SLABS, work_list
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
                       MOE_SHARED=1, MOE_X_STRIDE=3 * e.intermediate_size * cfg.hidden_size)


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
@pytest.mark.parametrize("batch", [1, 3])
def test_stages(cfg: ModelConfig, blk: Block, batch: int) -> None:
    """ROUTER_SCORE (a unit per expert, all reading the layer's router row), ROUTER (one
    instruction on the logits and the bias), then the gate/up of every work slot (min(E, N top_k)
    of them, at expert 0's matrix) and of the shared expert (slot -1, its own matrix), the same
    for down, then the combine; an expert matrix in at most EXPERT_SLABS slabs of whole block
    pairs / 16 rows."""
    e, h = blk.cfg, cfg.hidden_size
    ctx = build_context(cfg, batch=batch)
    stages, end = MOE.stages(blk, ctx, wait=-1)
    slots = min(e.num_experts, batch * e.top_k)
    bindings = [(w, 0) for w in range(slots)] + [(-1, e.num_experts)]
    assert [s.op for s in stages] == ([isa.Op.ROUTER_SCORE, isa.Op.ROUTER]
                                      + [isa.Op.EXPERT_GATEUP] * len(bindings)
                                      + [isa.Op.EXPERT_DOWN] * len(bindings)
                                      + [isa.Op.MOE_COMBINE])
    score, router, comb = stages[0], stages[1], stages[-1]
    assert (score.units, score.divisible) == (e.num_experts, True)
    reg = ctx.buf.f32["router"]
    row = reg.offset + ctx.buf.row("moe", blk.layer) * reg.shape[1]
    s = score.make(2, 5).operands
    assert (s["ROUTER_OFF"], s["E0"], s["NE"], s["K"]) == (row, 2, 3, h)
    assert s["OUT_OFF"] == ctx.buf.f32["moe_scores"].offset
    assert ctx.buf.f32["moe_scores"].shape == (batch, e.num_experts)
    assert router.units == 1 and not router.divisible
    r = router.make(0, 1).operands
    assert (r["SCORES_OFF"], r["BIAS_OFF"]) == (s["OUT_OFF"], row + e.num_experts * h)
    assert r["IDS_OFF"] == ctx.buf.i32["moe_ids"].offset
    assert (r["WORK_OFF"], r["SLOTS"]) == (ctx.buf.i32["moe_work"].offset, slots)
    assert ctx.buf.i32["moe_work"].shape == (slots, 2 + batch)
    n = len(bindings)
    for (w, x), gu, dn in zip(bindings, stages[2:2 + n], stages[2 + n:-1], strict=True):
        assert gu.units <= EXPERT_SLABS and gu.unit_rows % (2 * GATEUP_BLOCK) == 0
        assert gu.units * gu.unit_rows == 2 * e.intermediate_size
        assert dn.units <= EXPERT_SLABS and dn.unit_rows % 16 == 0
        assert dn.units * dn.unit_rows == h
        assert gu.make(0, 1).operands["SLOT"] == dn.make(0, 1).operands["SLOT"] == w
        assert gu.make(0, 1).operands["W"] == ctx.lay[f"{blk.key}.x{x}.gateup"].offset
        assert dn.make(0, 1).operands["W"] == ctx.lay[f"{blk.key}.x{x}.down"].offset
    assert (comb.units, comb.unit_rows) == (h // 16, 16)
    assert end == ctx.ctr.ids[f"L{blk.layer}.down"]


def test_expert_stride_is_the_packed_layout() -> None:
    """MOE_X_STRIDE (header) is the distance between consecutive experts' matrices in the arena,
    the shared expert included: what a bound slot adds to expert 0's slab address."""
    cfg, blk = blocks_of("moe")[0]
    lay = build_context(cfg).lay
    stride = MOE.header(blk, cfg)["MOE_X_STRIDE"]
    for m in ("gateup", "down"):
        offs = [lay[f"{blk.key}.x{x}.{m}"].offset for x in MOE.experts(blk.cfg)]
        assert {b - a for a, b in zip(offs, offs[1:], strict=False)} == {stride}


def test_expert_instructions_in_proportion_to_the_routed_experts() -> None:
    """At the published size (256 experts, top 8, I = 1024, H = 2304) and B = 1 a step has 8
    work slots plus the shared expert, each matrix cut into 8 slabs (not 257 experts' slabs);
    at B = 64 the slots are bounded by E."""
    cfg = preset("kimi-linear-48b-a3b")
    blk = next(b for b in cfg.blocks if b.kind == "moe")
    for batch, slots in ((1, 8), (64, 256)):
        stages, _ = MOE.stages(blk, build_context(cfg, batch=batch, max_seq_len=64), wait=-1)
        experts = [s for s in stages if s.op in (isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN)]
        assert len(experts) == 2 * (slots + 1)
        assert {(s.op, s.units, s.unit_rows) for s in experts} == {
            (isa.Op.EXPERT_GATEUP, 8, 256), (isa.Op.EXPERT_DOWN, 8, 288)}


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_router_rows_and_expert_bytes(batch: int) -> None:
    """In the compiled program: each block's router logits records read its row of the router
    table, each expert once;
    the shared expert's slabs are streamed in full, the work slots' together the expected
    routed experts' (E (1 - (1 - top_k / E)^N) of them under uniform routing)."""
    prog = tiny_program("kimi-linear-tiny", batch=batch)
    router = prog.buffers.f32["router"]
    for row, blk in enumerate(b for b in prog.cfg.blocks if b.kind == "moe"):
        e, h = blk.cfg, prog.cfg.hidden_size
        recs = [d for d in block_records(prog, blk) if d["OPCODE"].name == "ROUTER_SCORE"]
        assert {r["ROUTER_OFF"] for r in recs} == {router.offset
                                                  + row * (e.num_experts * h + e.num_experts)}
        assert sorted(x for r in recs for x in range(r["E0"], r["E0"] + r["NE"])) == list(
            range(e.num_experts))
        full = 2 * (2 * e.intermediate_size * h + h * e.intermediate_size)
        expected = e.num_experts * (1.0 - (1.0 - e.top_k / e.num_experts) ** prog.rows)
        slots = min(e.num_experts, prog.rows * e.top_k)

        def streamed(routed: bool, layer: int = blk.layer) -> int:
            return sum(i.w_bytes for i in prog.instrs if i.layer == layer
                       and i.op in (isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN)
                       and (i.operands["SLOT"] >= 0) == routed)

        assert streamed(False) == full
        assert streamed(True) == pytest.approx(full * expected, abs=16 * slots)
    experts = sum(i.w_bytes for i in prog.instrs if isa.spec(i.op).kind == "moe"
                  and isa.spec(i.op).slab)
    assert step_bytes_by_category(prog)["expert"] == experts > 0


def test_work_list() -> None:
    """The routed experts in increasing id, one slot each, with their (row, top-k slot) pairs
    p = n top_k + s in increasing p; slots past them [-1, 0, -1 ...]; an expert no row picks has
    no slot."""
    ids = torch.tensor([[5, 2, 7], [2, 0, 5]])  # N = 2, top_k = 3; experts 1, 3, 4, 6 unpicked
    got = work_list(ids, num_experts=8)
    assert got.dtype == torch.int32 and got.shape == (6, 4)  # min(8, 2 * 3) slots
    assert got.tolist() == [[0, 1, 4, -1], [2, 2, 1, 3], [5, 2, 0, 5], [7, 1, 2, -1],
                            [-1, 0, -1, -1], [-1, 0, -1, -1]]
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(64, generator=g)[:4] for _ in range(7)])  # N = 7, k = 4
    w = work_list(ids, 64)
    used = torch.unique(ids)
    assert w.shape == (28, 9) and torch.equal(w[: len(used), 0].long(), used)
    assert bool((w[len(used):, 0] == -1).all())
    for x, m, *pairs in w[: len(used)].tolist():
        assert pairs[:m] == sorted(pairs[:m]) and set(pairs[m:]) <= {-1}
        assert [int(ids.reshape(-1)[p]) for p in pairs[:m]] == [x] * m
    assert int(w[:, 1].sum()) == ids.numel()  # every (row, top-k slot) pair once


@pytest.mark.parametrize("batch", [1, 4])
def test_expert_streams_wait_only_for_the_binding(batch: int) -> None:
    """A routed slot's slabs (gate/up and down) stream once the layer's router has bound them,
    not after their own dependency (down: every gate/up record); the shared expert's binding is
    static and its stream waits for nothing. The kernel finds the same counter from the encoded
    record (moe_index.bind_counter: gate/up WAIT_CID, down WAIT_CID - 1)."""
    from megakernel.kernel.host.moe_index import bind_counter
    from megakernel.layers.moe import SHARED

    prog = tiny_program("kimi-linear-tiny", batch)
    router = {i.layer: i.signal for i in prog.instrs if i.op == isa.Op.ROUTER}
    experts = [i for i in prog.instrs if i.op in (isa.Op.EXPERT_GATEUP, isa.Op.EXPERT_DOWN)]
    assert experts
    for i in experts:
        if i.operands["SLOT"] == SHARED:
            assert i.stream_wait == isa.NO_COUNTER
        else:
            down = int(i.op == isa.Op.EXPERT_DOWN)
            assert i.stream_wait == router[i.layer] == bind_counter(down, i.wait)
            assert (i.wait != i.stream_wait) == bool(down)
