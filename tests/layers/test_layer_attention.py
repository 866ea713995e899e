"""megakernel/layers/attention.py: softmax attention over a KV cache (Llama, Qwen3 q/k norm, Qwen2
q/k/v biases, Qwen3.5 gated with partial RoPE, Nemotron-H without RoPE).

Checkpoint shapes against the transformers modules, init roles, the packed QKV row order (per kv
group: its q heads, their gate heads, k, v; biases in the same order), the buffers, the KV cache,
the RoPE tables, the stages and their records, `check_record`, `coverage` / `cover`, the bytes,
and one executor step per flavour against the bf16 reference.
"""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.layers import kind
from megakernel.layers.attention import AttentionConfig
from megakernel.layers.base import CONST, SCRATCH, StepShape
from megakernel.layers.swiglu import SwiGLUConfig
from megakernel.models import Block, ConfigError, ModelConfig, preset
from megakernel.program.buffers import plan_buffers
from megakernel.program.verify import ProgramError, check_program
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
    custom_model,
    executor_vs_reference,
    hf_block_tensors,
    pack_tagged,
    presets_with,
    tiny_program,
)

ATT = kind("attention")
BLOCKS = blocks_of("attention")
IDS = block_ids("attention")


def gated_biased() -> tuple[ModelConfig, Block]:
    """A model of one attention block with both an output gate and q/k/v biases (no preset has
    both), and a SwiGLU."""
    att = AttentionConfig(4, 2, 64, rotary_dim=32, qk_norm=True, output_gate=True, qkv_bias=True)
    blk = Block(0, "attn", "attention", att, "layers.0.attn.", "layers.0.attn_norm.weight")
    mlp = Block(0, "mlp", "swiglu", SwiGLUConfig(128), "layers.0.mlp.", "layers.0.mlp_norm.weight")
    return custom_model(blk, mlp), blk


ALL = BLOCKS + [gated_biased()]
ALL_IDS = IDS + ["gated-biased"]


# ---- checkpoint ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    hf = hf_block_tensors(cfg, blk)
    assert ATT.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}
    assert {n for n, (_, dt) in hf.items() if dt == torch.float32} <= set(ATT.fp32_params)


@pytest.mark.parametrize(("cfg", "blk"), ALL, ids=ALL_IDS)
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    c = blk.cfg
    expect = {"q_proj.weight": "qk_proj", "k_proj.weight": "qk_proj", "v_proj.weight": "proj",
              "o_proj.weight": "out"}
    if c.qk_norm:
        expect.update({"q_norm.weight": "qk_norm", "k_norm.weight": "qk_norm"})
    if c.qkv_bias:
        expect.update({f"{p}_proj.bias": "bias" for p in "qkv"})
    check_roles(cfg, blk, expect)


def test_config_and_check_refuse_unsupported_shapes() -> None:
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        AttentionConfig(6, 4, 64)
    with pytest.raises(ConfigError, match="rotary_dim"):
        AttentionConfig(4, 2, 64, rotary_dim=66)
    with pytest.raises(ConfigError, match="rotary_dim"):
        AttentionConfig(4, 2, 64, rotary_dim=15)
    cfg, blk = BLOCKS[0]
    bad = Block(0, "attn", "attention", AttentionConfig(4, 2, 96), blk.prefix, blk.norm)
    with pytest.raises(ConfigError, match="head_dim 96"):
        ATT.check(bad, cfg)
    ATT.check(blk, cfg)


# ---- packing -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "blk"), ALL, ids=ALL_IDS)
def test_pack_produces_the_declared_keys_and_shapes(cfg: ModelConfig, blk: Block) -> None:
    check_pack_keys(blk, cfg)
    bias = [m for m in ATT.matrices(blk, cfg) if m[0] == "qkv_bias"]
    assert bias == ([("qkv_bias", (blk.cfg.qkv_rows,), True)] if blk.cfg.qkv_bias else [])


@pytest.mark.parametrize(("cfg", "blk"), ALL, ids=ALL_IDS)
def test_qkv_rows_are_whole_heads_grouped_by_kv_head(cfg: ModelConfig, blk: Block) -> None:
    """Per kv group g: q heads gG .. gG+G-1, (their gate heads,) k_g, v_g, D rows each; a gated
    q_proj holds [q | gate] per head; the bias follows the same order."""
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
    if c.qkv_bias:
        assert torch.equal(packed["qkv_bias"], heads("bias"))
    if c.qk_norm:
        assert torch.equal(packed["qk_norm"], torch.stack((w["q_norm.weight"],
                                                           w["k_norm.weight"])))
    assert ATT.tables(blk, cfg, w.__getitem__) == {}


# ---- buffers -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "blk"), ALL, ids=ALL_IDS)
def test_needs(cfg: ModelConfig, blk: Block) -> None:
    c, shape = blk.cfg, StepShape(3, 2, 40, 5, 8, 0)
    n, hq, d = 6, c.num_heads, c.head_dim
    want = {("f32", "part_o"): ((5, n, hq, d), SCRATCH, False),
            ("f32", "part_ml"): ((5, n, hq, 2), SCRATCH, False),
            ("bf16", "q"): ((n, hq, d), SCRATCH, False),
            ("bf16", "attn"): ((n, hq * d), SCRATCH, False)}
    if c.output_gate:
        want["f32", "gate"] = ((n, hq, d), SCRATCH, False)
    if c.rotary_dim:
        want["f32", "rope"] = ((2, 40, c.rotary_dim // 2), CONST, True)
    got = {(nd.arena, nd.name): (nd.shape, nd.group, nd.const)
           for nd in ATT.needs(blk, cfg, shape)}
    assert got == want
    assert all(nd.table is None and not nd.persistent for nd in ATT.needs(blk, cfg, shape))


@pytest.mark.parametrize("name", presets_with("attention"))
def test_kv_cache_one_slot_per_attention_layer(name: str) -> None:
    cfg = preset(name)
    blk = next(b for b in cfg.blocks if b.kind == "attention")
    c = blk.cfg
    assert ATT.kv_cache and not ATT.recurrent
    assert ATT.kv(blk, cfg, 3, 40) == ((3, c.num_kv_heads, 40, c.head_dim),) * 2
    assert ATT.state(blk, cfg, 3, 5) == []
    buf = plan_buffers(cfg, StepShape(3, 1, 40, 2, 8, 0))
    layers = [b.layer for b in cfg.blocks if b.kind == "attention"]
    assert buf.kv_slot == {layer: i for i, layer in enumerate(layers)}
    assert buf.kv_shape == buf.v_shape == (len(layers), 3, c.num_kv_heads, 40, c.head_dim)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
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
    """transformers' cos, sin [S, R] of the model's rotary embedding."""
    import importlib

    import transformers

    fam = {"llama": ("llama", "Llama"), "qwen3": ("qwen3", "Qwen3"), "qwen2": ("qwen2", "Qwen2"),
           "qwen3_5": ("qwen3_5", "Qwen3_5Text")}[cfg.family]
    mod = importlib.import_module(f"transformers.models.{fam[0]}.modeling_{fam[0]}")
    conf_cls = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen2": "Qwen2Config",
                "qwen3_5": "Qwen3_5TextConfig"}[cfg.family]
    rot = getattr(mod, f"{fam[1]}RotaryEmbedding")(config=getattr(transformers, conf_cls)(
        **cfg.to_hf_dict()))
    cos, sin = rot(torch.zeros(1, s_max, 8), torch.arange(s_max)[None])
    return cos[0], sin[0]


# ---- program -------------------------------------------------------------------------------------
def test_flow_is_registered_to_attention_or_the_frame() -> None:
    check_flow("attention", {"QKV": None, "ATTN_PARTIAL": "QKV", "OPROJ": "ATTN_PARTIAL"},
               "OPROJ")
    assert isa.spec(isa.Op.ATTN_PARTIAL).ticket


@pytest.mark.parametrize(("cfg", "blk"), ALL, ids=ALL_IDS)
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
def test_program_verifies_and_covers_every_partial_once(name: str) -> None:
    prog = tiny_program(name)
    check_program(prog)
    assert prog.n_splits == 2 and prog.batch == 2
    for cfg, blk in BLOCKS:
        if cfg.name != name:
            continue
        assert {d["OPCODE"].name for d in block_records(prog, blk)} == set(ATT.flow)
        check_cover(prog, blk)
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


# ---- cost ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", presets_with("attention"))
def test_step_bytes(name: str) -> None:
    """kv_read: B x context positions of k and v (bf16); kv_written: N new positions; the same as
    the partials' prefetched bytes."""
    prog = tiny_program(name)
    for blk in prog.cfg.blocks:
        if blk.kind != "attention":
            continue
        c = blk.cfg
        row = c.num_kv_heads * c.head_dim * 2 * 2
        assert ATT.step_bytes(blk, prog) == {"kv_read": prog.batch * prog.context * row,
                                             "kv_written": prog.rows * row}
        check_read_bytes(prog, blk)


# ---- executor ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "changes", "tokens"), [
    ("qwen2-tiny", {"num_layers": 1}, 2),  # q/k/v biases, T = 2 causal among themselves
    ("qwen3.5-tiny", {"layer_types": ("attention",)}, 1),  # gate, partial RoPE, (1 + w) norms
    ("nemotron-h-tiny", {"layer_types": ("attention", "mlp")}, 1),  # no RoPE
    ("gated-biased", {}, 2),  # gate and biases together
], ids=["qwen2", "qwen3.5", "nemotron-h", "gated-biased"])
def test_executor_matches_the_reference(name: str, changes: dict, tokens: int) -> None:
    cfg = gated_biased()[0] if name == "gated-biased" else preset(name).replace(**changes)
    assert executor_vs_reference(cfg, tokens=tokens) <= LOGIT_TOL
