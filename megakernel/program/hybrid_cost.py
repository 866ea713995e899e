"""Bytes a hybrid decode step moves, by kind, and its cost report (cost.py's model unchanged).

Per step (B sequences, T tokens each, N = B T rows, context c cached tokens per sequence):
- weights: every packed matrix once (embedding: only the N gathered rows; a recurrent core's
  conv taps (+ Mamba2 bias, + KDA's low-rank f_b, g_b rows) once per sequence);
- KV cache: attention layers read B Hkv c D keys and values (bf16) and write N Hkv D of each;
- recurrent state (fp32 per layer: GDN [B, Hv, dk, dv], Mamba2 [B, H, P, N]): the recurrent
  update reads and writes it every step; ReplaySSM reads the committed state and writes it only
  at a fold (one step in L / T);
- conv window (fp32 [B, C, K-1] per layer): read and written every step;
- ReplaySSM ring (fp32 per entry and sequence: GDN k [Hk dk], u [Hv dv], g [Hv]; Mamba2 x [H P],
  B [G N], dt [H]): on average (L - 1) / 2 committed entries read, T entries written per step;
- experts (Kimi MoE): each routed expert's slabs times the chance that at least one of the N
  tokens picks it, 1 - (1 - top_k / E)^N (the program streams an expert only when the router
  picked it), plus the shared expert; the router's fp32 weight counts as weights;
- MLA: the latent cache (c [r], k_rope [dr], bf16) as the KV cache, and kv_b once per sequence.
The scheduler's instructions carry the read side as `w_bytes` (prefetchable: weights, cached KV,
state, ring, window) and the write side in `store_bytes`; `hybrid_bytes` recomputes every kind
from the configuration so the two can be checked against each other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megakernel.program import cost
from megakernel.program.hybrid_compiler import HybridProgram, core_weight_bytes, recurrent_shape
from megakernel.program.hybrid_isa import EXPERT_HOPS, MATVEC_HOPS, HOp
from megakernel.program.isa import MATVEC_OPS


@dataclass(frozen=True)
class HybridBytes:
    weights: int
    kv_read: int
    kv_written: int
    state_read: int
    state_written: int
    conv_read: int
    conv_written: int
    ring_read: int
    ring_written: int
    expert: int = 0

    @property
    def read(self) -> int:
        return (self.weights + self.kv_read + self.state_read + self.conv_read + self.ring_read
                + self.expert)

    @property
    def written(self) -> int:
        return self.kv_written + self.state_written + self.conv_written + self.ring_written

    @property
    def total(self) -> int:
        return self.read + self.written

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"read": self.read, "written": self.written, "total": self.total}


def hybrid_bytes(prog: HybridProgram) -> HybridBytes:
    """Bytes per step by kind, from the configuration (see the module docstring)."""
    c, b, t = prog.cfg, prog.batch, prog.tokens
    n = b * t
    rs = recurrent_shape(c)
    types = c.layer_types
    n_attn, n_mla, n_rec = types.count("attention"), types.count("mla"), len(c.recurrent_layers())
    dense = MATVEC_OPS + MATVEC_HOPS + (HOp.H_ROUTER,)
    weights = sum(ins.w_bytes for ins in prog.instrs if ins.op in dense)
    expert = sum(ins.w_bytes for ins in prog.instrs if ins.op in EXPERT_HOPS)
    weights += n * c.hidden_size * 2  # embedding rows
    weights += b * rs.units * n_rec * core_weight_bytes(c)  # conv taps etc., per sequence
    if n_mla:
        m = c.mla  # type: ignore[attr-defined]
        kvb_rows = m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        weights += n_mla * b * kvb_rows * m.kv_lora_rank * 2  # kv_b, once per sequence
        kv_row, n_kv = (m.kv_lora_rank + m.qk_rope_head_dim) * 2, n_mla  # latent c, k_rope
    else:
        a = c.attention  # type: ignore[attr-defined]
        kv_row, n_kv = a.num_kv_heads * a.head_dim * 2 * 2, n_attn  # k and v, bf16
    state = b * math.prod(rs.state) * 4 * n_rec
    conv = b * rs.conv_dim * (rs.conv_kernel - 1) * 4 * n_rec
    entry_unit = sum(math.prod(s) for _, s in rs.ring) * 4 // rs.units  # one token, one unit
    L = prog.replay_window
    if L:
        ring_read = b * rs.units * n_rec * ((L - 1) * entry_unit // 2)
        ring_written = n * rs.units * n_rec * entry_unit
        state_written = int(state * min(1.0, t / L))
    else:
        ring_read = ring_written = 0
        state_written = state
    return HybridBytes(weights, n_kv * b * prog.context * kv_row, n_kv * n * kv_row, state,
                       state_written, conv, conv, ring_read, ring_written, expert)


def hybrid_report(prog: HybridProgram) -> cost.CostReport:
    """cost.report of the scheduler's placement; the floor counts every kind of bytes above
    (the instructions' prefetchable reads plus the state, ring, window and KV writes)."""
    if prog.placement_cost is None:
        raise ValueError("the program was scheduled without the cost model (policy "
                         f"{prog.policy!r}); compile with policy 'cost'")
    hb = hybrid_bytes(prog)
    return cost.report(prog.placement_cost, prog.instrs, prog.gpu, hb.written)
