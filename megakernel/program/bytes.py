"""Bytes one decode step moves, by category, from the blocks' own accounting (layers `step_bytes`).

Categories: `weights` (every packed matrix once; the embedding only for the N gathered rows; a
recurrent core's per-sequence weights once per sequence), `expert` (routed experts, weighted by the
chance a token picks them), `kv_read` / `kv_written` (KV or latent cache), `state_read` /
`state_written`, `conv_read` / `conv_written`, `ring_read` / `ring_written` (ReplaySSM).

The instructions carry the read side as `w_bytes` + `hbm_bytes` (cost.step_bytes); the categories
recompute it from the configuration so that the two can be checked against each other, and add the
write side the cost model's floor counts (cost.written_bytes).
"""

from __future__ import annotations

from megakernel import isa
from megakernel.layers import kind

CATEGORIES = ("weights", "expert", "kv_read", "kv_written", "state_read", "state_written",
              "conv_read", "conv_written", "ring_read", "ring_written")


def step_bytes_by_category(prog) -> dict[str, float]:  # noqa: ANN001 (compiler.Program)
    """Bytes per step by category (module docstring); `read`, `written` and `total` added."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    cfg = prog.cfg
    # matrices streamed as slabs: the instructions' slabs, which the verifier checks cover every
    # packed matrix exactly once per step (routed experts are weighted by the expected share)
    for ins in prog.instrs:
        if isa.spec(ins.op).slab:
            out["expert" if isa.spec(ins.op).kind == "moe" else "weights"] += ins.w_bytes
    out["weights"] += prog.rows * cfg.hidden_size * 2  # embedding rows
    for blk in cfg.blocks:
        for k, v in kind(blk.kind).step_bytes(blk, prog).items():
            out[k] += v
    out["read"] = sum(v for k, v in out.items() if k in CATEGORIES and not k.endswith("written"))
    out["written"] = sum(v for k, v in out.items() if k.endswith("_written"))
    out["total"] = out["read"] + out["written"]
    return out
