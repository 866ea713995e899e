"""Weight packing: one arena, laid out by the layer kinds, for every family."""

from __future__ import annotations

import pytest
import torch

from megakernel import isa
from megakernel.isa import Op
from megakernel.kernel.host.arena import ALIGN
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from megakernel.program.pack import PackError, pack_weights, weight_layout

TOY = gpu("h100").with_sms(8)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_pack_layout_follows_the_tiling(name: str) -> None:
    cfg = preset(name)
    w = random_weights(cfg, seed=3)
    pw = pack_weights(cfg, w)
    lay = pw.layout
    assert all(e.offset % ALIGN == 0 for e in lay.entries.values())
    norms = [e.offset for k, e in lay.entries.items() if "norm" in k]
    assert max(norms) < lay["embed"].offset  # norms first: one-word offsets
    d, g, hkv = cfg.head_dim, cfg.group_size, cfg.num_kv_heads
    p = "model.layers.1."
    qkv = pw.view("L1.attn.qkv").view(hkv, g + 2, d, -1)
    q = w[p + "self_attn.q_proj.weight"].view(hkv, g, d, -1)
    assert torch.equal(qkv[:, :g], q)
    assert torch.equal(qkv[:, g], w[p + "self_attn.k_proj.weight"].view(hkv, d, -1))
    assert torch.equal(qkv[:, g + 1], w[p + "self_attn.v_proj.weight"].view(hkv, d, -1))
    gu = pw.view("L1.mlp.gateup").view(-1, 2, isa.GATEUP_BLOCK, cfg.hidden_size)
    assert torch.equal(gu[:, 0].reshape(-1, cfg.hidden_size), w[p + "mlp.gate_proj.weight"])
    assert torch.equal(gu[:, 1].reshape(-1, cfg.hidden_size), w[p + "mlp.up_proj.weight"])
    assert torch.equal(pw.view("L1.mlp.down"), w[p + "mlp.down_proj.weight"])
    if cfg.qk_norm:
        assert torch.equal(pw.view("L1.attn.qk_norm")[1], w[p + "self_attn.k_norm.weight"])
    assert ("lm_head" in lay.entries) == (not cfg.tie_word_embeddings)


def test_every_slab_is_one_contiguous_run() -> None:
    for name in ("qwen3-tiny", "nemotron-h-tiny"):
        prog = compile_program(preset(name), 2, TOY)
        lay = prog.layout
        spans = []
        for ins in prog.instrs:
            if isa.spec(ins.op).slab:
                o = ins.operands
                spans.append((o["W"], o["W"] + o["NROWS"] * o["K"]))
                assert o["W"] + o["NROWS"] * o["K"] <= lay.numel
        spans.sort()
        # slabs of different instructions never overlap (each weight row streamed once per step)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_gated_attention_packs_gate_heads_beside_their_queries() -> None:
    cfg = preset("qwen3.5-tiny")
    w = random_weights(cfg, seed=1)
    pw = pack_weights(cfg, w)
    a = cfg.attention
    d, g, hkv = a.head_dim, a.group_size, a.num_kv_heads
    layer = cfg.layer_types.index("attention")
    p = f"model.layers.{layer}.self_attn."
    qkv = pw.view(f"L{layer}.mixer.qkv").view(hkv, 2 * g + 2, d, -1)
    qg = w[p + "q_proj.weight"].view(hkv, g, 2, d, -1)  # [q | gate] per head
    assert torch.equal(qkv[:, :g], qg[:, :, 0])
    assert torch.equal(qkv[:, g : 2 * g], qg[:, :, 1])
    assert torch.equal(qkv[:, 2 * g], w[p + "k_proj.weight"].view(hkv, d, -1))


def test_qkv_bias_follows_its_matrix() -> None:
    """Qwen2: the packed bias [rows] sits directly after the packed QKV matrix (the kernel finds
    it from the slab's address), in the matrix's row order."""
    cfg = preset("qwen2-tiny")
    w = random_weights(cfg, seed=2)
    pw = pack_weights(cfg, w)
    m, b = pw.layout["L1.attn.qkv"], pw.layout["L1.attn.qkv_bias"]
    assert b.offset == m.offset + m.numel and b.shape == (m.shape[0],)
    d, g, hkv = cfg.head_dim, cfg.group_size, cfg.num_kv_heads
    p = "model.layers.1.self_attn."
    bias = pw.view("L1.attn.qkv_bias").view(hkv, g + 2, d)
    assert torch.equal(bias[:, :g], w[p + "q_proj.bias"].view(hkv, g, d))
    assert torch.equal(bias[:, g], w[p + "k_proj.bias"].view(hkv, d))
    assert torch.equal(bias[:, g + 1], w[p + "v_proj.bias"].view(hkv, d))


def test_small_tensors_come_first_so_32_bit_operands_reach_them() -> None:
    """Conv taps, output norms and MLA's kv_b are addressed by 32-bit operands: they are packed
    before the embedding, even in the 48B Kimi model whose arena passes 2^31 elements."""
    lay = weight_layout(preset("kimi-linear-48b-a3b"))
    assert lay.numel > 2**31
    small = [e for k, e in lay.entries.items()
             if k.endswith((".norm", ".conv", ".out_norm", ".kvb", ".lat_norm", "final_norm"))]
    assert small and max(e.offset for e in small) < lay["embed"].offset < 2**31
    prog_records_fit = max(e.offset + e.numel for e in small)
    assert prog_records_fit < 2**31


def test_lm_head_rows_are_padded_with_zeros() -> None:
    cfg = preset("qwen3-tiny").replace(vocab_size=1001)
    w = random_weights(cfg, seed=0)
    pw = pack_weights(cfg, w)
    head = pw.view("lm_head")
    assert head.shape == (1008, cfg.hidden_size)
    assert torch.equal(head[:1001], w["lm_head.weight"].to(torch.bfloat16))
    assert not head[1001:].any()


def test_missing_or_misshaped_weights_are_refused() -> None:
    cfg = preset("llama-tiny")
    w = random_weights(cfg, seed=0)
    del w["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(PackError, match="up_proj.weight' is missing"):
        pack_weights(cfg, w)
    w = random_weights(cfg, seed=0)
    w["model.layers.0.mlp.down_proj.weight"] = w["model.layers.0.mlp.down_proj.weight"][:, :8]
    with pytest.raises(PackError, match="L0.mlp.down: shape"):
        pack_weights(cfg, w)


def test_every_slab_points_into_a_packed_matrix() -> None:
    prog = compile_program(preset("kimi-linear-tiny"), 1, TOY)
    entries = {k: e for k, e in prog.layout.entries.items() if len(e.shape) == 2}
    for ins in prog.instrs:
        if ins.op in (Op.EXPERT_GATEUP, Op.EXPERT_DOWN, Op.PROJ):
            w, k = ins.operands["W"], ins.operands["K"]
            assert any(e.offset <= w < e.offset + e.numel and e.shape[1] == k
                       for e in entries.values())
