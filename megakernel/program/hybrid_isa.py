"""Hybrid opcodes: records for Qwen3.5 (gated delta rule, gated attention), Nemotron-H (Mamba2,
plain attention, relu^2 MLP) and Kimi Linear (KDA, MLA, MoE with run-time expert ids) layers,
recurrent or ReplaySSM.

A hybrid program uses the record layout of isa.py unchanged (16 int32 words, the six common
words, epochs, counters, W_LO/W_HI) and mixes dense opcodes whose meaning does not depend on the
family (EMBED, OPROJ, DOWN, ARGMAX: no norm prologue) with the opcodes below, numbered from
`FIRST_HYBRID_OPCODE` so that they never collide with the dense format (isa.FORMAT_VERSION 2 is
not changed; a kernel that only knows format 2 refuses a program whose header carries
HYBRID_FORMAT_VERSION). Format history: hybrid 1 = GDN, Mamba2 and KDA (recurrent and
ReplaySSM), gated or plain attention, MLA, MoE, (1+w) or plain norms, relu^2 MLP.

Header fields a hybrid record relies on (`HybridProgram.header`)
    NORM_KIND          0: RMSNorm x * w, 1: zero-centred x * (1 + w) (Qwen3.5). Applies to every
                       hybrid matvec prologue and to the q/k norm of H_QKV.
    F32_ROPE_COS_OFF, F32_ROPE_SIN_OFF  cos, sin [S_max, R/2] fp32 (R = rotary dims)
    F32_GATE_OFF       f32 attention output gate [N, Hq, D] (pre-sigmoid)
    OUTPUT_GATE        1: H_QKV slabs hold gate heads (Qwen3.5), 0: q.., k, v only
    ROTARY_DIM         R (0: no RoPE)
    SSM_PROJ_W         P, the width of the f32 projection buffer

Buffers added to the dense plan
    f32   proj [N, P]      projections of the current recurrent / MLA layer, zero-padded to
                           round16: GDN [conv input q|k|v (C) | z (Hv dv) | b (Hv) | a (Hv)],
                           Mamba2 [z (H P) | conv input x|B|C (C) | dt (H)], KDA [q|k|v (3 H d)
                           | f_a (d) | b (H) | g_a (d)], MLA [q (H (dn + dr)) | c (r) | k_rope]
          gate [N, Hq, D]  attention output gate (pre-sigmoid)
          ssm_params [n_rec, n_params]  per recurrent layer (constants, fp32): GDN A_log, dt_bias
                           [Hv] each; Mamba2 A_log, D, dt_bias [H] each; KDA A_log [H], dt_bias
                           [H d]
    bf16  ssm_out [N, out]  gated-norm output of a recurrent layer (out_proj input)
    state fp32 (persistent, not scratch) per recurrent layer a block at STATE_OFF:
          conv window [B, C, K-1] (oldest first), then the state [B, ...], then (ReplaySSM)
          the ring (see H_GDN_REPLAY, H_MAMBA_REPLAY, H_KDA_REPLAY)
    i32   ring_count [n_rec, B, units] (ReplaySSM, persistent): committed ring entries per
          (layer, sequence, unit: key head / group / head)
    k, v  bf16 KV cache [La, B, Hkv, S_max, D] of the La attention layers (slot KV_SLOT);
          Kimi MLA: k = latent c [La, B, 1, S_max, r], v = k_rope [La, B, 1, S_max, dr]
    Kimi MoE: f32 router [n_moe, E H + E] (constants), moe_w [N, top_k], moe_y
          [N, top_k + 1, H]; bf16 act_moe [N, top_k + 1, I_e]; i32 moe_ids [N, top_k]
          (slot top_k: the shared expert)

Rounding points are those of reference/hybrid in "bf16" mode: matvec inputs (norm outputs,
gated-norm outputs, gated attention outputs, MLP activations), q and the KV cache are bf16;
projections, conv, gates, decays, router, states, rings and conv windows stay fp32; MLA's latent
cache and KDA / MLA low-rank intermediates are bf16.
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
    H_GDN_REPLAY = 22
    H_UP_RELU2 = 23
    H_MAMBA_CORE = 24
    H_MAMBA_REPLAY = 25
    H_KDA_CORE = 26
    H_KDA_REPLAY = 27
    H_MLA = 28
    H_ROUTER = 29
    H_EXPERT_GATEUP = 30
    H_EXPERT_DOWN = 31
    H_MOE_COMBINE = 32


# Dense opcodes a hybrid program may contain (their format-2 meaning, unchanged).
DENSE_OPS = (Op.END, Op.EMBED, Op.OPROJ, Op.DOWN, Op.ARGMAX)

OPERANDS: dict[HOp, tuple[tuple[str, str], ...]] = {
    HOp.H_GATEUP: _MATVEC,  # as GATEUP, prologue norm per NORM_KIND
    HOp.H_LMHEAD: isa.OPERANDS[Op.LMHEAD],  # as LMHEAD, prologue norm per NORM_KIND
    HOp.H_QKV: _MATVEC
    + (
        ("QK_NORM_OFF", "weights: q_norm [D] then k_norm [D] (-1: none)"),
        ("KV_SLOT", "attention-layer index into the KV cache"),
    ),
    # H_QKV: packed rows per kv group g: q heads g*G.. (D rows each), their gate heads (header
    # OUTPUT_GATE = 1), k_g, v_g (2G + 2 or G + 2 head slots). q -> norm, partial RoPE -> bf16
    # OUT_OFF [N, Hq, D]; gate -> f32 header F32_GATE_OFF [N, Hq, D]; k -> norm, RoPE, v ->
    # cache (KV_SLOT, b, g, lengths[b]+t).
    HOp.H_ATTN: (
        ("B_IDX", "sequence b"),
        ("KV_HEAD", "kv head g (q heads g*G .. g*G+G-1)"),
        ("KV_SLOT", "attention-layer index into the KV cache"),
        ("Q_OFF", "bf16: q [N, Hq, D]"),
        ("GATE_OFF", "f32: gate [N, Hq, D] (-1: no output gate)"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("OUT_OFF", "bf16: bf16(attention * sigmoid(gate)) [N, Hq * D]"),
    ),
    HOp.H_GDN_PROJ: _MATVEC + (("OUT_W", "row width P of the f32 output [N, P]"),),
    # H_GDN_PROJ (GDN and Mamba2 in_proj): OUT_OFF = f32 proj [N, P]; proj[n, ROW0 + r] = acc
    HOp.H_UP_RELU2: _MATVEC,  # OUT_OFF = bf16 act [N, I]: act[n, ROW0 + r] = bf16(relu(acc)^2)
    HOp.H_MAMBA_CORE: (
        ("B_IDX", "sequence b"),
        ("GROUP", "group j (heads j*R .. j*R+R-1, R = H / G)"),
        ("PROJ_OFF", "f32: proj [N, P]"),
        ("CONV_W", "weights: conv1d [C, K] then its bias [C]"),
        ("PARAM_OFF", "f32: A_log [H], D [H], dt_bias [H] of this layer"),
        ("NORM_W", "weights: gated group-RMSNorm weight [H P]"),
        ("STATE_OFF", "state: this layer's block (conv window, state [B, H, P, N], ring)"),
        ("OUT_OFF", "bf16: ssm_out [N, H P]"),
    ),
    # H_MAMBA_CORE: causal conv (+ bias) of the x channels of the group's heads and its B, C
    # channels, silu; dt = softplus(dt + dt_bias); per token y = e^{dt A} S C + dt (B . C) x
    # + D x, S <- e^{dt A} S + x (dt B)^T (A = -exp(A_log)); out = bf16(w * RMSNorm over the
    # group of (y * silu(z))).
    HOp.H_MAMBA_REPLAY: (
        ("B_IDX", "sequence b"),
        ("GROUP", "group j"),
        ("PROJ_OFF", "f32: proj [N, P]"),
        ("CONV_W", "weights: conv1d [C, K] then its bias [C]"),
        ("PARAM_OFF", "f32: A_log [H], D [H], dt_bias [H] of this layer"),
        ("NORM_W", "weights: gated group-RMSNorm weight [H P]"),
        ("STATE_OFF", "state: this layer's block (conv window, committed state, ring)"),
        ("OUT_OFF", "bf16: ssm_out [N, H P]"),
        ("WINDOW", "fold window L"),
        ("COUNT_OFF", "i32: ring entries [B, G] of this layer (persistent)"),
    ),
    HOp.H_KDA_CORE: (
        ("B_IDX", "sequence b"),
        ("HEAD", "head h"),
        ("PROJ_OFF", "f32: proj [N, P]"),
        ("CONV_W", "weights: q|k|v conv [3 H d, K], then f_b [H d, d], then g_b [H d, d]"),
        ("PARAM_OFF", "f32: A_log [H] then dt_bias [H d] of this layer"),
        ("NORM_W", "weights: o_norm [d]"),
        ("STATE_OFF", "state: this layer's block (conv window, state [B, H, d, d], ring)"),
        ("OUT_OFF", "bf16: ssm_out [N, H d]"),
    ),
    HOp.H_KDA_REPLAY: (
        ("B_IDX", "sequence b"),
        ("HEAD", "head h"),
        ("PROJ_OFF", "f32: proj [N, P]"),
        ("CONV_W", "weights: q|k|v conv [3 H d, K], then f_b [H d, d], then g_b [H d, d]"),
        ("PARAM_OFF", "f32: A_log [H] then dt_bias [H d] of this layer"),
        ("NORM_W", "weights: o_norm [d]"),
        ("STATE_OFF", "state: this layer's block (conv window, state [B, H, d, d], ring)"),
        ("OUT_OFF", "bf16: ssm_out [N, H d]"),
        ("WINDOW", "fold window L"),
        ("COUNT_OFF", "i32: ring entries [B, H] of this layer (persistent)"),
    ),
    # H_KDA_CORE / H_KDA_REPLAY (Kimi delta attention, per (sequence, head)): proj columns
    # [q | k | v (H d each) | f_a (d) | b (H) | g_a (d)]; conv + silu of the head's q, k, v
    # channels; q, k = x / sqrt(|x|^2 + 1e-6), q *= d^-1/2; beta = sigmoid(b);
    # g = -exp(A_log) softplus(f_b bf16(f_a) + dt_bias) (channel-wise, [d]); the delta rule of
    # H_GDN_CORE / H_GDN_REPLAY with decay diag(e^g) (ring entries k, u, g [H, d] each);
    # out = bf16(RMSNorm(o) * w * sigmoid(g_b bf16(g_a))).
    HOp.H_MLA: (
        ("B_IDX", "sequence b"),
        ("HEAD", "head h"),
        ("PROJ_OFF", "f32: proj [N, P], columns [q (H (dn + dr)) | c (r) | k_rope (dr)]"),
        ("KVB_W", "weights: kv_b [H (dn + dv), r]"),
        ("NORM_W", "weights: kv_a_layernorm [r] (eps 1e-6)"),
        ("KV_SLOT", "MLA-layer index into the latent cache"),
        ("LEN_OFF", "i32: lengths [B]"),
        ("OUT_OFF", "bf16: attention output [N, H dv]"),
    ),
    # H_MLA (one sequence, one head): c = bf16(RMSNorm(c)), computed by every head, stored by
    # head 0 into the latent cache k[KV_SLOT, b, 0, lengths[b] + t], bf16(k_rope) into v[...]
    # (other heads use their own copy of the new positions, so they need not wait for head 0);
    # [k_nope | v] = the head's rows of kv_b times c for every cached position; q = bf16(q);
    # softmax(q . [k_nope | k_rope] / sqrt(dn + dr)) v -> bf16 columns h dv .. (h + 1) dv.
    HOp.H_ROUTER: (
        ("NORM_OFF", "weights: post-attention RMSNorm [H]"),
        ("IN_OFF", "f32: h [N, H]"),
        ("K", "H"),
        ("ROUTER_OFF", "f32: router weight [E, H] then e_score_correction_bias [E] (fp32)"),
        ("IDS_OFF", "i32: expert ids [N, top_k]"),
        ("WTS_OFF", "f32: expert weights [N, top_k]"),
    ),
    # H_ROUTER (all N rows): s = sigmoid(W_r bf16(RMSNorm(h))); choice = s + bias; the header's
    # MOE_TOPK_GROUP best of MOE_N_GROUP groups (group score: sum of its top-2 choices), then the
    # top_k experts of those groups by choice; weights s_e / (sum + 1e-20) * scaling (header).
    HOp.H_EXPERT_GATEUP: _MATVEC
    + (
        ("EXPERT", "expert e (E = the shared expert)"),
        ("IDS_OFF", "i32: expert ids [N, top_k]"),
    ),
    # H_EXPERT_GATEUP: for the rows (n, s) with ids[n, s] == EXPERT (shared: every n, s = top_k),
    # RMSNorm(h[n]) -> slab of the expert's interleaved gate/up -> act_moe[n, s, ROW0/2 + c]
    # (bf16 [N, top_k + 1, I_e]); no row selected: no work (its weights are not streamed).
    HOp.H_EXPERT_DOWN: _MATVEC
    + (
        ("EXPERT", "expert e (E = the shared expert)"),
        ("IDS_OFF", "i32: expert ids [N, top_k]"),
    ),
    # H_EXPERT_DOWN: rows as H_EXPERT_GATEUP; IN_OFF = bf16 act_moe [N, top_k + 1, I_e],
    # OUT_OFF = f32 moe_y [N, top_k + 1, H]: moe_y[n, s, ROW0 + r] = acc.
    HOp.H_MOE_COMBINE: (
        ("ROW0", "first column of h"),
        ("NROWS", "columns"),
        ("Y_OFF", "f32: moe_y [N, top_k + 1, H]"),
        ("IDS_OFF", "i32: expert ids [N, top_k]"),
        ("WTS_OFF", "f32: expert weights [N, top_k]"),
        ("OUT_OFF", "f32: h [N, H]"),
    ),
    # H_MOE_COMBINE: h[n, cols] += (sum over the top_k slots in increasing expert id of
    # w * moe_y[n, s]) + moe_y[n, top_k] (shared expert, header MOE_SHARED = 1).
    # H_MAMBA_REPLAY (ReplaySSM): with n committed entries (x [R, P], B [N], dt [R] each) and
    # Lam(t, j) = A * sum of dt over (j, t]: y_t = e^Lam(t,c) S_c C_t + sum_{j<=t} dt_j
    # e^Lam(t,j) (B_j . C_t) x_j + D x_t; appends the T entries; folds when n + T >= WINDOW
    # (S_c <- e^Lam(n+T,c) S_c + sum_j x_j (dt_j e^Lam(n+T,j) B_j)^T, count 0). Ring layout after
    # the state: x [B, CAP, H, P], B [B, CAP, G, N], dt [B, CAP, H].
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
    HOp.H_GDN_REPLAY: (
        ("B_IDX", "sequence b"),
        ("K_HEAD", "key head kh"),
        ("PROJ_OFF", "f32: proj [N, P]"),
        ("CONV_W", "weights: conv1d [C, K]"),
        ("PARAM_OFF", "f32: A_log [Hv] then dt_bias [Hv] of this layer"),
        ("NORM_W", "weights: gated RMSNorm weight [dv]"),
        ("STATE_OFF", "state: this layer's block (conv window, committed state, ring)"),
        ("OUT_OFF", "bf16: gdn_out [N, Hv * dv]"),
        ("WINDOW", "fold window L"),
        ("COUNT_OFF", "i32: ring entries [B, Hk] of this layer (persistent)"),
    ),
    # H_GDN_CORE: for the T tokens of sequence b: causal conv of the q, k channels of kh and the
    # v channels of its value heads (window in, window out), silu, l2norm(q) dk^-1/2, l2norm(k),
    # beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), per token the delta rule
    # u = beta (v - S^T (e^g k)); o = S^T (e^g q) + (k . q) u; S <- e^g S + k u^T,
    # then bf16(RMSNorm(o) * w * silu(z)) per value head.
    # H_GDN_REPLAY (ReplaySSM): conv, q, k, v, beta, g as H_GDN_CORE; with n = count[b, kh]
    # committed ring entries (k [dk] of kh, u [R, dv], g [R] per entry) and the committed state
    # S_c, token i (t = n + i) computes, with G(t, j) the sum of g over entries (j, t],
    # u_t = beta (v - S_c^T (e^G(t,c) k) - sum_{j<t} (e^G(t,j) k_j . k) u_j),
    # o_t = S_c^T (e^G(t,c) q) + sum_{j<=t} (e^G(t,j) k_j . q) u_j, appends (k, u_t, g) at ring
    # position t; then if n + T >= WINDOW it folds all n + T entries into S_c
    # (S_c <- e^G(n+T,c) S_c + sum_j e^G(n+T,j) k_j u_j^T) and stores count 0, else n + T.
    # State block: conv [B, C, K-1], S_c [B, Hv, dk, dv], ring k [B, CAP, Hk, dk],
    # u [B, CAP, Hv, dv], g [B, CAP, Hv] with CAP = header RING_CAP = WINDOW - 1 + T.
}

OP_DOC: dict[HOp, str] = {
    HOp.H_GATEUP: "NORM_KIND RMSNorm(h) -> slab of interleaved gate/up -> silu(gate) * up (bf16)",
    HOp.H_LMHEAD: "NORM_KIND final RMSNorm(h) -> vocab slab -> logits + partial argmax",
    HOp.H_QKV: "RMSNorm(h) -> slab of q|gate|k|v heads of one kv group -> q/k norm, partial"
    " RoPE -> q (bf16), gate (f32), k/v cache",
    HOp.H_ATTN: "causal attention of one (sequence, kv head), T tokens, G q heads, times"
    " sigmoid(gate), bf16",
    HOp.H_GDN_PROJ: "RMSNorm(h) -> slab of a recurrent layer's fused input projection (fp32)",
    HOp.H_GDN_CORE: "conv + gated delta rule (recurrent) + gated RMSNorm of one (sequence, key"
    " head)",
    HOp.H_GDN_REPLAY: "conv + gated delta rule by ReplaySSM (committed state + ring, fold every"
    " L) + gated RMSNorm of one (sequence, key head)",
    HOp.H_UP_RELU2: "RMSNorm(h) -> slab of up_proj -> relu(x)^2 (bf16)",
    HOp.H_MAMBA_CORE: "conv + SSD recurrent update + gated group RMSNorm of one (sequence, group)",
    HOp.H_MAMBA_REPLAY: "conv + SSD by ReplaySSM (committed state + ring, fold every L) + gated"
    " group RMSNorm of one (sequence, group)",
    HOp.H_KDA_CORE: "conv + low-rank decay/gate + KDA delta rule (recurrent) + gated norm of one"
    " (sequence, head)",
    HOp.H_KDA_REPLAY: "as H_KDA_CORE by ReplaySSM (committed state + ring, fold every L)",
    HOp.H_MLA: "latent norm -> latent cache, kv_b over the cache, attention of one (sequence,"
    " head)",
    HOp.H_ROUTER: "RMSNorm(h) -> fp32 router -> group-limited top-k expert ids and weights",
    HOp.H_EXPERT_GATEUP: "gate/up slab of one expert for the tokens routed to it (run-time ids)",
    HOp.H_EXPERT_DOWN: "down slab of one expert for the tokens routed to it (run-time ids)",
    HOp.H_MOE_COMBINE: "weighted sum of the routed experts (+ shared) added into h",
}

_NAMES = {op: tuple(n for n, _ in ops) for op, ops in OPERANDS.items()}
MATVEC_HOPS = (HOp.H_GATEUP, HOp.H_LMHEAD, HOp.H_QKV, HOp.H_GDN_PROJ, HOp.H_UP_RELU2)
EXPERT_HOPS = (HOp.H_EXPERT_GATEUP, HOp.H_EXPERT_DOWN)
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
