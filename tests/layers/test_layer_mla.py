"""megakernel/layers/mla.py: multi-head latent attention (Kimi Linear `full_attention`) with the
latent cache.

What only MLA does: the refusal of a low-rank query, packing (proj = [q_proj |
kv_a_proj_with_mqa] zero-padded to 16 rows; lat_norm and kv_b at the arena head) and the
stages' operands (one record per (sequence, head)). What every kind answers for (refusals, the
latent cache k = c [B, 1, S, r], v = k_rope [B, 1, S, dr], buffers, records, bytes, executor):
test_layers_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.layers.mla import MLAConfig
from megakernel.models import Block, ConfigError, ModelConfig
from tests.layers.helpers import blocks_of, build_context, cases, pack_tagged

MLA = kind("mla")


def test_a_low_rank_query_is_refused() -> None:
    cfg, blk = blocks_of("mla")[0]
    m = blk.cfg
    lora = MLAConfig(m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
                     m.v_head_dim, q_lora_rank=24)
    low = Block(blk.layer, blk.name, "mla", lora, blk.prefix, blk.norm)
    assert {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"} <= set(
        MLA.shapes(low, cfg))
    with pytest.raises(ConfigError, match="q_lora_rank"):
        MLA.check(low, cfg)


@pytest.mark.parametrize(("cfg", "blk"), cases("mla"))
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    """proj = [q_proj | kv_a_proj_with_mqa], then zero rows; the latent norm, kv_b and o as
    they are."""
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


@pytest.mark.parametrize(("cfg", "blk"), cases("mla"))
def test_stages(cfg: ModelConfig, blk: Block) -> None:
    """PROJ in slabs of 16 rows, one MLA record per (sequence, head) naming the layer's weights
    and buffers, then o_proj."""
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
