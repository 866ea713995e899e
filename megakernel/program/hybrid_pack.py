"""Weight packing of hybrid models (Qwen3.5, Nemotron-H) into one bf16 arena, plus fp32 params.

Layout (pack.py's conventions: row-major matrices, entries on 64-element boundaries, norms first):

    norms      per layer: in_norm [H], post_norm [H]; attention: qk_norm [2, D];
               GDN: gdn_norm [dv]; then final_norm [H]
    embed      [V, H]
    per layer  GDN:       gdn_proj [P, H]  rows [in_proj_qkv (C) | z (Hv dv) | b (Hv) | a (Hv)],
                                           zero rows up to P = round16(C + Hv dv + 2 Hv)
                          conv [C, K]     (conv1d.weight [C, 1, K] squeezed)
                          o [H, Hv dv]    out_proj
               attention: qkv [(2 Hq + 2 Hkv) D, H]  per kv group g: q heads g*G..g*G+G-1, their
                                           gate heads (q_proj's second half per head), k_g, v_g
                          o [H, Hq D]
               all:       gateup [2 I, H] (pack.gateup_rows), down [H, I]
    lm_head    [V, H] (untied models)

Nemotron-H (one block per layer, `backbone.` names):

    norms      per layer: in_norm [H] (the block norm); Mamba2: ssm_norm [H_m P]; final_norm
    embed      [V, H]
    per layer  Mamba2:    ssm_proj [P, H]  in_proj rows [z | xBC | dt], zero rows up to round16
                          conv [C (K + 1)] conv1d.weight [C, K] then conv1d.bias [C] (0: none)
                          o [H, H_m P]     out_proj
               attention: qkv [(Hq + 2 Hkv) D, H] (pack.qkv_rows order), o [H, Hq D]
               MLP:       up [I, H], down [H, I]
    lm_head

A_log, dt_bias (and Mamba2's D) stay fp32 (transformers keeps them fp32):
`HybridPacked.params[layer]` is [2, Hv] (A_log, dt_bias) for GDN, [3, H] (A_log, D, dt_bias) for
Mamba2; the program stores them in its f32 constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.hybrid.config import HybridConfig, KimiLinearConfig, NemotronHConfig, Qwen35Config
from megakernel.program.isa import ROW_ALIGN
from megakernel.program.pack import (
    LayoutBuilder,
    PackedWeights,
    WeightLayout,
    gateup_rows,
)

SUPPORTED_FAMILIES = ("qwen3_5", "nemotron_h", "kimi_linear")


class HybridPackError(ValueError):
    """A hybrid model the packer does not support yet, or weights that do not fit."""


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def gdn_proj_width(cfg: HybridConfig) -> int:
    """Columns of the f32 projection buffer (GDN, Mamba2, or Kimi's KDA / MLA projections)."""
    if isinstance(cfg, KimiLinearConfig):
        k, m = cfg.kda, cfg.mla
        kda = 3 * k.qkv_dim + 2 * k.head_dim + k.num_heads
        mla = m.num_heads * m.qk_head_dim + m.kv_lora_rank + m.qk_rope_head_dim
        return _round(max(kda, mla), ROW_ALIGN)
    if isinstance(cfg, NemotronHConfig):
        return _round(cfg.mamba2.in_proj_size, ROW_ALIGN)
    g = cfg.gdn  # type: ignore[attr-defined]
    return _round(g.conv_dim + g.value_dim + 2 * g.num_v_heads, ROW_ALIGN)


def require_supported(cfg: HybridConfig) -> HybridConfig:
    if cfg.family not in SUPPORTED_FAMILIES:
        raise HybridPackError(
            f"the hybrid program supports Qwen3.5, Nemotron-H and Kimi Linear so far; "
            f"{cfg.name or cfg.family} ({cfg.family}) is not supported yet")
    return cfg


def hybrid_layout(cfg: HybridConfig) -> WeightLayout:
    """The packed layout (no tensors needed)."""
    require_supported(cfg)
    if isinstance(cfg, NemotronHConfig):
        return _nemotron_layout(cfg)
    if isinstance(cfg, KimiLinearConfig):
        return _kimi_layout(cfg)
    assert isinstance(cfg, Qwen35Config)
    h, a, g = cfg.hidden_size, cfg.attention, cfg.gdn
    lay = LayoutBuilder()
    put = lay.put

    for i, kind in enumerate(cfg.layer_types):
        put(f"L{i}.in_norm", (h,))
        put(f"L{i}.post_norm", (h,))
        if kind == "attention":
            put(f"L{i}.qk_norm", (2, a.head_dim))
        else:
            put(f"L{i}.gdn_norm", (g.v_head_dim,))
    put("final_norm", (h,))
    put("embed", (cfg.vocab_size, h))
    for i, kind in enumerate(cfg.layer_types):
        if kind == "attention":
            put(f"L{i}.qkv", ((2 * a.num_heads + 2 * a.num_kv_heads) * a.head_dim, h))
            put(f"L{i}.o", (h, a.num_heads * a.head_dim))
        else:
            put(f"L{i}.gdn_proj", (gdn_proj_width(cfg), h))
            put(f"L{i}.conv", (g.conv_dim, g.conv_kernel))
            put(f"L{i}.o", (h, g.value_dim))
        put(f"L{i}.gateup", (2 * cfg.intermediate_size, h))
        put(f"L{i}.down", (h, cfg.intermediate_size))
    if not cfg.tie_word_embeddings:
        put("lm_head", (cfg.vocab_size, h))
    return lay.done()


def _nemotron_layout(cfg: NemotronHConfig) -> WeightLayout:
    h, a, m = cfg.hidden_size, cfg.attention, cfg.mamba2
    lay = LayoutBuilder()
    for i, kind in enumerate(cfg.layer_types):
        lay.put(f"L{i}.in_norm", (h,))
        if kind == "mamba2":
            lay.put(f"L{i}.ssm_norm", (m.d_inner,))
    lay.put("final_norm", (h,))
    lay.put("embed", (cfg.vocab_size, h))
    for i, kind in enumerate(cfg.layer_types):
        if kind == "mamba2":
            lay.put(f"L{i}.ssm_proj", (gdn_proj_width(cfg), h))
            lay.put(f"L{i}.conv", (m.conv_dim * (m.conv_kernel + 1),))
            lay.put(f"L{i}.o", (h, m.d_inner))
        elif kind == "attention":
            lay.put(f"L{i}.qkv", ((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, h))
            lay.put(f"L{i}.o", (h, a.num_heads * a.head_dim))
        else:
            lay.put(f"L{i}.up", (cfg.intermediate_size, h))
            lay.put(f"L{i}.down", (h, cfg.intermediate_size))
    if not cfg.tie_word_embeddings:
        lay.put("lm_head", (cfg.vocab_size, h))
    return lay.done()


def _kimi_layout(cfg: KimiLinearConfig) -> WeightLayout:
    h, k, m, e = cfg.hidden_size, cfg.kda, cfg.mla, cfg.moe
    if e.num_shared_experts > 1:
        raise HybridPackError(f"{e.num_shared_experts} shared experts: the program supports at "
                              "most one (it runs as expert slot top_k)")
    lay = LayoutBuilder()
    pw = gdn_proj_width(cfg)
    for i, kind in enumerate(cfg.layer_types):
        lay.put(f"L{i}.in_norm", (h,))
        lay.put(f"L{i}.post_norm", (h,))
        lay.put(f"L{i}.kda_norm" if kind == "kda" else f"L{i}.lat_norm",
                (k.head_dim,) if kind == "kda" else (m.kv_lora_rank,))
    lay.put("final_norm", (h,))
    lay.put("embed", (cfg.vocab_size, h))
    for i, kind in enumerate(cfg.layer_types):
        lay.put(f"L{i}.mix_proj", (pw, h))
        if kind == "kda":
            lay.put(f"L{i}.conv", (k.conv_dim * k.conv_kernel + 2 * k.qkv_dim * k.head_dim,))
            lay.put(f"L{i}.o", (h, k.qkv_dim))
        else:
            lay.put(f"L{i}.kvb", (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                  m.kv_lora_rank))
            lay.put(f"L{i}.o", (h, m.num_heads * m.v_head_dim))
        if cfg.ffn_type(i) == "mlp":
            lay.put(f"L{i}.gateup", (2 * cfg.intermediate_size, h))
            lay.put(f"L{i}.down", (h, cfg.intermediate_size))
        else:
            for x in range(e.num_experts + e.num_shared_experts):  # expert E: the shared one
                lay.put(f"L{i}.x{x}.gateup", (2 * e.intermediate_size, h))
                lay.put(f"L{i}.x{x}.down", (h, e.intermediate_size))
    if not cfg.tie_word_embeddings:
        lay.put("lm_head", (cfg.vocab_size, h))
    return lay.done()


def plain_qkv_rows(cfg: NemotronHConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
    """q [Hq D, H], k, v [Hkv D, H] -> [(Hq + 2 Hkv) D, H] grouped by kv head (q.., k, v)."""
    a = cfg.attention
    hkv, d = a.num_kv_heads, a.head_dim
    hid = q.shape[1]
    return torch.cat((q.reshape(hkv, -1, hid), k.reshape(hkv, d, hid), v.reshape(hkv, d, hid)),
                     1).reshape(-1, hid)


def gated_qkv_rows(cfg: Qwen35Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
    """q_proj [Hq 2D, H] ([q | gate] per head), k, v [Hkv D, H] -> [(2Hq + 2Hkv) D, H]."""
    a = cfg.attention
    hkv, grp, d = a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim
    hid = q.shape[1]
    q = q.reshape(hkv, grp, 2, d, hid)  # [g, j, q|gate, D, H]
    qs = q[:, :, 0].reshape(hkv, grp * d, hid)
    gs = q[:, :, 1].reshape(hkv, grp * d, hid)
    return torch.cat((qs, gs, k.reshape(hkv, d, hid), v.reshape(hkv, d, hid)), 1).reshape(-1, hid)


@dataclass
class HybridPacked(PackedWeights):
    params: dict[int, torch.Tensor] | None = None  # recurrent layer -> fp32 params (flat)
    router: dict[int, torch.Tensor] | None = None  # MoE layer -> fp32 router [E H] then bias [E]


def pack_hybrid(cfg: HybridConfig, weights: dict[str, torch.Tensor]) -> HybridPacked:
    """Repack Hugging Face-named hybrid weights (any dtype; matrices rounded to bf16)."""
    require_supported(cfg)
    lay = hybrid_layout(cfg)
    packed = HybridPacked(lay, torch.zeros(lay.numel, dtype=torch.bfloat16), {}, {})

    def w(name: str) -> torch.Tensor:
        if name not in weights:
            raise HybridPackError(f"weight {name!r} is missing")
        return weights[name].to(torch.bfloat16)

    def put(key: str, t: torch.Tensor) -> None:
        dst = packed.view(key)
        if t.shape[0] < dst.shape[0] and key.endswith("_proj"):  # zero padding rows
            dst[: t.shape[0]].copy_(t)
            return
        if tuple(t.shape) != tuple(dst.shape):
            raise HybridPackError(f"packed {key}: shape {tuple(t.shape)}, expected "
                                  f"{tuple(dst.shape)}")
        dst.copy_(t)

    if isinstance(cfg, NemotronHConfig):
        _pack_nemotron(cfg, weights, packed, w, put)
        return packed
    if isinstance(cfg, KimiLinearConfig):
        _pack_kimi(cfg, weights, packed, w, put)
        return packed
    assert isinstance(cfg, Qwen35Config)
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        put(f"L{i}.in_norm", w(p + "input_layernorm.weight"))
        put(f"L{i}.post_norm", w(p + "post_attention_layernorm.weight"))
        if kind == "attention":
            s = p + "self_attn."
            put(f"L{i}.qk_norm", torch.stack((w(s + "q_norm.weight"), w(s + "k_norm.weight"))))
            put(f"L{i}.qkv", gated_qkv_rows(cfg, w(s + "q_proj.weight"), w(s + "k_proj.weight"),
                                            w(s + "v_proj.weight")))
            put(f"L{i}.o", w(s + "o_proj.weight"))
        else:
            s = p + "linear_attn."
            put(f"L{i}.gdn_norm", w(s + "norm.weight"))
            put(f"L{i}.gdn_proj", torch.cat([w(s + f"in_proj_{n}.weight")
                                             for n in ("qkv", "z", "b", "a")]))
            put(f"L{i}.conv", w(s + "conv1d.weight")[:, 0])
            put(f"L{i}.o", w(s + "out_proj.weight"))
            packed.params[i] = torch.stack((weights[s + "A_log"].float(),
                                            weights[s + "dt_bias"].float()))
        put(f"L{i}.gateup", gateup_rows(w(p + "mlp.gate_proj.weight"),
                                        w(p + "mlp.up_proj.weight")))
        put(f"L{i}.down", w(p + "mlp.down_proj.weight"))
    put("final_norm", w("model.norm.weight"))
    put("embed", w("model.embed_tokens.weight"))
    if not cfg.tie_word_embeddings:
        put("lm_head", w("lm_head.weight"))
    return packed


def _pack_nemotron(cfg: NemotronHConfig, weights: dict[str, torch.Tensor], packed: HybridPacked,
                   w, put) -> None:  # noqa: ANN001
    m = cfg.mamba2
    for i, kind in enumerate(cfg.layer_types):
        p = f"backbone.layers.{i}."
        s = p + "mixer."
        put(f"L{i}.in_norm", w(p + "norm.weight"))
        if kind == "mamba2":
            put(f"L{i}.ssm_norm", w(s + "norm.weight"))
            put(f"L{i}.ssm_proj", w(s + "in_proj.weight"))
            bias = (w(s + "conv1d.bias") if m.use_conv_bias
                    else torch.zeros(m.conv_dim, dtype=torch.bfloat16))
            put(f"L{i}.conv", torch.cat((w(s + "conv1d.weight")[:, 0].reshape(-1), bias)))
            put(f"L{i}.o", w(s + "out_proj.weight"))
            assert packed.params is not None
            packed.params[i] = torch.stack([weights[s + n].float() for n in ("A_log", "D",
                                                                              "dt_bias")])
        elif kind == "attention":
            put(f"L{i}.qkv", plain_qkv_rows(cfg, w(s + "q_proj.weight"), w(s + "k_proj.weight"),
                                            w(s + "v_proj.weight")))
            put(f"L{i}.o", w(s + "o_proj.weight"))
        else:
            put(f"L{i}.up", w(s + "up_proj.weight"))
            put(f"L{i}.down", w(s + "down_proj.weight"))
    put("final_norm", w("backbone.norm_f.weight"))
    put("embed", w("backbone.embeddings.weight"))
    if not cfg.tie_word_embeddings:
        put("lm_head", w("lm_head.weight"))


def _pack_kimi(cfg: KimiLinearConfig, weights: dict[str, torch.Tensor], packed: HybridPacked,
               w, put) -> None:  # noqa: ANN001
    k, e = cfg.kda, cfg.moe
    assert packed.params is not None and packed.router is not None
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        s = p + "self_attn."
        put(f"L{i}.in_norm", w(p + "input_layernorm.weight"))
        put(f"L{i}.post_norm", w(p + "post_attention_layernorm.weight"))
        if kind == "kda":
            put(f"L{i}.kda_norm", w(s + "o_norm.weight"))
            put(f"L{i}.mix_proj", torch.cat([w(s + f"{n}_proj.weight")
                                             for n in ("q", "k", "v", "f_a", "b", "g_a")]))
            conv = torch.cat([w(s + f"{n}_conv1d.weight")[:, 0] for n in "qkv"])
            put(f"L{i}.conv", torch.cat((conv.reshape(-1), w(s + "f_b_proj.weight").reshape(-1),
                                         w(s + "g_b_proj.weight").reshape(-1))))
            put(f"L{i}.o", w(s + "o_proj.weight"))
            packed.params[i] = torch.cat((weights[s + "A_log"].float().reshape(k.num_heads),
                                          weights[s + "dt_bias"].float().reshape(-1)))
        else:
            put(f"L{i}.lat_norm", w(s + "kv_a_layernorm.weight"))
            put(f"L{i}.mix_proj", torch.cat((w(s + "q_proj.weight"),
                                             w(s + "kv_a_proj_with_mqa.weight"))))
            put(f"L{i}.kvb", w(s + "kv_b_proj.weight"))
            put(f"L{i}.o", w(s + "o_proj.weight"))
        if cfg.ffn_type(i) == "mlp":
            put(f"L{i}.gateup", gateup_rows(w(p + "mlp.gate_proj.weight"),
                                            w(p + "mlp.up_proj.weight")))
            put(f"L{i}.down", w(p + "mlp.down_proj.weight"))
            continue
        q = p + "block_sparse_moe."
        names = [(f"{q}experts.{x}.w1.weight", f"{q}experts.{x}.w3.weight",
                  f"{q}experts.{x}.w2.weight") for x in range(e.num_experts)]
        if e.num_shared_experts:
            names.append((f"{q}shared_experts.gate_proj.weight",
                          f"{q}shared_experts.up_proj.weight",
                          f"{q}shared_experts.down_proj.weight"))
        for x, (g_, u_, d_) in enumerate(names):
            put(f"L{i}.x{x}.gateup", gateup_rows(w(g_), w(u_)))
            put(f"L{i}.x{x}.down", w(d_))
        packed.router[i] = torch.cat((weights[q + "gate.weight"].float().reshape(-1),
                                      weights[q + "gate.e_score_correction_bias"].float()))
    put("final_norm", w("model.norm.weight"))
    put("embed", w("model.embed_tokens.weight"))
    if not cfg.tie_word_embeddings:
        put("lm_head", w("lm_head.weight"))
