"""Plan every real dense preset on every GPU description at B in {1, 8, 64}; print a markdown table.

For each: plan (compile + schedule) time, the predicted step time, the copy-bandwidth floor,
the predicted efficiency (floor / predicted), tokens/s per user (1 / step) and per GPU (B / step)
and the round-robin schedule's prediction for comparison. Every plan is also verified (coverage,
counters, dataflow, deadlock freedom).

    python bench/plan.py [--models a,b] [--gpus h100,h200] [--batches 1,8,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.cli.main import check_names  # noqa: E402
from megakernel.common.progress import stage  # noqa: E402
from megakernel.isa.stages import PlanError  # noqa: E402
from megakernel.models import preset, presets, real_presets  # noqa: E402
from megakernel.program.compiler import compile_program  # noqa: E402
from megakernel.program.gpus import GPUS, gpu  # noqa: E402
from megakernel.program.verify import check_program  # noqa: E402


def dense_presets() -> list[str]:
    """The real presets without recurrent layers (bench/replay.py covers the others)."""
    return [n for n in real_presets() if not preset(n).recurrent_layers()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(dense_presets()))
    ap.add_argument("--gpus", default=",".join(GPUS))
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=None, help="cached tokens (default 1024)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    models = check_names("--models", args.models, list(presets()))
    gpus = check_names("--gpus", args.gpus, list(GPUS))
    rows = []
    header = ("| model | GPU | B | plan s | instructions | predicted us | floor us | efficiency "
              "| tokens/s per user | tokens/s per GPU | round-robin us |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for m in models:
        for g in gpus:
            for b in (int(x) for x in args.batches.split(",")):
                t0 = time.perf_counter()
                try:
                    with stage(f"{m} on {g}, batch {b}"):
                        prog = compile_program(preset(m), b, gpu(g), context=args.context)
                        plan_s = time.perf_counter() - t0
                        check_program(prog)
                except PlanError as e:  # a batch the GPU's memory cannot hold: a row saying so
                    rows.append(dict(model=m, gpu=g, batch=b, error=str(e)))
                    print(f"| {m} | {g} | {b} | not planned: {e} |", flush=True)
                    continue
                rr = compile_program(preset(m), b, gpu(g), context=args.context,
                                     policy="round_robin").cost
                r = prog.cost
                row = dict(model=m, gpu=g, batch=b, plan_s=round(plan_s, 2),
                           instructions=len(prog.instrs),
                           predicted_us=round(r.predicted_s * 1e6, 1),
                           floor_us=round(r.floor_s * 1e6, 1),
                           spec_floor_us=round(r.spec_floor_s * 1e6, 1),
                           efficiency=round(r.efficiency, 3),
                           tokens_per_s_per_user=round(1 / r.predicted_s, 1),
                           tokens_per_s_per_gpu=round(b / r.predicted_s, 1),
                           round_robin_us=round(rr.predicted_s * 1e6, 1))
                rows.append(row)
                print(f"| {m} | {g} | {b} | {row['plan_s']:.2f} | {row['instructions']} | "
                      f"{row['predicted_us']:.1f} | {row['floor_us']:.1f} | "
                      f"{100 * row['efficiency']:.1f}% | {row['tokens_per_s_per_user']:.0f} | "
                      f"{row['tokens_per_s_per_gpu']:.0f} | {row['round_robin_us']:.1f} |",
                      flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    from megakernel.cli.main import run_main

    raise SystemExit(run_main(main))
