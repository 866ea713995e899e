"""megakernel/layers/attention.py: softmax attention over a KV cache (Llama, Qwen3 q/k norm, Qwen2
q/k/v biases, Qwen3.5 gated with partial RoPE, Nemotron-H without RoPE).

What only attention does: the packed QKV row order (per kv group: its q heads, their gate
heads, k, v; biases in the same order), the RoPE tables, the stages' operands, the header, and
`check_record`. What every kind answers for (shapes, roles, refusals, keys, buffers, the KV
cache, flow, records, bytes, executor): test_layers_contract.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.layers.base import StepShape
from megakernel.models import Block, ModelConfig
from megakernel.program.verify import ProgramError, check_program
from tests.layers.helpers import (
    block_records,
    blocks_of,
    build_context,
    cases,
    hf_classes,
    pack_tagged,
    presets_with,
    tiny_program,
)

ATT = kind("attention")


# ---- packing -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "blk"), cases("attention"))
def test_qkv_rows_are_whole_heads_grouped_by_kv_head(cfg: ModelConfig, blk: Block) -> None:
    """Per kv group g: q heads gG .. gG+G-1, (their gate heads,) k_g, v_g, D rows each; a gated
    q_proj holds [q | gate] per head; the bias follows the same order, as the matrix entry after
    qkv."""
    c, (w, packed) = blk.cfg, pack_tagged(blk, cfg)
    d, g_size = c.head_dim, c.group_size
    per_head = 2 if c.output_gate else 1  # q_proj rows per head: [q | gate]

    def heads(ext: str) -> torch.Tensor:
        """The packed rows of q_proj, k_proj, v_proj `.{ext}`, head by head."""
        q, k, v = (w[f"{p}_proj.{ext}"] for p in "qkv")
        out = []
        for g in range(c.num_kv_heads):
            group = range(g * g_size, (g + 1) * g_size)
            out += [q[h * per_head * d:][:d] for h in group]  # the q heads
            if c.output_gate:
                out += [q[h * per_head * d + d:][:d] for h in group]  # their gate heads
            out += [k[g * d:][:d], v[g * d:][:d]]
        return torch.cat(out)

    assert torch.equal(packed["qkv"], heads("weight"))
    assert packed["qkv"].shape[0] == c.qkv_rows == c.num_kv_heads * c.slots * d
    assert torch.equal(packed["o"], w["o_proj.weight"])
    bias = [m for m in ATT.matrices(blk, cfg) if m[0] == "qkv_bias"]
    assert bias == ([("qkv_bias", (c.qkv_rows,), True)] if c.qkv_bias else [])
    if c.qkv_bias:
        assert torch.equal(packed["qkv_bias"], heads("bias"))
    if c.qk_norm:
        assert torch.equal(packed["qk_norm"], torch.stack((w["q_norm.weight"],
                                                           w["k_norm.weight"])))


# ---- RoPE ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "blk"), cases("attention", variants=False))
def test_rope_tables_follow_the_float64_recipe(cfg: ModelConfig, blk: Block) -> None:
    """cos / sin [2, S, R/2] in fp32 from float64 angles; R = rotary_dim (partial in Qwen3.5);
    no table without RoPE (Nemotron-H). Also within fp32 rounding of transformers' tables."""
    c, s_max = blk.cfg, 48
    got = ATT.constants(blk, cfg, StepShape(1, 1, s_max, 1, 8, 0))
    if not c.rotary_dim:
        assert got == {}
        return
    r = c.rotary_dim
    assert r == (c.head_dim if cfg.family != "qwen3_5" else c.head_dim // 4)
    if c.rope.rope_type == "default":
        inv = 1.0 / c.rope.theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    else:
        inv = torch.tensor(c.rope.inv_freq(r), dtype=torch.float64)  # llama3 (test_models_config)
    ang = torch.arange(s_max, dtype=torch.float64)[:, None] * inv
    want = torch.stack((ang.cos(), ang.sin())).to(torch.float32)
    rope = got["rope"]
    assert rope.dtype == torch.float32 and rope.shape == (2, s_max, r // 2)
    assert torch.equal(rope, want)
    cos, sin = hf_rope(cfg, s_max)
    assert cos.shape[-1] == r
    torch.testing.assert_close(rope[0], cos[:, : r // 2], rtol=0, atol=2e-5)
    torch.testing.assert_close(rope[1], sin[:, : r // 2], rtol=0, atol=2e-5)
    torch.testing.assert_close(rope[0], cos[:, r // 2:], rtol=0, atol=2e-5)  # rotate-half


def hf_rope(cfg: ModelConfig, s_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos, sin [S, R] of the model's rotary embedding (<Config name>RotaryEmbedding
    of the model class's module)."""
    cfg_cls, model_cls = hf_classes(cfg.family)
    mod = importlib.import_module(model_cls.__module__)
    rot_cls = getattr(mod, cfg_cls.__name__.removesuffix("Config") + "RotaryEmbedding")
    rot = rot_cls(config=cfg_cls(**cfg.to_hf_dict()))
    cos, sin = rot(torch.zeros(1, s_max, 8), torch.arange(s_max)[None])
    return cos[0], sin[0]


# ---- program -------------------------------------------------------------------------------------
def test_partials_take_tickets() -> None:
    assert isa.spec(isa.Op.ATTN_PARTIAL).ticket


@pytest.mark.parametrize(("cfg", "blk"), cases("attention"))
def test_stages(cfg: ModelConfig, blk: Block) -> None:
    """QKV in whole heads (a slab never leaves its kv group), a partial per (sequence, kv head,
    split), o_proj in rows of 16."""
    c = blk.cfg
    ctx = build_context(cfg, batch=3, n_splits=2)
    stages, end = ATT.stages(blk, ctx, wait=-1)
    assert [s.op for s in stages] == [isa.Op.QKV, isa.Op.ATTN_PARTIAL, isa.Op.OPROJ]
    qkv, part, o = stages
    assert qkv.units == c.num_kv_heads * c.slots and not qkv.divisible
    assert part.units == 3 * c.num_kv_heads * 2 and o.units == cfg.hidden_size // 16
    assert end == ctx.ctr.ids[f"L{blk.layer}.oproj"]
    ins = qkv.make(0, c.slots)  # one whole group
    assert ins.operands["ROW0"] == 0 and ins.operands["NROWS"] == c.slots * c.head_dim
    assert ins.operands["ROPE_OFF"] == (ctx.buf.f32["rope"].offset if c.rotary_dim else -1)
    assert (ins.operands["QK_NORM_OFF"] >= 0) == c.qk_norm
    if c.num_kv_heads > 1:
        with pytest.raises(AssertionError, match="one kv group"):
            qkv.make(c.slots - 1, c.slots + 1)


@pytest.mark.parametrize("name", presets_with("attention"))
def test_header(name: str) -> None:
    """The program's header holds each attention config's QKV slots and rows."""
    prog = tiny_program(name)
    assert prog.n_splits == 2 and prog.batch == 2
    for cfg, blk in blocks_of("attention"):
        if cfg.name != name:
            continue
        hdr = ATT.header(blk, cfg)
        assert {k: prog.header[k] for k in hdr} == hdr
        assert hdr["QKV_SLOTS"] == blk.cfg.slots and hdr["QKV_ROWS"] == blk.cfg.qkv_rows


def test_check_record_refuses_a_qkv_slab_across_kv_groups() -> None:
    prog = tiny_program("llama-tiny")
    blk = prog.cfg.blocks[0]
    c = blk.cfg
    d = next(r for r in block_records(prog, blk) if r["OPCODE"].name == "QKV")
    ATT.check_record(d, blk, prog, "here")  # as compiled: fine
    group = c.slots * c.head_dim
    with pytest.raises(ProgramError, match="here: QKV slab crosses kv groups"):
        ATT.check_record({**d, "ROW0": group - c.head_dim, "NROWS": 2 * c.head_dim}, blk, prog,
                         "here")
    with pytest.raises(ProgramError, match="crosses kv groups"):
        ATT.check_record({**d, "ROW0": 0, "NROWS": 2 * group}, blk, prog, "here")
    with pytest.raises(ProgramError, match="not whole heads"):
        ATT.check_record({**d, "ROW0": 16, "NROWS": c.head_dim}, blk, prog, "here")
    ATT.check_record({**d, "ROW0": group, "NROWS": group}, blk, prog, "here")  # group 1
    part = next(r for r in block_records(prog, blk) if r["OPCODE"].name == "ATTN_PARTIAL")
    ATT.check_record({**part, "ROW0": 16, "NROWS": 1}, blk, prog, "here")  # not a QKV record
    # and the verifier asks the kind: a group-0 slab stretched into group 1 is refused by name
    rec = prog.records().clone()
    s, p = next((s, p) for s, q in enumerate(rec.tolist()) for p, r in enumerate(q)
                if r[0] == isa.Op.QKV and r[5] == blk.layer and isa.decode(r)["ROW0"] < group)
    row0 = int(rec[s, p, isa.field_index(isa.Op.QKV, "ROW0")])
    rec[s, p, isa.field_index(isa.Op.QKV, "NROWS")] = group - row0 + c.head_dim
    with pytest.raises(ProgramError, match="QKV slab crosses kv groups"):
        check_program(prog, rec)
