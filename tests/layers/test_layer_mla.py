"""megakernel/layers/mla.py: multi-head latent attention (Kimi Linear `full_attention`) with the
latent cache.

Checkpoint shapes against the transformers module, init roles, the refusal of a low-rank query,
packing (proj = [q_proj | kv_a_proj_with_mqa] zero-padded to 16 rows; lat_norm and kv_b at the
arena head), the buffers, the latent cache (k = c [B, 1, S, r], v = k_rope [B, 1, S, dr]), the
stages and records (one per (sequence, head)), the bytes, and one executor run.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.layers.base import SCRATCH, StepShape
from megakernel.layers.mla import MLAConfig
from megakernel.models import Block, ConfigError, ModelConfig, preset
from megakernel.program.buffers import plan_buffers
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
    check_slab_bytes,
    executor_vs_reference,
    hf_block_tensors,
    pack_tagged,
    tiny_program,
)

MLA = kind("mla")
BLOCKS = blocks_of("mla")
IDS = block_ids("mla")
NAME = "kimi-linear-tiny"


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    hf = hf_block_tensors(cfg, blk)
    assert MLA.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}
    assert {n for n, (_, dt) in hf.items() if dt == torch.float32} <= set(MLA.fp32_params)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    check_roles(cfg, blk, {"q_proj.weight": "proj", "kv_a_proj_with_mqa.weight": "proj",
                           "kv_a_layernorm.weight": "norm_plain", "kv_b_proj.weight": "proj",
                           "o_proj.weight": "out"})


def test_a_low_rank_query_is_refused() -> None:
    cfg, blk = BLOCKS[0]
    m = blk.cfg
    lora = MLAConfig(m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
                     m.v_head_dim, q_lora_rank=24)
    low = Block(blk.layer, blk.name, "mla", lora, blk.prefix, blk.norm)
    assert {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"} <= set(
        MLA.shapes(low, cfg))
    with pytest.raises(ConfigError, match="q_lora_rank"):
        MLA.check(low, cfg)
    with pytest.raises(ConfigError, match="q_lora_rank"):
        MLAConfig(4, 32, 16, 8, 16, q_lora_rank=0)
    MLA.check(blk, cfg)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    check_pack_keys(blk, cfg)
    m, (w, packed) = blk.cfg, pack_tagged(blk, cfg)
    rows = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.kv_lora_rank \
        + m.qk_rope_head_dim
    pad = -(-rows // 16) * 16 - rows
    assert pad > 0  # 136 rows -> 144
    assert torch.equal(packed["proj"], torch.cat((
        w["q_proj.weight"], w["kv_a_proj_with_mqa.weight"],
        torch.zeros(pad, cfg.hidden_size, dtype=torch.float64))))
    assert torch.equal(packed["lat_norm"], w["kv_a_layernorm.weight"])
    assert torch.equal(packed["kvb"], w["kv_b_proj.weight"])
    assert torch.equal(packed["o"], w["o_proj.weight"])
    assert [k for k, _ in MLA.vectors(blk, cfg)] == ["lat_norm", "kvb"]  # at the arena head
    assert MLA.tables(blk, cfg, w.__getitem__) == {}


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_buffers_and_latent_cache(cfg: ModelConfig, blk: Block) -> None:
    m, shape = blk.cfg, StepShape(3, 2, 40, 2, 8, 0)
    width = -(-MLA.proj_rows(m) // 16) * 16
    got = {(nd.arena, nd.name): (nd.shape, nd.group, nd.const, nd.persistent, nd.table)
           for nd in MLA.needs(blk, cfg, shape)}
    assert got == {("f32", "proj"): ((6, width), SCRATCH, False, False, None),
                   ("bf16", "attn"): ((6, m.num_heads * m.v_head_dim), SCRATCH, False, False,
                                      None)}
    assert MLA.kv_cache and not MLA.recurrent
    assert MLA.kv(blk, cfg, 3, 40) == ((3, 1, 40, m.kv_lora_rank), (3, 1, 40, m.qk_rope_head_dim))
    assert MLA.state(blk, cfg, 3, 5) == [] and MLA.constants(blk, cfg, shape) == {}
    buf = plan_buffers(cfg, shape)
    layers = [b.layer for b in cfg.blocks if b.kind == "mla"]
    assert buf.kv_slot == {layer: i for i, layer in enumerate(layers)}
    assert buf.kv_shape == (len(layers), 3, 1, 40, m.kv_lora_rank)
    assert buf.v_shape == (len(layers), 3, 1, 40, m.qk_rope_head_dim)


def test_flow() -> None:
    check_flow("mla", {"PROJ": None, "MLA": "PROJ", "OPROJ": "MLA"}, "OPROJ")


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_stages(cfg: ModelConfig, blk: Block) -> None:
    m = blk.cfg
    ctx = build_context(cfg, batch=3)
    (proj, att, o), end = MLA.stages(blk, ctx, wait=-1)
    width = -(-MLA.proj_rows(m) // 16) * 16
    assert (proj.op, proj.units) == (isa.Op.PROJ, width // 16)
    assert proj.make(0, 1).operands["OUT_W"] == width
    assert (att.op, att.units, att.divisible) == (isa.Op.MLA, 3 * m.num_heads, False)
    d = att.make(m.num_heads + 1, m.num_heads + 2).operands
    assert (d["B_IDX"], d["HEAD"]) == (1, 1)
    assert d["KVB_W"] == ctx.lay[f"{blk.key}.kvb"].offset
    assert d["NORM_W"] == ctx.lay[f"{blk.key}.lat_norm"].offset
    assert d["PROJ_OFF"] == ctx.buf.f32["proj"].offset
    assert d["OUT_OFF"] == ctx.buf.bf16["attn"].offset
    assert (o.op, o.make(0, 1).operands["K"]) == (isa.Op.OPROJ, m.num_heads * m.v_head_dim)
    assert end == ctx.ctr.ids[f"L{blk.layer}.oproj"]


def test_program_and_bytes() -> None:
    """Records verify, one MLA record per (sequence, head); weights: kv_b once per sequence;
    kv_read: the cached latents and k_rope (bf16) of every sequence; kv_written: N positions."""
    prog = tiny_program(NAME)
    check_program(prog)
    for blk in (b for b in prog.cfg.blocks if b.kind == "mla"):
        m = blk.cfg
        assert {d["OPCODE"].name for d in block_records(prog, blk)} == set(MLA.flow)
        assert MLA.coverage(blk, prog) == {"MLA": prog.batch * m.num_heads}
        check_cover(prog, blk)
        kvb = m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * 2
        row = (m.kv_lora_rank + m.qk_rope_head_dim) * 2
        assert MLA.step_bytes(blk, prog) == {"weights": prog.batch * kvb,
                                             "kv_read": prog.batch * prog.context * row,
                                             "kv_written": prog.rows * row}
        check_slab_bytes(prog, blk)
        check_read_bytes(prog, blk)


def test_executor_matches_the_reference() -> None:
    cfg = preset(NAME).replace(layer_types=("mla",))
    assert [b.kind for b in cfg.blocks] == ["mla", "swiglu"]
    assert executor_vs_reference(cfg, tokens=2) <= LOGIT_TOL
