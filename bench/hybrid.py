"""Hybrid models, recurrent update vs ReplaySSM: predicted bytes and step time per decode step.

For each real-shaped hybrid preset and batch size, both modes of the recurrent layers (recurrent
update; ReplaySSM folding every L tokens) are accounted by megakernel/program/hybrid_cost.py:
bytes by kind (weights, MoE experts, KV / MLA latent cache, recurrent state read and written,
ReplaySSM ring, conv window) and the step time. Rows come from one of two sources:

- compiled: the whole program is compiled and scheduled with the cost model;
  bytes = `hybrid_bytes(prog)`, predicted = the cost model's replay (`hybrid_report`).
- analytic: the compile is refused at plan time (the fp32 state arena overflows the int32
  STATE_NUMEL header field) or too slow for a bench (`--compile-max-batch`). The bytes are still
  `hybrid_bytes`, evaluated on a stand-in program: the instructions of a batch-1 compile without
  the cost model (matrix slabs are the same at every batch), with each MoE expert slab
  re-weighted by the chance that one of the N rows picks it (the compiler's own rule). Only the
  copy-bandwidth floor (bytes / copy bandwidth) is given as a time; no schedule exists.

Every compiled row is also recomputed the analytic way and the two must agree byte for byte.

    python bench/hybrid.py [--models a,b] [--batches 1,8,64,256] [--replay-window 16]
                           [--gpu h200] [--context 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.hybrid.config import HybridConfig, preset  # noqa: E402
from megakernel.program.compiler import PlanError  # noqa: E402
from megakernel.program.gpus import GPU, gpu  # noqa: E402
from megakernel.program.hybrid_compiler import (  # noqa: E402
    HybridProgram,
    compile_hybrid,
    core_weight_bytes,
    plan_buffers,
    recurrent_shape,
    validate,
)
from megakernel.program.hybrid_cost import HybridBytes, hybrid_bytes, hybrid_report  # noqa: E402
from megakernel.program.hybrid_isa import EXPERT_HOPS  # noqa: E402

DEFAULT_MODELS = ("qwen3.5-0.8b", "qwen3.5-9b", "nemotron-h-8b", "kimi-linear-48b-a3b")
# the cost-model scheduler places ~100k instructions for Kimi's 256 experts x 8 slabs x 26
# layers: ~30 s per compile at batch 1, ~60 s at 256; other models take a few seconds
COMPILE_MAX_BATCH = {"kimi-linear-48b-a3b": 1}  # others: 256 (MAX_ROWS)
INT32_MAX = 2**31 - 1
KINDS = ("weights", "per_seq_weights", "expert", "kv", "state_read", "state_written", "ring",
         "conv")


@dataclass
class Row:
    model: str
    batch: int
    mode: str  # "recurrent" | "replay L=<L>"
    source: str  # "compiled" | "analytic (<why>)"
    bytes: HybridBytes
    floor_s: float
    predicted_s: float | None  # cost-model replay; None when not compiled
    compile_s: float | None = None

    def split(self) -> dict[str, int]:
        """The table's columns: bytes per step by kind, read + written where both exist; the
        weights split into matrices read once and the reads that grow with the batch."""
        b = self.bytes
        per_seq = per_sequence_weight_bytes(preset(self.model), self.batch)
        return dict(weights=b.weights - per_seq, per_seq_weights=per_seq, expert=b.expert,
                    kv=b.kv_read + b.kv_written,
                    state_read=b.state_read, state_written=b.state_written,
                    ring=b.ring_read + b.ring_written, conv=b.conv_read + b.conv_written)

    def as_dict(self) -> dict:
        return dict(model=self.model, batch=self.batch, mode=self.mode, source=self.source,
                    bytes=self.bytes.as_dict(), split=self.split(), floor_us=self.floor_s * 1e6,
                    predicted_us=None if self.predicted_s is None else self.predicted_s * 1e6,
                    compile_s=self.compile_s)


def per_sequence_weight_bytes(cfg: HybridConfig, batch: int, tokens: int = 1) -> int:
    """The part of hybrid_bytes' weights that grows with the batch: the N embedding rows, each
    recurrent core's conv taps (+ Mamba2 bias, KDA f_b / g_b rows) once per sequence, and MLA's
    kv_b once per sequence (same terms as hybrid_bytes)."""
    rs = recurrent_shape(cfg)
    out = batch * tokens * cfg.hidden_size * 2
    out += batch * rs.units * len(cfg.recurrent_layers()) * core_weight_bytes(cfg)
    n_mla = cfg.layer_types.count("mla")
    if n_mla:
        m = cfg.mla  # type: ignore[attr-defined]
        out += n_mla * batch * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) \
            * m.kv_lora_rank * 2
    return out


def _expert_share(cfg: HybridConfig, expert: int, n: int) -> float:
    """The compiler's rule: a routed expert's slabs are streamed with probability
    1 - (1 - top_k / E)^N; the shared expert (index E) always."""
    e = cfg.moe  # type: ignore[attr-defined]
    return 1.0 if expert == e.num_experts else 1.0 - (1.0 - e.top_k / e.num_experts) ** n


def analytic_bytes(base: HybridProgram, batch: int, tokens: int = 1,
                   replay_window: int | None = None) -> HybridBytes:
    """`hybrid_bytes` at (batch, tokens, replay_window) from a program compiled at any batch.

    Matrix slabs do not depend on the batch; MoE expert slabs are re-weighted for N = batch *
    tokens rows exactly as the compiler weights them. Everything else hybrid_bytes derives from
    the configuration.
    """
    n = batch * tokens
    instrs = []
    for ins in base.instrs:
        w = ins.w_bytes
        if ins.op in EXPERT_HOPS:
            full = ins.operands["NROWS"] * ins.operands["K"] * 2  # bf16 slab
            w = int(full * _expert_share(base.cfg, ins.operands["EXPERT"], n))
        instrs.append(SimpleNamespace(op=ins.op, w_bytes=w))
    stand_in = SimpleNamespace(cfg=base.cfg, batch=batch, tokens=tokens, instrs=instrs,
                               replay_window=replay_window, context=base.context)
    return hybrid_bytes(stand_in)  # type: ignore[arg-type]


def refusal(cfg: HybridConfig, batch: int, g: GPU, replay_window: int | None,
            tokens: int = 1, max_seq_len: int | None = None) -> str | None:
    """Why the compiler would refuse this plan (checked cheaply, before scheduling), or None."""
    if max_seq_len is None:
        max_seq_len = min(cfg.max_position_embeddings, 4096)  # compile_hybrid's default
    try:
        q = validate(cfg, batch, tokens, max_seq_len)
    except PlanError as e:
        return str(e)
    buf = plan_buffers(q, batch, tokens, max_seq_len, g.num_sms, replay_window)
    if buf.state_numel > INT32_MAX:
        return f"state arena {buf.state_numel / 1e9:.2f}G fp32 > int32 STATE_NUMEL"
    return None


def bench_model(name: str, batches: list[int], g: GPU, replay_window: int,
                context: int | None, compile_max_batch: int | None) -> list[Row]:
    cfg = preset(name)
    limit = COMPILE_MAX_BATCH.get(name, 256) if compile_max_batch is None else compile_max_batch
    base = compile_hybrid(cfg, 1, g, context=context, policy="structure")
    rows = []
    for b in batches:
        for L in (None, replay_window):
            mode = "recurrent" if L is None else f"replay L={L}"
            hb = analytic_bytes(base, b, replay_window=L)
            why = refusal(cfg, b, g, L)
            if why is None and b > limit:
                why = f"compile > {limit} rows too slow for a bench"
            if why is not None:
                rows.append(Row(name, b, mode, f"analytic ({why})", hb, hb.total / g.copy_bw,
                                None))
                continue
            t0 = time.perf_counter()
            prog = compile_hybrid(cfg, b, g, context=context, replay_window=L)
            dt = time.perf_counter() - t0
            hc = hybrid_bytes(prog)
            if hc != hb:
                raise AssertionError(f"{name} B={b} {mode}: analytic bytes {hb} != compiled {hc}")
            r = hybrid_report(prog)
            if r.bytes_per_step != hc.total:
                raise AssertionError(f"{name} B={b} {mode}: report counts {r.bytes_per_step} "
                                     f"bytes, hybrid_bytes {hc.total}")
            rows.append(Row(name, b, mode, "compiled", hc, r.floor_s, r.predicted_s, dt))
    return rows


def _gb(x: int) -> str:
    return f"{x / 1e9:.3f}"


def markdown(rows: list[Row]) -> str:
    """One line per (model, batch, mode); the ReplaySSM line carries recurrent / ReplaySSM."""
    head = ("| model | B | mode | weights once | per-seq weights | experts | KV/latent r+w "
            "| state read | state written | ring r+w | conv r+w | total GB | floor us "
            "| predicted us | bytes ratio | time ratio | source |")
    out = [head, "|---" * (head.count("|") - 1) + "|"]
    prev: Row | None = None
    for r in rows:
        s = r.split()
        ratio_b = ratio_t = ""
        if r.mode != "recurrent" and prev is not None and prev.model == r.model \
                and prev.batch == r.batch:
            ratio_b = f"{prev.bytes.total / r.bytes.total:.2f}x"
            if prev.predicted_s is not None and r.predicted_s is not None:
                ratio_t = f"{prev.predicted_s / r.predicted_s:.2f}x"
            else:
                ratio_t = f"{prev.floor_s / r.floor_s:.2f}x (floor)"
        pred = "-" if r.predicted_s is None else f"{r.predicted_s * 1e6:.0f}"
        out.append(f"| {r.model} | {r.batch} | {r.mode} | "
                   + " | ".join(_gb(s[k]) for k in KINDS)
                   + f" | {_gb(r.bytes.total)} | {r.floor_s * 1e6:.0f} | {pred} | {ratio_b} | "
                     f"{ratio_t} | {r.source} |")
        prev = r
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--replay-window", type=int, default=16, help="ReplaySSM fold window L")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--context", type=int, default=None, help="cached tokens (default 1024)")
    ap.add_argument("--compile-max-batch", type=int, default=None,
                    help="largest batch compiled with the cost model; above it rows are "
                         "analytic (default 256, Kimi Linear 1)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.replay_window < 1:
        ap.error(f"--replay-window must be >= 1, got {args.replay_window}")
    t0 = time.perf_counter()
    g = gpu(args.gpu)
    batches = [int(x) for x in args.batches.split(",")]
    rows: list[Row] = []
    for m in args.models.split(","):
        rows += bench_model(m, batches, g, args.replay_window, args.context,
                            args.compile_max_batch)
        print(f"[{m} done at {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    print(f"{g.name}: bytes per decode step in GB (1e9), context "
          f"{args.context if args.context is not None else 'default (1024)'} cached tokens, "
          f"fp32 state, ReplaySSM L = {args.replay_window}\n")
    print(markdown(rows))
    wall = time.perf_counter() - t0
    print(f"\nruntime {wall:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(gpu=args.gpu, replay_window=args.replay_window,
                                                   runtime_s=wall,
                                                   rows=[r.as_dict() for r in rows]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
