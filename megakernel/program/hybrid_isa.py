"""Hybrid opcodes (Qwen3.5 first): records for gated-delta-rule layers and gated attention.

A hybrid program uses the record layout of isa.py unchanged (16 int32 words, the six common
words, epochs, counters, W_LO/W_HI) and mixes dense opcodes whose meaning does not depend on the
family (EMBED, OPROJ, DOWN, ARGMAX: no norm prologue) with the opcodes below, numbered from
`FIRST_HYBRID_OPCODE` so that they never collide with the dense format (isa.FORMAT_VERSION 2 is
not changed; a kernel that only knows format 2 refuses a program whose header carries
HYBRID_FORMAT_VERSION). Format history: hybrid 1 = recurrent GDN, gated attention, (1+w) norms.

Header fields a hybrid record relies on (`HybridProgram.header`)
    NORM_KIND          0: RMSNorm x * w, 1: zero-centred x * (1 + w) (Qwen3.5). Applies to every
                       hybrid matvec prologue and to the q/k norm of H_QKV.
    F32_ROPE_COS_OFF, F32_ROPE_SIN_OFF  cos, sin [S_max, R/2] fp32 (R = rotary dims)
    F32_GATE_OFF       f32 attention output gate [N, Hq, D] (pre-sigmoid)

Buffers added to the dense plan
    f32   proj [N, P]      GDN projections of the current layer, P = round16(C + Hv dv + 2 Hv):
                           columns [conv input q|k|v (C) | z (Hv dv) | b (Hv) | a (Hv) | pad]
          gate [N, Hq, D]  attention output gate (pre-sigmoid)
          gdn_params [n_gdn, 2, Hv]  A_log, dt_bias per GDN layer (constants, fp32)
    bf16  gdn_out [N, Hv dv]  gated-norm output of a GDN layer (the out_proj input)
    state fp32 (persistent, not scratch) per GDN layer a block at STATE_OFF:
          conv window [B, C, K-1] (oldest first), then state [B, Hv, dk, dv]
    k, v  bf16 KV cache [La, B, Hkv, S_max, D] of the La attention layers (slot KV_SLOT)

Rounding points are those of reference/hybrid in "bf16" mode: matvec inputs (norm outputs,
gated-norm outputs, gated attention outputs, MLP activations), q and the KV cache are bf16;
projections, conv, gates, decays, state and conv window stay fp32.
"""

from __future__ import annotations

from enum import IntEnum

from megakernel.program import isa
from megakernel.program.isa import (
    _MATVEC,
    COMMON_FIELDS,
    COMMON_WORDS,
    NO_COUNTER,
    RECORD_WORDS,
    Op,
    join64,
    split64,
)

HYBRID_FORMAT_VERSION = 1
FIRST_HYBRID_OPCODE = 16

NORM_W = 0  # x * rsqrt(mean(x^2) + eps) * w
NORM_1P = 1  # x * rsqrt(mean(x^2) + eps) * (1 + w)


class HOp(IntEnum):
    H_GATEUP = 16
    H_LMHEAD = 17
    H_QKV = 18
    H_ATTN = 19
    H_GDN_PROJ = 20
    H_GDN_CORE = 21


# Dense opcodes a hybrid program may contain (their format-2 meaning, unchanged).
DENSE_OPS = (Op.END, Op.EMBED, Op.OPROJ, Op.DOWN, Op.ARGMAX)

OPERANDS: dict[HOp, tuple[tuple[str, str], ...]] = {
    HOp.H_GATEUP: _MATVEC,  # as GATEUP, prologue norm per NORM_KIND
    HOp.H_LMHEAD: isa.OPERANDS[Op.LMHEAD],  # as LMHEAD, prologue norm per NORM_KIND
    HOp.H_QKV: _MATVEC
    + (
        ("QK_NORM_OFF", "weights: q_norm [D] then k_norm [D]"),
        ("KV_SLOT", "attention-layer index into the KV cache"),
    ),
    # H_QKV: packed rows per kv group g: q heads g*G.. (D rows each), their gate heads, k_g, v_g
    # (2G + 2 head slots). q -> norm, partial RoPE -> bf16 OUT_OFF [N, Hq, D]; gate -> f32
    # header F32_GATE_OFF [N, Hq, D]; k -> norm, RoPE, v -> cache (KV_SLOT, b, g, lengths[b]+t).
    HOp.H_ATTN: (
        ("B_IDX", "sequence b"),
        ("KV_HEAD", "kv head g (q heads g*G .. g*G+G-1)"),
        ("KV_SLOT", "attention-layer index into the KV cache"),
        ("Q_OFF", "bf16: q [N, Hq, D]"),
        ("GATE_OFF", "f32: gate [N, Hq, D]"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("OUT_OFF", "bf16: bf16(attention * sigmoid(gate)) [N, Hq * D]"),
    ),
    HOp.H_GDN_PROJ: _MATVEC + (("OUT_W", "row width P of the f32 output [N, P]"),),
    # H_GDN_PROJ: OUT_OFF = f32 proj [N, P]; proj[n, ROW0 + r] = acc (fp32)
    HOp.H_GDN_CORE: (
        ("B_IDX", "sequence b"),
        ("K_HEAD", "key head kh (value heads kh*R .. kh*R+R-1, R = Hv / Hk)"),
        ("PROJ_OFF", "f32: proj [N, P]"),
        ("CONV_W", "weights: conv1d [C, K]"),
        ("PARAM_OFF", "f32: A_log [Hv] then dt_bias [Hv] of this layer"),
        ("NORM_W", "weights: gated RMSNorm weight [dv]"),
        ("STATE_OFF", "state: this layer's block (conv window, then state)"),
        ("OUT_OFF", "bf16: gdn_out [N, Hv * dv]"),
    ),
    # H_GDN_CORE: for the T tokens of sequence b: causal conv of the q, k channels of kh and the
    # v channels of its value heads (window in, window out), silu, l2norm(q) dk^-1/2, l2norm(k),
    # beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), per token the delta rule
    # u = beta (v - S^T (e^g k)); o = S^T (e^g q) + (k . q) u; S <- e^g S + k u^T,
    # then bf16(RMSNorm(o) * w * silu(z)) per value head.
}

OP_DOC: dict[HOp, str] = {
    HOp.H_GATEUP: "NORM_KIND RMSNorm(h) -> slab of interleaved gate/up -> silu(gate) * up (bf16)",
    HOp.H_LMHEAD: "NORM_KIND final RMSNorm(h) -> vocab slab -> logits + partial argmax",
    HOp.H_QKV: "RMSNorm(h) -> slab of q|gate|k|v heads of one kv group -> q/k norm, partial"
    " RoPE -> q (bf16), gate (f32), k/v cache",
    HOp.H_ATTN: "causal attention of one (sequence, kv head), T tokens, G q heads, times"
    " sigmoid(gate), bf16",
    HOp.H_GDN_PROJ: "RMSNorm(h) -> slab of the fused GDN projection [qkv | z | b | a] (fp32)",
    HOp.H_GDN_CORE: "conv + gated delta rule (recurrent) + gated RMSNorm of one (sequence, key"
    " head)",
}

_NAMES = {op: tuple(n for n, _ in ops) for op, ops in OPERANDS.items()}
MATVEC_HOPS = (HOp.H_GATEUP, HOp.H_LMHEAD, HOp.H_QKV, HOp.H_GDN_PROJ)
assert all(len(v) <= RECORD_WORDS - COMMON_WORDS for v in OPERANDS.values())
assert min(HOp) > max(Op)


def opcode(x: int) -> Op | HOp:
    """The opcode enum of a record's word 0 (dense or hybrid)."""
    if x >= FIRST_HYBRID_OPCODE:
        return HOp(x)
    op = Op(x)
    if op not in DENSE_OPS:
        raise ValueError(f"dense opcode {op.name} is not part of a hybrid program")
    return op


def encode(op: Op | HOp, *, wait: tuple[int, int, int] | None = None, signal: int = NO_COUNTER,
           layer: int = -1, **operands: int) -> list[int]:
    """One record (dense opcodes go to isa.encode; hybrid ones use the same layout)."""
    if not isinstance(op, HOp):
        return isa.encode(op, wait=wait, signal=signal, layer=layer, **operands)
    if "W" in operands:
        operands["W_LO"], operands["W_HI"] = split64(operands.pop("W"))
    names = _NAMES[op]
    if set(operands) != set(names):
        raise KeyError(f"opcode {op.name}: operands {sorted(operands)}, expected {list(names)}")
    cid, target, total = wait if wait is not None else (NO_COUNTER, 0, 0)
    rec = [int(op), cid, target, total, signal, layer] + [int(operands[n]) for n in names]
    for i, v in enumerate(rec):
        if not -(1 << 31) <= v < (1 << 31):
            raise OverflowError(f"field {(COMMON_FIELDS + names)[i]}={v} of {op.name} does not "
                                "fit in int32")
    return rec + [0] * (RECORD_WORDS - len(rec))


def decode(rec) -> dict:  # noqa: ANN001
    """A record as {field: value} (adds the 64-bit `W` for slab opcodes)."""
    words = rec if isinstance(rec, list) else [int(x) for x in rec]
    op = opcode(words[0])
    if not isinstance(op, HOp):
        return isa.decode(words)
    if len(words) != RECORD_WORDS:
        raise ValueError(f"a record has {RECORD_WORDS} words, got {len(words)}")
    out = dict(zip(COMMON_FIELDS + _NAMES[op], words, strict=False))
    out["OPCODE"] = op
    if "W_LO" in out:
        out["W"] = join64(out["W_LO"], out["W_HI"])
    return out


def describe(rec) -> str:  # noqa: ANN001
    d = decode(rec)
    op = d.pop("OPCODE")
    parts = [f"{k}={v}" for k, v in d.items() if k not in ("W_LO", "W_HI")]
    return f"{op.name}(" + ", ".join(parts) + ")"


def table_markdown() -> str:
    """The hybrid opcode table as markdown."""
    lines = [f"Hybrid ISA format {HYBRID_FORMAT_VERSION} (records as dense format "
             f"{isa.FORMAT_VERSION}); dense opcodes used: "
             + ", ".join(o.name for o in DENSE_OPS if o != Op.END)]
    for op in HOp:
        lines += ["", f"**{op.value} {op.name}**: {OP_DOC[op]}", ""]
        lines += [f"- word {COMMON_WORDS + i} `{n}`: {doc}"
                  for i, (n, doc) in enumerate(OPERANDS[op])]
    return "\n".join(lines)
