"""megakernel/layers/mla.py: multi-head latent attention (Kimi Linear `full_attention`) with the
latent cache.

What only MLA does: the refusal of a low-rank query, packing (proj = [q_proj |
kv_a_proj_with_mqa] zero-padded to 16 rows; lat_norm and kv_b at the arena head), the stages'
operands (absorbed decode: MLA_Q per head, MLA per (sequence, split), MLA_O per head) and the
split rule's byte accounting (each cached latent read once per sequence). What every kind
answers for (refusals, the latent cache k = c [B, 1, S, r], v = k_rope [B, 1, S, dr], buffers,
records, bytes, executor): test_layers_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.layers.mla import MLAConfig, split_keys
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
    """PROJ in slabs of 16 rows; MLA_Q per head; MLA per (sequence, split) naming the layer's
    weights and buffers; MLA_O per head; then o_proj, each waiting on the stage before."""
    m = blk.cfg
    ctx = build_context(cfg, batch=3, n_splits=2)
    (proj, q, att, mo, o), end = MLA.stages(blk, ctx, wait=-1)
    width = -(-MLA.proj_rows(m) // 16) * 16
    assert (proj.op, proj.units) == (isa.Op.PROJ, width // 16)
    assert proj.make(0, 1).operands["OUT_W"] == width
    assert (q.op, q.units, mo.op, mo.units) == (isa.Op.MLA_Q, m.num_heads, isa.Op.MLA_O,
                                                m.num_heads)
    assert (att.op, att.units, att.divisible) == (isa.Op.MLA, 3 * 2, False)
    iq, ia, io = q.make(1, 2), att.make(3, 4), mo.make(1, 2)
    assert (iq.operands["HEAD"], io.operands["HEAD"]) == (1, 1)
    d = ia.operands
    assert (d["B_IDX"], d["SPLIT"], d["N_SPLITS"]) == (1, 1, 2)
    assert iq.operands["KVB_W"] == io.operands["KVB_W"] == ctx.lay[f"{blk.key}.kvb"].offset
    assert d["NORM_W"] == ctx.lay[f"{blk.key}.lat_norm"].offset
    assert d["PROJ_OFF"] == iq.operands["PROJ_OFF"] == ctx.buf.f32["proj"].offset
    assert d["QLAT_OFF"] == iq.operands["QLAT_OFF"] == ctx.buf.f32["qlat"].offset
    assert (d["PO_OFF"], d["PML_OFF"]) == (io.operands["PO_OFF"], io.operands["PML_OFF"])
    assert io.operands["OUT_OFF"] == ctx.buf.bf16["attn"].offset
    assert (iq.wait, ia.wait, io.wait) == (proj.make(0, 1).signal, iq.signal, ia.signal)
    assert (o.op, o.make(0, 1).operands["K"]) == (isa.Op.OPROJ, m.num_heads * m.v_head_dim)
    assert o.make(0, 1).wait == io.signal
    assert end == ctx.ctr.ids[f"L{blk.layer}.oproj"]


@pytest.mark.parametrize(("context", "tokens", "n_splits"), [(100, 1, 16), (7, 4, 3), (0, 2, 5),
                                                             (5, 1, 32)])
def test_splits_read_each_cached_latent_once(context: int, tokens: int, n_splits: int) -> None:
    """The splits' cached keys are exactly the context (the cache read once per sequence, not
    per head or split) and their new keys the step's tokens (each stored by one split)."""
    parts = [split_keys(s, n_splits, context, tokens) for s in range(n_splits)]
    assert sum(c for c, _ in parts) == context
    assert sum(n for _, n in parts) == tokens
