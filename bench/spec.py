"""Speculative decoding in the cost model: the 1 + k step against the plain step, and tokens/s per
user at a per-draft acceptance rate, by model, k and batch; and the speculative issue's targets.

For each model, batch and k, the plain T = 1 program and the speculative program of 1 + k tokens
(`compile_program(..., drafts=k, ngram=3)`: ACCEPT and the device n-gram drafter) are compiled and
replayed by the cost model (`prog.cost.predicted_s`). Recurrent models use ReplaySSM
(`--replay-window`, default 16) for both, since a speculative step needs it. At a per-draft
acceptance rate A (the probability that a draft is accepted given that the drafts before it were;
`--acceptance`, an assumption: no trained model's drafts have been measured here) a step emits
1 + A + ... + A^k tokens per sequence (plan_cli.expected_tokens), so

    tokens/s per user = (1 + A + ... + A^k) / step time,   speed-up = that x plain step time.

Targets (the speculative issue): the 1 + k step at most 1.15x the plain step for k <= 3 at
B = 1 on llama-3.2-1b, qwen3.5-0.8b and nemotron-h-8b; tokens/s per user at least 1.8x plain at
the given acceptance (the best k of each model at B = 1).

    python bench/spec.py [--models a,b] [--ks 1,2,...,7] [--batches 1,8] [--acceptance 0.7]
                         [--gpu h200] [--replay-window 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megakernel.cli.main import CliError, check_names  # noqa: E402
from megakernel.cli.plan import check_acceptance, speculative_summary  # noqa: E402
from megakernel.common.progress import stage  # noqa: E402
from megakernel.models import preset, presets  # noqa: E402
from megakernel.program.compiler import compile_program  # noqa: E402
from megakernel.program.gpus import GPUS, gpu  # noqa: E402
from megakernel.reference.speculative import NGRAM_MAX  # noqa: E402

MODELS = ("llama-3.2-1b", "qwen3-0.6b", "qwen3.5-0.8b", "nemotron-h-8b")
TARGET_MODELS = ("llama-3.2-1b", "qwen3.5-0.8b", "nemotron-h-8b")
STEP_TARGET = 1.15  # the 1 + k step / the plain step, k <= STEP_TARGET_K, B = 1
STEP_TARGET_K = 3
SPEEDUP_TARGET = 1.8  # tokens/s per user / plain, best k, B = 1


def step_s(model: str, batch: int, g, k: int, replay_window: int | None,  # noqa: ANN001
           context: int | None) -> float:
    """The predicted step of `model` at `batch`: plain (k = 0) or 1 + k with the device drafter."""
    with stage(f"{model}, batch {batch}, " + (f"1 + {k} speculative step" if k else "plain step")):
        prog = compile_program(preset(model), batch, g, context=context,
                               replay_window=replay_window, drafts=k,
                               ngram=NGRAM_MAX if k else 0)
    return float(prog.cost.predicted_s)


def bench_model(model: str, ks: list[int], batches: list[int], g, acceptance: float,  # noqa: ANN001
                replay_window: int, context: int | None = None) -> list[dict]:
    """One row per (batch, k): speculative_summary of the 1 + k step against the plain one."""
    window = replay_window if preset(model).recurrent_layers() else None
    rows = []
    for b in batches:
        plain = step_s(model, b, g, 0, window, context)
        for k in ks:
            s = speculative_summary("ngram", k, acceptance, plain,
                                    step_s(model, b, g, k, window, context))
            rows.append(dict(model=model, batch=b, replay_window=window or 0, **s))
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, judged on the B = 1 rows of the target models present."""
    out = []
    for m in TARGET_MODELS:
        mine = [r for r in rows if r["model"] == m and r["batch"] == 1]
        if not mine:
            continue
        small = [r for r in mine if r["k"] <= STEP_TARGET_K]
        if small:
            worst = max(small, key=lambda r: r["step_ratio"])
            out.append(dict(model=m, target=f"1 + k step <= {STEP_TARGET}x plain, k <= "
                            f"{STEP_TARGET_K}, B = 1", value=worst["step_ratio"],
                            at=f"k = {worst['k']}", met=worst["step_ratio"] <= STEP_TARGET))
        best = max(mine, key=lambda r: r["speedup"])
        out.append(dict(model=m, target=f"tokens/s per user >= {SPEEDUP_TARGET}x plain at "
                        f"acceptance {best['acceptance']:g}, B = 1", value=best["speedup"],
                        at=f"k = {best['k']}", met=best["speedup"] >= SPEEDUP_TARGET))
    return out


def markdown(rows: list[dict]) -> str:
    head = ("| model | B | k | plain us | 1 + k step us | step ratio | tokens/step | "
            "tok/s/user | plain tok/s/user | speed-up |")
    out = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['batch']} | {r['k']} | {r['plain_step_us']:.0f} | "
                   f"{r['spec_step_us']:.0f} | {r['step_ratio']:.3f}x | "
                   f"{r['tokens_per_step']:.3f} | {r['tokens_per_s_per_user']:.0f} | "
                   f"{r['plain_tokens_per_s_per_user']:.0f} | {r['speedup']:.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ks", default="1,2,3,4,5,6,7", help="drafts a step (default 1..7)")
    ap.add_argument("--batches", default="1", help="comma list of batch sizes (default 1)")
    ap.add_argument("--acceptance", type=float, default=0.7,
                    help="per-draft acceptance rate A in [0, 1] (default 0.7, assumed)")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--replay-window", type=int, default=16,
                    help="ReplaySSM window of the recurrent models (default 16)")
    ap.add_argument("--context", type=int, default=None, help="cached tokens (default 1024)")
    ap.add_argument("--json", default=None, help="also write the rows and targets to this file")
    args = ap.parse_args(argv)
    models = check_names("--models", args.models, list(presets()))
    g = gpu(check_names("--gpu", args.gpu, list(GPUS))[0])
    try:
        ks = [int(x) for x in args.ks.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        raise CliError(f"--ks and --batches are comma lists of integers, got {args.ks!r} and "
                       f"{args.batches!r}") from None
    if any(not 1 <= k <= 7 for k in ks) or any(b < 1 for b in batches):
        raise CliError(f"--ks must be in [1, 7] and --batches >= 1, got {ks} and {batches}")
    if args.replay_window < 1:
        raise CliError(f"--replay-window must be >= 1, got {args.replay_window}")
    check_acceptance(args.acceptance)
    t0 = time.perf_counter()
    rows: list[dict] = []
    for m in models:
        rows += bench_model(m, ks, batches, g, args.acceptance, args.replay_window, args.context)
    print(f"{g.name}: the speculative step (1 + k tokens, ACCEPT and the device n-gram drafter) "
          f"against the plain step, cost model; per-draft acceptance {args.acceptance:g} "
          f"(assumed); recurrent models with ReplaySSM L = {args.replay_window}\n")
    print(markdown(rows))
    judged = targets(rows)
    if judged:
        print("\ntargets:")
        for t in judged:
            print(f"  {t['model']}: {t['target']}: {t['value']:.3f}x at {t['at']} -> "
                  + ("met" if t["met"] else "NOT met"))
    wall = time.perf_counter() - t0
    print(f"\nruntime {wall:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(gpu=args.gpu, acceptance=args.acceptance,
                                                   runtime_s=wall, rows=rows, targets=judged),
                                              indent=1))
    return 0


if __name__ == "__main__":
    from megakernel.cli.main import run_main

    raise SystemExit(run_main(main))
