"""Weight packing: one flat bf16 arena in which every instruction streams one contiguous slab.

Layout (element offsets; every entry starts on a multiple of `ALIGN` elements = 128 bytes):

    norms      per layer: input_layernorm [H], post_attention_layernorm [H],
               (qwen3) q_norm [D], k_norm [D]; then model.norm [H]
               (first, so their offsets fit the one-word NORM_OFF / QK_NORM_OFF operands)
    embed      model.embed_tokens [V, H]        (also the LM head when tied)
    per layer  qkv    [(Hq + 2 Hkv) D, H]  heads grouped by kv head: q heads of group g, k_g, v_g
               o      [H, Hq D]            o_proj as is
               gateup [2 I, H]             gate/up interleaved in blocks of GATEUP_BLOCK rows
               down   [H, I]               down_proj as is
    lm_head    [V, H]                      untied models only

Every matrix is row-major, so rows [r0, r1) of it are one contiguous run: the tiling only picks
row ranges (whole heads of one group for QKV, whole gate/up block pairs for GATEUP, multiples of
ROW_ALIGN rows elsewhere), and the arena does not depend on the GPU or the tiling. The row orders
(documented in isa.py) put everything an epilogue needs into its own slab: all D rows of a head
(qk-norm, RoPE's rotate-half pairs) and the matching gate and up rows (silu(gate) * up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakernel.config import ModelConfig
from megakernel.program.isa import GATEUP_BLOCK

ALIGN = 64  # elements (128 bytes): TMA bulk copies and 16-byte vector loads need 16-byte alignment

EMBED = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Entry:
    offset: int  # element offset in the arena
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class WeightLayout:
    """Where every packed tensor lives; keys are 'embed', 'final_norm', 'lm_head', and per layer
    'L{i}.attn_norm', 'L{i}.mlp_norm', 'L{i}.qk_norm' (q_norm then k_norm), 'L{i}.qkv', 'L{i}.o',
    'L{i}.gateup', 'L{i}.down'."""

    entries: dict[str, Entry]
    numel: int

    def __getitem__(self, key: str) -> Entry:
        return self.entries[key]

    def layer(self, i: int, name: str) -> Entry:
        return self.entries[f"L{i}.{name}"]

    @property
    def lm_head(self) -> Entry:
        return self.entries["lm_head"] if "lm_head" in self.entries else self.entries["embed"]

    @property
    def nbytes(self) -> int:
        return 2 * self.numel


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


class LayoutBuilder:
    """Places tensors one after another in the arena, each start ALIGN-aligned."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.off = 0

    def put(self, key: str, shape: tuple[int, ...]) -> None:
        e = Entry(self.off, shape)
        self.entries[key] = e
        self.off = _align(self.off + e.numel)

    def done(self) -> WeightLayout:
        return WeightLayout(self.entries, self.off)


def weight_layout(cfg: ModelConfig) -> WeightLayout:
    """The packed layout of `cfg` (no tensors needed)."""
    h, i, d, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    lay = LayoutBuilder()
    put = lay.put

    for layer in range(cfg.num_layers):
        put(f"L{layer}.attn_norm", (h,))
        put(f"L{layer}.mlp_norm", (h,))
        if cfg.qk_norm:
            put(f"L{layer}.qk_norm", (2, d))
    put("final_norm", (h,))
    put("embed", (v, h))
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    for layer in range(cfg.num_layers):
        put(f"L{layer}.qkv", (qkv_rows, h))
        put(f"L{layer}.o", (h, cfg.q_size))
        put(f"L{layer}.gateup", (2 * i, h))
        put(f"L{layer}.down", (h, i))
    if not cfg.tie_word_embeddings:
        put("lm_head", (v, h))
    return lay.done()


def qkv_rows(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq D, H], k, v [Hkv D, H] -> packed [(Hq + 2 Hkv) D, H], grouped by kv head."""
    g, hkv, d = cfg.group_size, cfg.num_kv_heads, cfg.head_dim
    hid = q.shape[1]
    q = q.reshape(hkv, g * d, hid)
    k = k.reshape(hkv, d, hid)
    v = v.reshape(hkv, d, hid)
    return torch.cat((q, k, v), dim=1).reshape(-1, hid)


def gateup_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [I, H] -> [2 I, H] in alternating blocks of GATEUP_BLOCK rows."""
    i, hid = gate.shape
    nb = i // GATEUP_BLOCK
    g = gate.reshape(nb, GATEUP_BLOCK, hid)
    u = up.reshape(nb, GATEUP_BLOCK, hid)
    return torch.stack((g, u), dim=1).reshape(2 * i, hid)


@dataclass
class PackedWeights:
    layout: WeightLayout
    arena: torch.Tensor  # [numel] bf16

    def view(self, key: str) -> torch.Tensor:
        e = self.layout[key]
        return self.arena[e.offset : e.offset + e.numel].view(e.shape)


def pack_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> PackedWeights:
    """Repack Hugging Face-named weights into the arena (bf16; padding is zero)."""
    lay = weight_layout(cfg)
    arena = torch.zeros(lay.numel, dtype=torch.bfloat16)
    packed = PackedWeights(lay, arena)

    def w(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"weight {name!r} is missing")
        return weights[name].to(torch.bfloat16)

    def put(key: str, t: torch.Tensor) -> None:
        dst = packed.view(key)
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(f"packed {key}: shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(t)

    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        put(f"L{layer}.attn_norm", w(p + "input_layernorm.weight"))
        put(f"L{layer}.mlp_norm", w(p + "post_attention_layernorm.weight"))
        if cfg.qk_norm:
            qk = torch.stack((w(p + "self_attn.q_norm.weight"), w(p + "self_attn.k_norm.weight")))
            put(f"L{layer}.qk_norm", qk)
        a = p + "self_attn."
        put(f"L{layer}.qkv", qkv_rows(cfg, w(a + "q_proj.weight"), w(a + "k_proj.weight"),
                                      w(a + "v_proj.weight")))
        put(f"L{layer}.o", w(a + "o_proj.weight"))
        put(f"L{layer}.gateup", gateup_rows(w(p + "mlp.gate_proj.weight"),
                                            w(p + "mlp.up_proj.weight")))
        put(f"L{layer}.down", w(p + "mlp.down_proj.weight"))
    put("final_norm", w("model.norm.weight"))
    put("embed", w(EMBED))
    if not cfg.tie_word_embeddings:
        put("lm_head", w("lm_head.weight"))
    return packed
