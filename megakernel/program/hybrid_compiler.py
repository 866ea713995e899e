"""Hybrid program compiler (Qwen3.5, Nemotron-H, Kimi Linear): stages -> instructions -> schedule.

The same machinery as the dense compiler (compiler.py): a step is a list of `Stage`s whose work
units become `Instr`s; every instruction waits for the whole stage that produces its input (one
counter) and signals its own stage's counter; schedule.py cuts divisible (matvec) stages into one
slab per SM and places the rest unit by unit with the cost model in the loop. Stages:

    EMBED
    per recurrent layer:  H_GDN_PROJ (rows of the fused input projection) -> H_GDN_CORE /
                          H_GDN_REPLAY (sequence, key head), H_MAMBA_CORE / H_MAMBA_REPLAY
                          (sequence, group) or H_KDA_CORE / H_KDA_REPLAY (sequence, head)
                          -> OPROJ (out_proj, added into h)
    per attention layer:  H_QKV (head slots of a kv group) -> H_ATTN (sequence, kv head)
                          -> OPROJ (o_proj, added into h)
    Kimi MLA layer:       H_GDN_PROJ ([q | latent | k_rope] rows) -> H_MLA (sequence) -> OPROJ
    Qwen3.5, per layer:   H_GATEUP -> DOWN (SwiGLU after every mixer)
    Kimi, per layer:      H_GATEUP -> DOWN (first_k_dense layers), else H_ROUTER -> per expert
                          (routed ones and the shared one) H_EXPERT_GATEUP slabs -> per expert
                          H_EXPERT_DOWN slabs -> H_MOE_COMBINE (added into h); which experts do
                          work is decided at run time by the router's ids
    Nemotron-H MLP layer: H_UP_RELU2 -> DOWN
    H_LMHEAD -> ARGMAX

Recurrent layers run the recurrent update, or ReplaySSM with fold window L (`replay_window`):
every step's T tokens are committed, the ring holds L - 1 + T entries. Records and buffers:
hybrid_isa.py. Queues hold instructions in stage order and every wait names an earlier stage's
counter, so the program cannot deadlock.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import torch

from megakernel.hybrid.config import HybridConfig, KimiLinearConfig, NemotronHConfig, Qwen35Config
from megakernel.program import hybrid_isa, isa
from megakernel.program.compiler import (
    BufferPlan,
    Counter,
    Instr,
    PlanError,
    QueueProgram,
    Region,
    Stage,
    _Counters,
    embed_stage,
)
from megakernel.program.gpus import GPU
from megakernel.program.hybrid_isa import HOp
from megakernel.program.hybrid_pack import gdn_proj_width, hybrid_layout, require_supported
from megakernel.program.isa import Op
from megakernel.program.pack import WeightLayout

F32_CONSTANTS = ("rope_cos", "rope_sin", "ssm_params", "router")
EXPERT_SLABS = 8  # at most this many slabs per expert matrix


@dataclass
class HybridBufferPlan(BufferPlan):
    """The dense plan's typed arenas and KV cache (kv_shape [La, B, Hkv, S_max, D], attention
    layers only), plus the persistent fp32 state arena."""

    state_numel: int
    conv: dict[int, Region]  # recurrent layer -> conv window [B, C, K-1] in the state arena
    state: dict[int, Region]  # recurrent layer -> state [B, *state] in the state arena
    kv_slot: dict[int, int]  # attention layer -> KV cache slot
    ssm_index: dict[int, int]  # recurrent layer -> row of ssm_params / ring_count
    ring: dict[int, dict[str, Region]]  # recurrent layer -> ReplaySSM ring (state arena)
    ring_cap: int = 0  # ring entries per (layer, sequence); 0: recurrent update
    v_shape: tuple[int, ...] = ()  # the v cache (MLA: k_rope [La, B, 1, S_max, dr]); () = kv_shape
    moe_index: dict[int, int] = field(default_factory=dict)  # MoE layer -> row of router

    @property
    def kv_bytes(self) -> int:
        return 2 * (math.prod(self.kv_shape) + math.prod(self.v_shape or self.kv_shape))

    @property
    def state_bytes(self) -> int:
        return 4 * self.state_numel


@dataclass
class HybridProgram(QueueProgram):
    cfg: HybridConfig
    batch: int
    tokens: int
    max_seq_len: int
    gpu: GPU
    context: int
    layout: WeightLayout
    buffers: HybridBufferPlan
    counters: list[Counter]
    instrs: list[Instr]
    queues: list[list[int]]
    policy: str
    replay_window: int | None = None
    header: dict[str, int] = field(default_factory=dict)
    placement_cost: object | None = None  # cost.SimState of the chosen schedule

    encode = staticmethod(hybrid_isa.encode)


# ---- validation and buffers ---------------------------------------------------------------------
@dataclass(frozen=True)
class RecurrentShape:
    """What the buffer plan and the stages need to know about a family's recurrent layers."""

    kind: str  # "gdn" | "mamba2"
    units: int  # instructions per sequence: key heads (GDN) or groups (Mamba2)
    heads: int  # value heads (GDN) or heads (Mamba2)
    conv_dim: int
    conv_kernel: int
    state: tuple[int, ...]  # per sequence: [Hv, dk, dv] or [H, P, N]
    ring: tuple[tuple[str, tuple[int, ...]], ...]  # per entry: name, shape
    out_dim: int  # the gated-norm output feeding out_proj
    n_params: int  # fp32 parameters per layer: A_log, dt_bias (GDN), A_log, D, dt_bias (Mamba2),
    # A_log [H], dt_bias [H d] (KDA)


def recurrent_shape(cfg: HybridConfig) -> RecurrentShape:
    if isinstance(cfg, KimiLinearConfig):
        k = cfg.kda
        hd = (k.num_heads, k.head_dim)
        return RecurrentShape("kda", k.num_heads, k.num_heads, k.conv_dim, k.conv_kernel,
                              (k.num_heads, k.head_dim, k.head_dim),
                              (("k", hd), ("u", hd), ("g", hd)), k.qkv_dim,
                              k.num_heads + k.qkv_dim)
    if isinstance(cfg, NemotronHConfig):
        m = cfg.mamba2
        return RecurrentShape("mamba2", m.n_groups, m.num_heads, m.conv_dim, m.conv_kernel,
                              (m.num_heads, m.head_dim, m.state_size),
                              (("x", (m.num_heads, m.head_dim)), ("B", (m.n_groups, m.state_size)),
                               ("dt", (m.num_heads,))), m.d_inner, 3 * m.num_heads)
    g = cfg.gdn  # type: ignore[attr-defined]
    return RecurrentShape("gdn", g.num_k_heads, g.num_v_heads, g.conv_dim, g.conv_kernel,
                          (g.num_v_heads, g.k_head_dim, g.v_head_dim),
                          (("k", (g.num_k_heads, g.k_head_dim)),
                           ("u", (g.num_v_heads, g.v_head_dim)), ("g", (g.num_v_heads,))),
                          g.value_dim, 2 * g.num_v_heads)


def core_weight_bytes(cfg: HybridConfig) -> int:
    """Weight bytes one recurrent-core instruction (one unit of one sequence) streams: its conv
    taps (+ Mamba2 bias), and for KDA its head's rows of the low-rank f_b and g_b."""
    rs = recurrent_shape(cfg)
    ch = rs.conv_dim // rs.units
    taps = rs.conv_kernel + (1 if rs.kind == "mamba2" else 0)
    extra = 2 * cfg.kda.head_dim ** 2 if rs.kind == "kda" else 0  # type: ignore[attr-defined]
    return (ch * taps + extra) * 2


def validate(cfg: HybridConfig, batch: int, tokens: int, max_seq_len: int) -> HybridConfig:
    require_supported(cfg)
    if batch < 1 or tokens < 1:
        raise PlanError(f"batch and tokens per step must be >= 1, got {batch}, {tokens}")
    if batch * tokens > isa.MAX_ROWS:
        raise PlanError(f"batch * tokens = {batch * tokens} activation rows; at most "
                        f"{isa.MAX_ROWS} per step")
    checks = [("hidden_size", cfg.hidden_size),
              ("intermediate_size", cfg.intermediate_size),  # type: ignore[attr-defined]
              ("vocab_size", cfg.vocab_size)]
    if isinstance(cfg, KimiLinearConfig):
        checks.append(("expert intermediate_size", cfg.moe.intermediate_size))
    else:
        checks.append(("attention head_dim", cfg.attention.head_dim))  # type: ignore[attr-defined]
    for what, v in checks:
        if v % isa.ROW_ALIGN:
            raise PlanError(f"{what} = {v} must be a multiple of {isa.ROW_ALIGN} for the tiling")
    if not 1 <= max_seq_len <= cfg.max_position_embeddings:
        raise PlanError(f"max sequence length {max_seq_len} must be in [1, "
                        f"{cfg.max_position_embeddings}]")
    if tokens > max_seq_len:
        raise PlanError(f"{tokens} tokens per step do not fit {max_seq_len} positions")
    return cfg


def plan_buffers(cfg: HybridConfig, batch: int, tokens: int, max_seq_len: int, max_lm_tiles: int,
                 replay_window: int | None = None) -> HybridBufferPlan:
    n, h = batch * tokens, cfg.hidden_size
    rs = recurrent_shape(cfg)
    rec_layers = cfg.recurrent_layers()
    attn_layers = [i for i, t in enumerate(cfg.layer_types) if t in ("attention", "mla")]
    kimi = isinstance(cfg, KimiLinearConfig)
    moe_layers = [i for i in range(cfg.num_layers) if cfg.ffn_type(i) == "moe"]
    if kimi:  # MLA: q [N, H, dn + dr], output [N, H dv], latent cache c, k_rope
        m, e = cfg.mla, cfg.moe
        q_shape, att_cols = (m.num_heads, m.qk_head_dim), m.num_heads * m.v_head_dim
        n_att = max(1, len(attn_layers))
        kv = (n_att, batch, 1, max_seq_len, m.kv_lora_rank)
        v_shape: tuple[int, ...] = (n_att, batch, 1, max_seq_len, m.qk_rope_head_dim)
        rot, topk, n_exp, inter_e, shared = 0, e.top_k, e.num_experts, e.intermediate_size, \
            e.num_shared_experts
    else:
        a = cfg.attention  # type: ignore[attr-defined]
        q_shape, att_cols = (a.num_heads, a.head_dim), a.num_heads * a.head_dim
        kv = (max(1, len(attn_layers)), batch, a.num_kv_heads, max_seq_len, a.head_dim)
        v_shape = ()
        rot, topk, n_exp, inter_e, shared = a.rotary_dim, 1, 1, 1, 0

    def arena(items: list[tuple[str, tuple[int, ...]]]) -> tuple[dict[str, Region], int]:
        out, off = {}, 0
        for name, shape in items:
            off = (off + 63) // 64 * 64
            out[name] = Region(off, shape)
            off += math.prod(shape)
        return out, (off + 63) // 64 * 64

    half = max(1, rot // 2)
    f32, f32_n = arena([
        ("h", (n, h)),
        ("proj", (n, gdn_proj_width(cfg))),
        ("gate", (n, *q_shape)),
        ("logits", (n, cfg.vocab_size)),
        ("part_argmax", (max_lm_tiles, n, 2)),
        ("rope_cos", (max_seq_len, half)),
        ("rope_sin", (max_seq_len, half)),
        ("ssm_params", (max(1, len(rec_layers)), rs.n_params)),
        ("router", (max(1, len(moe_layers)), n_exp * h + n_exp)),
        ("moe_w", (n, topk)),
        ("moe_y", (n, topk + shared, h)),
    ])
    bf16, bf16_n = arena([
        ("q", (n, *q_shape)),
        ("attn", (n, att_cols)),
        ("ssm_out", (n, rs.out_dim)),
        ("act", (n, cfg.intermediate_size)),  # type: ignore[attr-defined]
        ("act_moe", (n, topk + shared, inter_e)),
    ])
    i32, i32_n = arena([("tokens_in", (n,)), ("tokens_out", (n,)), ("lengths", (batch,)),
                        ("ring_count", (max(1, len(rec_layers)), batch, rs.units)),
                        ("moe_ids", (n, topk))])
    cap = replay_window - 1 + tokens if replay_window else 0
    conv, state, ring, off = {}, {}, {}, 0
    for i in rec_layers:
        conv[i] = Region(off, (batch, rs.conv_dim, rs.conv_kernel - 1))
        off += conv[i].numel
        state[i] = Region(off, (batch, *rs.state))
        off += state[i].numel
        if cap:
            ring[i] = {}
            for name, shape in rs.ring:
                ring[i][name] = Region(off, (batch, cap, *shape))
                off += ring[i][name].numel
    return HybridBufferPlan(f32, bf16, i32, f32_n, bf16_n, i32_n, kv, off, conv, state,
                            {i: s for s, i in enumerate(attn_layers)},
                            {i: s for s, i in enumerate(rec_layers)}, ring, cap, v_shape,
                            {i: s for s, i in enumerate(moe_layers)})


def rope_tables(cfg: HybridConfig, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S_max, R/2] fp32 from float64 angles (the reference's recipe)."""
    freqs = [] if isinstance(cfg, KimiLinearConfig) else cfg.attention.inv_freq()  # type: ignore
    inv = torch.tensor(freqs, dtype=torch.float64)
    if inv.numel() == 0:
        z = torch.zeros(max_seq_len, 1)
        return z, z
    ang = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv
    return ang.cos().to(torch.float32), ang.sin().to(torch.float32)


# ---- stages -------------------------------------------------------------------------------------
def stages(cfg: HybridConfig, batch: int, tokens: int, context: int, lay: WeightLayout,
           buf: HybridBufferPlan, ctr: _Counters, replay_window: int | None = None
           ) -> list[Stage]:
    n, hid = batch * tokens, cfg.hidden_size
    inter = cfg.intermediate_size  # type: ignore[attr-defined]
    rs = recurrent_shape(cfg)
    qwen = isinstance(cfg, Qwen35Config)
    kimi = isinstance(cfg, KimiLinearConfig)
    if not kimi:
        a = cfg.attention  # type: ignore[attr-defined]
        d, hq, hkv = a.head_dim, a.num_heads, a.num_kv_heads
        grp = hq // hkv
    f32, bf, i32 = buf.f32, buf.bf16, buf.i32
    ra = isa.ROW_ALIGN
    npad = -(-n // 8) * 8
    out: list[Stage] = []

    def flops(rows: int, k: int) -> float:
        return 2.0 * npad * rows * k

    def matvec(op: Op | HOp, layer: int, key: str, r0: int, rows: int, k: int, norm: str | None,
               in_off: int, out_off: int, wait: int, signal: int, store: int, **extra: int
               ) -> Instr:
        norm_off = lay[norm].offset if norm else -1
        act_bytes = n * k * 4 + k * 2 if norm else n * k * 2
        return Instr(op, layer, dict(W=lay[key].offset + r0 * k, ROW0=r0, NROWS=rows, K=k,
                                     NORM_OFF=norm_off, IN_OFF=in_off, OUT_OFF=out_off, **extra),
                     wait=wait, signal=signal, w_bytes=rows * k * 2, l2_bytes=act_bytes,
                     store_bytes=store, tensor_flops=flops(rows, k))

    out.append(embed_stage(n, hid, lay, buf, ctr))
    prev = ctr("embed")
    pw = gdn_proj_width(cfg)
    # per recurrent unit (key head / group): state, window, ring entry and conv-tap bytes
    st_bytes = math.prod(rs.state) // rs.units * 4
    ch = rs.conv_dim // rs.units if rs.kind == "mamba2" else None
    if rs.kind == "gdn":
        g_ = cfg.gdn  # type: ignore[attr-defined]
        rep = g_.num_v_heads // g_.num_k_heads
        ch = 2 * g_.k_head_dim + rep * g_.v_head_dim
        entry = (g_.k_head_dim + rep * (g_.v_head_dim + 1)) * 4
    elif rs.kind == "mamba2":
        m = cfg.mamba2  # type: ignore[attr-defined]
        rep = m.num_heads // m.n_groups
        entry = (rep * m.head_dim + m.state_size + rep) * 4
    else:
        rep, kd_ = 1, cfg.kda.head_dim  # type: ignore[attr-defined]
        ch, entry = 3 * kd_, 3 * kd_ * 4
    win_bytes = ch * (rs.conv_kernel - 1) * 4
    unit_w = core_weight_bytes(cfg)
    core_op = {("gdn", False): HOp.H_GDN_CORE, ("gdn", True): HOp.H_GDN_REPLAY,
               ("mamba2", False): HOp.H_MAMBA_CORE, ("mamba2", True): HOp.H_MAMBA_REPLAY,
               ("kda", False): HOp.H_KDA_CORE,
               ("kda", True): HOp.H_KDA_REPLAY}[rs.kind, bool(replay_window)]
    unit_name = {"gdn": "K_HEAD", "mamba2": "GROUP", "kda": "HEAD"}[rs.kind]
    norm_key = {"gdn": "gdn_norm", "mamba2": "ssm_norm", "kda": "kda_norm"}[rs.kind]
    for layer, kind in enumerate(cfg.layer_types):
        L = f"L{layer}"
        if kind == "mlp" and not qwen:  # Nemotron-H relu^2 MLP block
            c_up, c_dn = ctr(f"{L}.up"), ctr(f"{L}.down")

            def mk_up(u0: int, u1: int, layer=layer, L=L, wait=prev, c_up=c_up) -> Instr:
                r0, rows = u0 * ra, (u1 - u0) * ra
                return matvec(HOp.H_UP_RELU2, layer, f"{L}.up", r0, rows, hid, f"{L}.in_norm",
                              f32["h"].offset, bf["act"].offset, wait, c_up, n * rows * 2)

            out.append(Stage(f"{L}.up", HOp.H_UP_RELU2, layer, inter // ra, True, mk_up, ra))

            def mk_dn(u0: int, u1: int, layer=layer, L=L, c_up=c_up, c_dn=c_dn) -> Instr:
                r0, rows = u0 * ra, (u1 - u0) * ra
                return matvec(Op.DOWN, layer, f"{L}.down", r0, rows, inter, None,
                              bf["act"].offset, f32["h"].offset, c_up, c_dn, n * rows * 4)

            out.append(Stage(f"{L}.down", Op.DOWN, layer, hid // ra, True, mk_dn, ra))
            prev = c_dn
            continue
        c_o = ctr(f"{L}.oproj")
        if kind in ("gdn", "mamba2", "kda", "mla"):
            c_p = ctr(f"{L}.proj")
            key = f"{L}.gdn_proj" if qwen else f"{L}.mix_proj" if kimi else f"{L}.ssm_proj"

            def mk_proj(u0: int, u1: int, layer=layer, L=L, wait=prev, c_p=c_p, key=key
                        ) -> Instr:
                r0, rows = u0 * ra, (u1 - u0) * ra
                return matvec(HOp.H_GDN_PROJ, layer, key, r0, rows, hid, f"{L}.in_norm",
                              f32["h"].offset, f32["proj"].offset, wait, c_p, n * rows * 4,
                              OUT_W=pw)

            out.append(Stage(f"{L}.proj", HOp.H_GDN_PROJ, layer, pw // ra, True, mk_proj, ra))
        if kind == "mla":
            ml = cfg.mla  # type: ignore[attr-defined]
            c_attn, slot = ctr(f"{L}.attn"), buf.kv_slot[layer]
            kvb_rows = ml.qk_nope_head_dim + ml.v_head_dim  # per head
            keys = context + tokens

            def mk_mla(u0: int, u1: int, layer=layer, L=L, c_p=c_p, c_attn=c_attn, slot=slot,
                       keys=keys, ml=ml, kvb_rows=kvb_rows) -> Instr:
                lat = ml.kv_lora_rank + ml.qk_rope_head_dim
                b, h = divmod(u0, ml.num_heads)
                return Instr(HOp.H_MLA, layer, dict(
                    B_IDX=b, HEAD=h, PROJ_OFF=f32["proj"].offset, KVB_W=lay[f"{L}.kvb"].offset,
                    NORM_W=lay[f"{L}.lat_norm"].offset, KV_SLOT=slot,
                    LEN_OFF=i32["lengths"].offset, OUT_OFF=bf["attn"].offset),
                    wait=c_p, signal=c_attn,
                    # the first head of a sequence pulls the cached latents from HBM, the
                    # others find them in L2
                    w_bytes=(context * lat * 2 if h == 0 else 0) + kvb_rows * ml.kv_lora_rank * 2,
                    l2_bytes=tokens * (ml.qk_head_dim + lat) * 4 + (context * lat * 2 if h else 0),
                    store_bytes=tokens * ((lat if h == 0 else 0) + ml.v_head_dim) * 2,
                    fp32_flops=2.0 * keys * kvb_rows * ml.kv_lora_rank
                    + 4.0 * tokens * keys * ml.qk_head_dim)

            out.append(Stage(f"{L}.attn", HOp.H_MLA, layer, batch * ml.num_heads, False,
                             mk_mla))
            k_o, o_in, mix_wait = ml.num_heads * ml.v_head_dim, bf["attn"].offset, c_attn
        elif kind in ("gdn", "mamba2", "kda"):
            c_core = ctr(f"{L}.core")

            def mk_core(u0: int, u1: int, layer=layer, L=L, c_p=c_p, c_core=c_core) -> Instr:
                b, unit = divmod(u0, rs.units)
                gi = buf.ssm_index[layer]
                ops = {"B_IDX": b, unit_name: unit, "PROJ_OFF": f32["proj"].offset,
                       "CONV_W": lay[f"{L}.conv"].offset,
                       "PARAM_OFF": f32["ssm_params"].offset + gi * rs.n_params,
                       "NORM_W": lay[f"{L}.{norm_key}"].offset,
                       "STATE_OFF": buf.conv[layer].offset, "OUT_OFF": bf["ssm_out"].offset}
                if replay_window:
                    ops.update(WINDOW=replay_window, COUNT_OFF=i32["ring_count"].offset
                               + gi * batch * rs.units)
                    # committed state + on average (L - 1) / 2 ring entries are read before the
                    # wait; T entries are appended; the state is written at one step in L / T
                    pre = st_bytes + (replay_window - 1) * entry // 2
                    st_store = tokens * entry + st_bytes * min(1.0, tokens / replay_window)
                else:
                    pre, st_store = st_bytes, st_bytes
                out_cols = rs.out_dim // rs.units
                return Instr(core_op, layer, ops, wait=c_p, signal=c_core,
                             # state, ring and window do not depend on this step: prefetchable
                             w_bytes=pre + win_bytes + unit_w,
                             l2_bytes=tokens * (ch + out_cols + 2 * rep) * 4,
                             store_bytes=int(st_store) + win_bytes + tokens * out_cols * 2,
                             fp32_flops=tokens * (6.0 * st_bytes / 4 + 2.0 * ch * rs.conv_kernel))

            out.append(Stage(f"{L}.core", core_op, layer, batch * rs.units, False, mk_core))
            k_o, o_in, mix_wait = rs.out_dim, bf["ssm_out"].offset, c_core
        else:
            slots = 2 * grp + 2 if a.output_gate else grp + 2
            slot = buf.kv_slot[layer]
            c_attn = ctr(f"{L}.attn")
            qkn = lay[f"{L}.qk_norm"].offset if a.qk_norm else -1

            def mk_qkv(u0: int, u1: int, layer=layer, L=L, wait=prev, slots=slots, slot=slot,
                       qkn=qkn) -> Instr:
                g = u0 // slots
                assert (u1 - 1) // slots == g, "a QKV slab must stay within one kv group"
                return matvec(HOp.H_QKV, layer, f"{L}.qkv", u0 * d, (u1 - u0) * d, hid,
                              f"{L}.in_norm", f32["h"].offset, bf["q"].offset, wait,
                              ctr(f"{L}.qkv.g{g}"), n * (u1 - u0) * d * 4,
                              QK_NORM_OFF=qkn, KV_SLOT=slot)

            out.append(Stage(f"{L}.qkv", HOp.H_QKV, layer, hkv * slots, False, mk_qkv))
            keys = context + tokens
            gate_off = f32["gate"].offset if a.output_gate else -1

            def mk_attn(u0: int, u1: int, layer=layer, L=L, c_attn=c_attn, slot=slot,
                        keys=keys, gate_off=gate_off) -> Instr:
                b, g = divmod(u0, hkv)
                return Instr(HOp.H_ATTN, layer, dict(
                    B_IDX=b, KV_HEAD=g, KV_SLOT=slot, Q_OFF=bf["q"].offset,
                    GATE_OFF=gate_off, LEN_OFF=i32["lengths"].offset,
                    OUT_OFF=bf["attn"].offset),
                    wait=ctr(f"{L}.qkv.g{g}"), signal=c_attn, w_bytes=context * d * 4,
                    l2_bytes=tokens * grp * d * 6 + tokens * d * 4,
                    store_bytes=tokens * grp * d * 2, fp32_flops=4.0 * tokens * grp * keys * d)

            out.append(Stage(f"{L}.attn", HOp.H_ATTN, layer, batch * hkv, False, mk_attn))
            k_o, o_in, mix_wait = hq * d, bf["attn"].offset, c_attn

        def mk_o(u0: int, u1: int, layer=layer, L=L, k_o=k_o, o_in=o_in, wait=mix_wait, c_o=c_o
                 ) -> Instr:
            r0, rows = u0 * ra, (u1 - u0) * ra
            return matvec(Op.OPROJ, layer, f"{L}.o", r0, rows, k_o, None, o_in,
                          f32["h"].offset, wait, c_o, n * rows * 4)

        out.append(Stage(f"{L}.oproj", Op.OPROJ, layer, hid // ra, True, mk_o, ra))
        prev = c_o
        if isinstance(cfg, NemotronHConfig):
            continue
        if kimi and cfg.ffn_type(layer) == "moe":
            prev = _moe_stages(cfg, out, ctr, layer, c_o, n, lay, buf, flops)
            continue
        c_gu, c_dn = ctr(f"{L}.gateup"), ctr(f"{L}.down")
        gu = 2 * isa.GATEUP_BLOCK

        def mk_gu(u0: int, u1: int, layer=layer, L=L, c_o=c_o, c_gu=c_gu, gu=gu) -> Instr:
            r0, rows = u0 * gu, (u1 - u0) * gu
            return matvec(HOp.H_GATEUP, layer, f"{L}.gateup", r0, rows, hid, f"{L}.post_norm",
                          f32["h"].offset, bf["act"].offset, c_o, c_gu, n * rows)

        out.append(Stage(f"{L}.gateup", HOp.H_GATEUP, layer, 2 * inter // gu, True, mk_gu, gu))

        def mk_down(u0: int, u1: int, layer=layer, L=L, c_gu=c_gu, c_dn=c_dn) -> Instr:
            r0, rows = u0 * ra, (u1 - u0) * ra
            return matvec(Op.DOWN, layer, f"{L}.down", r0, rows, inter, None, bf["act"].offset,
                          f32["h"].offset, c_gu, c_dn, n * rows * 4)

        out.append(Stage(f"{L}.down", Op.DOWN, layer, hid // ra, True, mk_down, ra))
        prev = c_dn

    c_lm = ctr("lmhead")
    lm_key = "lm_head" if "lm_head" in lay.entries else "embed"

    def mk_lm(u0: int, u1: int, wait=prev) -> Instr:
        r0, rows = u0 * ra, (u1 - u0) * ra
        return matvec(HOp.H_LMHEAD, -1, lm_key, r0, rows, hid, "final_norm", f32["h"].offset,
                      f32["logits"].offset, wait, c_lm, n * rows * 4 + n * 8, TILE=-1,
                      PARG_OFF=f32["part_argmax"].offset)

    out.append(Stage("lmhead", HOp.H_LMHEAD, -1, cfg.vocab_size // ra, True, mk_lm, ra))
    flags = isa.FLAG_ADVANCE | (isa.FLAG_FEEDBACK if tokens == 1 else 0)

    def mk_argmax(u0: int, u1: int) -> Instr:
        nt = -(-cfg.vocab_size // ra)
        return Instr(Op.ARGMAX, -1, dict(
            N_TILES=nt, PARG_OFF=f32["part_argmax"].offset, OUT_OFF=i32["tokens_out"].offset,
            TOK_OFF=i32["tokens_in"].offset, LEN_OFF=i32["lengths"].offset, FLAGS=flags),
            wait=c_lm, l2_bytes=nt * n * 8, store_bytes=n * 8 + batch * 4)

    out.append(Stage("argmax", Op.ARGMAX, -1, 1, False, mk_argmax))
    return out


def _moe_stages(cfg: KimiLinearConfig, out: list[Stage], ctr: _Counters, layer: int, wait: int,
                n: int, lay: WeightLayout, buf: HybridBufferPlan, flops) -> int:  # noqa: ANN001
    """Router -> expert gate/up slabs -> expert down slabs -> combine (added into h)."""
    e, hid, L = cfg.moe, cfg.hidden_size, f"L{layer}"
    f32, bf, i32 = buf.f32, buf.bf16, buf.i32
    ra, gu = isa.ROW_ALIGN, 2 * isa.GATEUP_BLOCK
    n_exp = e.num_experts
    c_r, c_gu, c_dn, c_c = (ctr(f"{L}.router"), ctr(f"{L}.xgu"), ctr(f"{L}.xdn"),
                            ctr(f"{L}.down"))
    router = f32["router"].offset + buf.moe_index[layer] * (n_exp * hid + n_exp)

    def mk_router(u0: int, u1: int) -> Instr:
        return Instr(HOp.H_ROUTER, layer, dict(
            NORM_OFF=lay[f"{L}.post_norm"].offset, IN_OFF=f32["h"].offset, K=hid,
            ROUTER_OFF=router, IDS_OFF=i32["moe_ids"].offset, WTS_OFF=f32["moe_w"].offset),
            wait=wait, signal=c_r, w_bytes=(n_exp * hid + n_exp) * 4, l2_bytes=n * hid * 4,
            store_bytes=n * e.top_k * 8, fp32_flops=2.0 * n * n_exp * hid)

    out.append(Stage(f"{L}.router", HOp.H_ROUTER, layer, 1, False, mk_router))
    # expected share of a routed expert's slabs that is streamed: P(some token picks it)
    p_used = 1.0 - (1.0 - e.top_k / n_exp) ** n
    ie = e.intermediate_size
    experts = range(n_exp + e.num_shared_experts)

    def share(x: int) -> float:
        return 1.0 if x == n_exp else p_used

    def cut(rows: int, base: int) -> tuple[int, int]:
        """(units, rows per unit): an expert matrix is cut into at most EXPERT_SLABS slabs, so
        that hundreds of experts do not each become one slab per SM."""
        nb = rows // base
        k = max(x for x in range(1, EXPERT_SLABS + 1) if nb % x == 0)
        return k, rows // k

    gu_units, gu = cut(2 * ie, gu)
    dn_units, dn_rows = cut(hid, ra)

    for x in experts:
        def mk_gu(u0: int, u1: int, x=x) -> Instr:
            r0, rows = u0 * gu, (u1 - u0) * gu  # noqa: B023 (gu is fixed for the layer)
            return Instr(HOp.H_EXPERT_GATEUP, layer, dict(
                W=lay[f"{L}.x{x}.gateup"].offset + r0 * hid, ROW0=r0, NROWS=rows, K=hid,
                NORM_OFF=lay[f"{L}.post_norm"].offset, IN_OFF=f32["h"].offset,
                OUT_OFF=bf["act_moe"].offset, EXPERT=x, IDS_OFF=i32["moe_ids"].offset),
                wait=c_r, signal=c_gu, w_bytes=int(rows * hid * 2 * share(x)),
                l2_bytes=n * hid * 4, store_bytes=n * rows,
                tensor_flops=flops(rows, hid) * share(x))

        out.append(Stage(f"{L}.x{x}.gateup", HOp.H_EXPERT_GATEUP, layer, gu_units, True,
                         mk_gu, gu))
    for x in experts:
        def mk_dn(u0: int, u1: int, x=x) -> Instr:
            r0, rows = u0 * dn_rows, (u1 - u0) * dn_rows  # noqa: B023
            return Instr(HOp.H_EXPERT_DOWN, layer, dict(
                W=lay[f"{L}.x{x}.down"].offset + r0 * ie, ROW0=r0, NROWS=rows, K=ie,
                NORM_OFF=-1, IN_OFF=bf["act_moe"].offset, OUT_OFF=f32["moe_y"].offset,
                EXPERT=x, IDS_OFF=i32["moe_ids"].offset),
                wait=c_gu, signal=c_dn, w_bytes=int(rows * ie * 2 * share(x)),
                l2_bytes=n * ie * 2, store_bytes=n * rows * 4,
                tensor_flops=flops(rows, ie) * share(x))

        out.append(Stage(f"{L}.x{x}.down", HOp.H_EXPERT_DOWN, layer, dn_units, True, mk_dn,
                         dn_rows))

    def mk_comb(u0: int, u1: int) -> Instr:
        r0, rows = u0 * ra, (u1 - u0) * ra
        return Instr(HOp.H_MOE_COMBINE, layer, dict(
            ROW0=r0, NROWS=rows, Y_OFF=f32["moe_y"].offset, IDS_OFF=i32["moe_ids"].offset,
            WTS_OFF=f32["moe_w"].offset, OUT_OFF=f32["h"].offset),
            wait=c_dn, signal=c_c, l2_bytes=n * (e.top_k + 1) * rows * 4 + n * e.top_k * 8,
            store_bytes=n * rows * 4)

    out.append(Stage(f"{L}.combine", HOp.H_MOE_COMBINE, layer, hid // ra, True, mk_comb, ra))
    return c_c


# ---- the compiler -------------------------------------------------------------------------------
def compile_hybrid(cfg: HybridConfig, batch: int, gpu: GPU, tokens: int = 1,
                   max_seq_len: int | None = None, context: int | None = None,
                   policy: str = "cost", params=None,  # noqa: ANN001 (cost.CostParams)
                   replay_window: int | None = None) -> HybridProgram:
    """Compile one decode step of a hybrid model: recurrent update of its GDN layers, or
    ReplaySSM with fold window `replay_window` (every step's T tokens are committed)."""
    from megakernel.program import schedule

    if max_seq_len is None:
        max_seq_len = min(cfg.max_position_embeddings, 4096)
    q = validate(cfg, batch, tokens, max_seq_len)
    if context is None:
        context = min(1024, max_seq_len - tokens)
    if not 0 <= context <= max_seq_len - tokens:
        raise PlanError(f"context {context} + {tokens} new tokens does not fit max sequence "
                        f"length {max_seq_len}")
    if replay_window is not None and (not isinstance(replay_window, int) or replay_window < 1):
        raise PlanError(f"replay_window must be a positive integer, got {replay_window!r}")
    lay = hybrid_layout(q)
    buf = plan_buffers(q, batch, tokens, max_seq_len, gpu.num_sms, replay_window)
    best = None
    for instrs, queues, state in schedule.candidates(
            stages(q, batch, tokens, context, lay, buf, ctr := _Counters(), replay_window), gpu,
            policy, params):
        lm = [i for i in instrs if i.op == HOp.H_LMHEAD]
        if len(lm) > gpu.num_sms:
            raise PlanError(f"{len(lm)} LM-head slabs > {gpu.num_sms} partial-argmax slots")
        for t, ins in enumerate(lm):
            ins.operands["TILE"] = t
        for ins in instrs:
            if ins.op == Op.ARGMAX:
                ins.operands["N_TILES"] = len(lm)
        counters = [Counter(c.name) for c in ctr.list]
        for ins in instrs:
            if ins.signal != isa.NO_COUNTER:
                counters[ins.signal].total += 1
        prog = HybridProgram(q, batch, tokens, max_seq_len, gpu, context, lay, buf, counters,
                             instrs, queues, policy, replay_window)
        prog.placement_cost = state
        prog.header = make_header(prog)
        if best is None or (state is not None
                            and state.step_time() < best.placement_cost.step_time()):
            best = prog
    return best


def make_header(p: HybridProgram) -> dict[str, int]:
    c, b = p.cfg, p.buffers
    rs = recurrent_shape(c)
    kimi = isinstance(c, KimiLinearConfig)
    if kimi:
        m, e = c.mla, c.moe
        att = dict(HQ=m.num_heads, HKV=1, D=m.qk_head_dim, ROTARY_DIM=0, OUTPUT_GATE=0,
                   QK_NORM=0, MLA_R=m.kv_lora_rank, MLA_DR=m.qk_rope_head_dim,
                   MLA_DN=m.qk_nope_head_dim, MLA_DV=m.v_head_dim, MOE_E=e.num_experts,
                   MOE_TOPK=e.top_k, MOE_I=e.intermediate_size, MOE_N_GROUP=e.n_group,
                   MOE_TOPK_GROUP=e.topk_group, MOE_NORM=int(e.norm_topk_prob),
                   MOE_SHARED=e.num_shared_experts,
                   MOE_SCALE_F32_BITS=struct.unpack("<i", struct.pack(
                       "<f", e.routed_scaling_factor))[0])
    else:
        a = c.attention  # type: ignore[attr-defined]
        att = dict(HQ=a.num_heads, HKV=a.num_kv_heads, D=a.head_dim, ROTARY_DIM=a.rotary_dim,
                   OUTPUT_GATE=int(a.output_gate), QK_NORM=int(a.qk_norm))
    eps_bits = struct.unpack("<i", struct.pack("<f", c.rms_norm_eps))[0]
    hdr = dict(
        FORMAT_VERSION=isa.FORMAT_VERSION, HYBRID_FORMAT_VERSION=hybrid_isa.HYBRID_FORMAT_VERSION,
        NUM_SMS=p.num_sms, MAX_QUEUE=max((len(q) for q in p.queues), default=0) + 1,
        NUM_COUNTER_WORDS=p.counter_words(), B=p.batch, T=p.tokens, N=p.rows,
        L=c.num_layers, H=c.hidden_size, I=c.intermediate_size,  # type: ignore[attr-defined]
        V=c.vocab_size,
        **att, S_MAX=p.max_seq_len,
        SSM_UNITS=rs.units, SSM_HEADS=rs.heads, SSM_CONV_DIM=rs.conv_dim,
        SSM_CONV_K=rs.conv_kernel, SSM_PROJ_W=gdn_proj_width(c), SSM_OUT_DIM=rs.out_dim,
        NORM_KIND=hybrid_isa.NORM_1P if isinstance(c, Qwen35Config) else hybrid_isa.NORM_W,
        EPS_F32_BITS=eps_bits,
        REPLAY_WINDOW=p.replay_window or 0, RING_CAP=b.ring_cap,
        N_LM_TILES=sum(1 for i in p.instrs if i.op == HOp.H_LMHEAD),
        F32_NUMEL=b.f32_numel, BF16_NUMEL=b.bf16_numel, I32_NUMEL=b.i32_numel,
        STATE_NUMEL=b.state_numel,
    )
    for arena, regions in (("F32", b.f32), ("BF16", b.bf16), ("I32", b.i32)):
        for name, r in regions.items():
            hdr[f"{arena}_{name.upper()}_OFF"] = r.offset
    for k, v in hdr.items():
        if not -(1 << 31) <= v < (1 << 31):
            raise PlanError(f"header field {k}={v} does not fit in int32")
    return hdr
