"""FP8 weights against bf16 in the cost model: the predicted step of each model and GPU, its bytes
and floor, and the ratio the FP8 issue targets (llama-3.2-1b <= 0.65x, llama-3.1-8b <= 0.56x
on an H200 at B = 1).

    python bench/fp8.py [--models a,b] [--gpus h200] [--batches 1] [--granularity channel,block]
                        [--json out.json]
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
from megakernel.models import fp8, preset, presets  # noqa: E402
from megakernel.program.compiler import compile_program  # noqa: E402
from megakernel.program.gpus import GPUS, gpu  # noqa: E402
from megakernel.program.verify import check_program  # noqa: E402

MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3.5-0.8b", "nemotron-h-8b", "kimi-linear-48b-a3b")
TARGETS = {"llama-3.2-1b": 0.65, "llama-3.1-8b": 0.56}  # FP8 / bf16 step, H200, B = 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--gpus", default="h200")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--granularity", default="channel,block")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    models = check_names("--models", args.models, list(presets()))
    gpus = check_names("--gpus", args.gpus, list(GPUS))
    fmts = [None] + [fp8.Fp8Format(g) for g in args.granularity.split(",")]
    rows = []
    header = ("| model | GPU | B | weights | GB/step | floor us | predicted us | vs bf16 | "
              "target |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for m in models:
        for g in gpus:
            for b in (int(x) for x in args.batches.split(",")):
                base = None
                for q in fmts:
                    what = "bf16" if q is None else f"fp8 {q.granularity}"
                    t0 = time.perf_counter()
                    with stage(f"{m} on {g}, batch {b}, {what}"):
                        prog = compile_program(preset(m).replace(quant=q), b, gpu(g))
                        check_program(prog)
                    r = prog.cost
                    base = base or r.predicted_s
                    target = TARGETS.get(m) if q is not None and b == 1 and g == "h200" else None
                    row = dict(model=m, gpu=g, batch=b, weights=what,
                               gb=round(r.bytes_per_step / 1e9, 4),
                               floor_us=round(r.floor_s * 1e6, 1),
                               predicted_us=round(r.predicted_s * 1e6, 1),
                               ratio=round(r.predicted_s / base, 3), target=target,
                               plan_s=round(time.perf_counter() - t0, 1))
                    rows.append(row)
                    met = "" if target is None else (
                        f"<= {target} {'met' if row['ratio'] <= target else 'NOT met'}")
                    print(f"| {m} | {g} | {b} | {what} | {row['gb']:.3f} | "
                          f"{row['floor_us']:.1f} | {row['predicted_us']:.1f} | "
                          f"{row['ratio']:.3f} | {met} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    from megakernel.cli.main import run_main

    raise SystemExit(run_main(main))
