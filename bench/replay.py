"""Hybrid models, recurrent update vs ReplaySSM: predicted bytes and step time per decode step.

For each real-shaped preset with recurrent layers and each batch size, both modes of the recurrent
layers (the recurrent update; ReplaySSM folding every L tokens, `replay_window=L`) are compiled by
the one compiler (`compile_program`) and accounted by `program/bytes.step_bytes_by_category`:
bytes by category (weights, MoE experts, KV / MLA latent cache, recurrent state read and written,
ReplaySSM ring, conv window) and the step time. Rows come from one of two sources:

- compiled: the whole program is compiled and scheduled with the cost model;
  bytes = `step_bytes_by_category(prog)`, predicted = the cost model's replay (`prog.cost`).
- analytic: the compiler refuses the plan (checked cheaply, before scheduling) or the compile is
  too slow for a bench (programs of more than SLOW_INSTRUCTIONS instructions at batch 1 are
  compiled at batch 1 only; `--compile-max-batch`). The bytes are still
  `step_bytes_by_category`, evaluated on a stand-in program: the instructions of a batch-1 compile
  without the cost model (matrix slabs are the same at every batch), with the MoE's work slots
  (their number grows with N) re-weighted by the expected routed experts of N rows (the
  compiler's own rule). Only the copy-bandwidth floor (bytes / copy bandwidth) is given as a
  time; no schedule exists.

Every compiled row is also recomputed the analytic way and the two must agree byte for byte.

    python bench/replay.py [--models a,b] [--batches 1,8,64,256] [--replay-window 16]
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

from megakernel import isa  # noqa: E402
from megakernel.cli.main import check_names  # noqa: E402
from megakernel.isa.stages import PlanError  # noqa: E402
from megakernel.layers import kind  # noqa: E402
from megakernel.layers.base import StepShape  # noqa: E402
from megakernel.layers.moe import SHARED  # noqa: E402
from megakernel.models import ModelConfig, preset, presets, real_presets  # noqa: E402
from megakernel.program.buffers import plan_buffers  # noqa: E402
from megakernel.program.bytes import step_bytes_by_category  # noqa: E402
from megakernel.program.compiler import (  # noqa: E402
    Program,
    check_memory,
    compile_program,
    default_splits,
    validate,
)
from megakernel.program.gpus import GPU, GPUS, gpu  # noqa: E402
from megakernel.program.pack import weight_layout  # noqa: E402

# a cost-model compile places every instruction on a simulated timeline. Programs of more than
# SLOW_INSTRUCTIONS instructions at batch 1 are compiled at batch 1 only (the dense-MLP hybrids
# have 9k-17k at batch 1 and up to 123k at batch 256, 30-55 s; Kimi Linear's work slots grow with
# the batch: ~16k instructions at batch 1)
SLOW_INSTRUCTIONS = 50_000
MAX_BATCH = isa.MAX_ROWS
KINDS = ("weights", "per_seq_weights", "expert", "kv", "state_read", "state_written", "ring",
         "conv")

Bytes = dict[str, int]  # step_bytes_by_category, integral


def recurrent_presets() -> list[str]:
    """The real-shaped presets with recurrent layers, in registry order."""
    return [n for n in real_presets() if preset(n).recurrent_layers()]


@dataclass
class Row:
    model: str
    batch: int
    mode: str  # "recurrent" | "replay L=<L>"
    source: str  # "compiled" | "analytic (<why>)"
    bytes: Bytes
    per_seq_weights: int  # the part of bytes["weights"] that grows with the batch
    floor_s: float
    predicted_s: float | None  # cost-model replay; None when not compiled
    compile_s: float | None = None

    def split(self) -> dict[str, int]:
        """The table's columns: bytes per step by kind, read + written where both exist; the
        weights split into matrices read once and the reads that grow with the batch."""
        b = self.bytes
        return dict(weights=b["weights"] - self.per_seq_weights,
                    per_seq_weights=self.per_seq_weights, expert=b["expert"],
                    kv=b["kv_read"] + b["kv_written"],
                    state_read=b["state_read"], state_written=b["state_written"],
                    ring=b["ring_read"] + b["ring_written"],
                    conv=b["conv_read"] + b["conv_written"])

    def as_dict(self) -> dict:
        return dict(model=self.model, batch=self.batch, mode=self.mode, source=self.source,
                    bytes=self.bytes, split=self.split(), floor_us=self.floor_s * 1e6,
                    predicted_us=None if self.predicted_s is None else self.predicted_s * 1e6,
                    compile_s=self.compile_s)


def integral(cats: dict[str, float]) -> Bytes:
    """The categories as ints (every term of the accounting is a whole number of bytes)."""
    out = {}
    for k, v in cats.items():
        if v != int(v):
            raise AssertionError(f"{k}: {v} is not a whole number of bytes")
        out[k] = int(v)
    return out


def _step(cfg: ModelConfig, batch: int, tokens: int = 1, context: int = 0,
          replay_window: int | None = None, instrs: list | None = None) -> SimpleNamespace:
    """What the byte accounting reads of a program, without compiling one."""
    return SimpleNamespace(cfg=cfg, batch=batch, tokens=tokens, rows=batch * tokens,
                           context=context, replay_window=replay_window, instrs=instrs or [])


def per_sequence_weight_bytes(cfg: ModelConfig, batch: int, tokens: int = 1) -> int:
    """The part of the weight bytes that grows with the batch: the N embedding rows plus what
    the blocks charge above their batch-0 weights (each recurrent core's conv taps and extras
    once per sequence, MLA's kv_b once per sequence); the same terms as step_bytes_by_category."""

    def blocks(b: int) -> float:
        st = _step(cfg, b, tokens)
        return sum(kind(blk.kind).step_bytes(blk, st).get("weights", 0) for blk in cfg.blocks)

    return int(batch * tokens * cfg.hidden_size * 2 + blocks(batch) - blocks(0))


def expert_share(cfg: ModelConfig, slot: int, rows: int) -> float:
    """The compiler's rule (layers/moe.py): a work slot's slabs are streamed with probability
    expected routed experts / work slots; the shared expert's (slot -1) always."""
    e = cfg.kind_config("moe")
    return 1.0 if slot == SHARED else e.expected_experts(rows) / e.work_slots(rows)


def analytic_bytes(base: Program, batch: int, tokens: int = 1,
                   replay_window: int | None = None) -> Bytes:
    """`step_bytes_by_category` at (batch, tokens, replay_window) from a program compiled at any
    batch (normally batch 1 without the cost model).

    Matrix slabs do not depend on the batch; MoE expert slabs are re-weighted for N = batch *
    tokens rows exactly as the compiler weights them (rounded down per instruction). The
    accounting only sums the slabs' bytes per opcode, so the stand-in holds one pseudo-instruction
    per opcode; everything else it derives from the configuration (and the cached context, which
    is the base program's).
    """
    n = batch * tokens
    slab: dict[int, int] = {}  # op -> bytes of its slabs
    for ins in base.instrs:
        s = isa.spec(ins.op)
        if not s.slab:
            continue
        w = ins.w_bytes
        if s.kind == "moe":  # work slot 0 stands for the W slots of N rows, -1 (shared) for itself
            slot, d = ins.operands["SLOT"], ins.operands
            if slot > 0:
                continue
            share = expert_share(base.cfg, slot, n)
            lo, hi = d["ROW0"] * d["K"] * 2, (d["ROW0"] + d["NROWS"]) * d["K"] * 2  # bf16
            times = 1 if slot == SHARED else base.cfg.kind_config("moe").work_slots(n)
            w = times * (int(hi * share) - int(lo * share))  # rounded as the compiler does
        slab[ins.op] = slab.get(ins.op, 0) + w
    instrs = [SimpleNamespace(op=op, w_bytes=w) for op, w in slab.items()]
    stand_in = _step(base.cfg, batch, tokens, base.context, replay_window, instrs)
    return integral(step_bytes_by_category(stand_in))


def refusal(cfg: ModelConfig, batch: int, g: GPU, replay_window: int | None, tokens: int = 1,
            max_seq_len: int | None = None, context: int | None = None) -> str | None:
    """Why the compiler would refuse this plan (its own checks, run before scheduling: the
    model/batch/window validation, the buffer plan and the GPU memory), or None."""
    if max_seq_len is None:
        max_seq_len = min(cfg.max_position_embeddings, 4096)  # compile_program's default
    if context is None:
        context = min(1024, max_seq_len - tokens)
    try:
        validate(cfg, batch, tokens, max_seq_len, g, replay_window)
        ring_cap = replay_window - 1 + tokens if replay_window else 0
        shape = StepShape(batch, tokens, max_seq_len, default_splits(cfg, batch, g, context),
                          g.num_sms, ring_cap)
        check_memory(cfg, plan_buffers(cfg, shape), weight_layout(cfg), g)
    except PlanError as e:
        return str(e)
    return None


def bench_model(name: str, batches: list[int], g: GPU, replay_window: int,
                context: int | None, compile_max_batch: int | None) -> list[Row]:
    """Both modes at every batch: compiled rows where the compiler serves them and the compile
    fits a bench, analytic rows otherwise (module docstring)."""
    cfg = preset(name)
    base = compile_program(cfg, 1, g, context=context, policy="structure")
    limit = compile_max_batch
    if limit is None:
        limit = 1 if len(base.instrs) > SLOW_INSTRUCTIONS else MAX_BATCH
    rows = []
    for b in batches:
        per_seq = per_sequence_weight_bytes(cfg, b)
        for L in (None, replay_window):
            mode = "recurrent" if L is None else f"replay L={L}"
            hb = analytic_bytes(base, b, replay_window=L)
            why = refusal(cfg, b, g, L, context=context)
            if why is None and b > limit:
                why = f"compile > {limit} rows too slow for a bench"
            if why is not None:
                rows.append(Row(name, b, mode, f"analytic ({why})", hb, per_seq,
                                hb["total"] / g.copy_bw, None))
                continue
            t0 = time.perf_counter()
            prog = compile_program(cfg, b, g, context=context, replay_window=L)
            dt = time.perf_counter() - t0
            hc = integral(step_bytes_by_category(prog))
            if hc != hb:
                diff = {k: (hb[k], hc[k]) for k in hc if hb[k] != hc[k]}
                raise AssertionError(f"{name} B={b} {mode}: analytic != compiled bytes {diff}")
            r = prog.cost
            if r.bytes_per_step != hc["total"]:
                raise AssertionError(f"{name} B={b} {mode}: the cost report counts "
                                     f"{r.bytes_per_step} bytes, the categories {hc['total']}")
            rows.append(Row(name, b, mode, "compiled", hc, per_seq, r.floor_s, r.predicted_s,
                            dt))
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
            ratio_b = f"{prev.bytes['total'] / r.bytes['total']:.2f}x"
            if prev.predicted_s is not None and r.predicted_s is not None:
                ratio_t = f"{prev.predicted_s / r.predicted_s:.2f}x"
            else:
                ratio_t = f"{prev.floor_s / r.floor_s:.2f}x (floor)"
        pred = "-" if r.predicted_s is None else f"{r.predicted_s * 1e6:.0f}"
        out.append(f"| {r.model} | {r.batch} | {r.mode} | "
                   + " | ".join(_gb(s[k]) for k in KINDS)
                   + f" | {_gb(r.bytes['total'])} | {r.floor_s * 1e6:.0f} | {pred} | {ratio_b} | "
                     f"{ratio_t} | {r.source} |")
        prev = r
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None,
                    help="comma list of presets (default: every real preset with recurrent "
                         "layers)")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--replay-window", type=int, default=16, help="ReplaySSM fold window L")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--context", type=int, default=None, help="cached tokens (default 1024)")
    ap.add_argument("--compile-max-batch", type=int, default=None,
                    help="largest batch compiled with the cost model; above it rows are "
                         f"analytic (default {MAX_BATCH}; 1 for models whose batch-1 program has "
                         f"more than {SLOW_INSTRUCTIONS} instructions)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    if args.replay_window < 1:
        ap.error(f"--replay-window must be >= 1, got {args.replay_window}")
    t0 = time.perf_counter()
    g = gpu(check_names("--gpu", args.gpu, list(GPUS))[0])
    batches = [int(x) for x in args.batches.split(",")]
    models = (check_names("--models", args.models, list(presets())) if args.models
              else recurrent_presets())
    rows: list[Row] = []
    for m in models:
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
    from megakernel.cli.main import run_main

    raise SystemExit(run_main(main))
