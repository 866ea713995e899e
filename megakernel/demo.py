"""`python -m megakernel demo` (`make demo`): the main job, end to end, on whatever machine this is.

Without a GPU it walks the ladder as far as a CPU can: (1) plan a real model's decode step for an
H200 and print the cost model's prediction against the bandwidth floor; (2) run the program on the
CPU executor next to the torch reference (bf16 mirror) on tiny presets of two dense families and a
hybrid one (`EXECUTOR_MODELS`) and compare tokens; (3) AOT-compile the kernel for sm_90a and
sm_100a and print the resource report read from the cubins. With a CUDA GPU it also runs the
kernel and prints tokens/s next to the reference's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

DEFAULT_PROMPTS = [[5, 17, 3, 101, 42], [7, 1, 30], [11, 12, 13, 14, 15, 16, 17]]
EXECUTOR_MODELS = ("llama-tiny", "qwen3-tiny", "qwen3.5-tiny")  # Qwen3.5: GDN + gated attention


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3.2-1b",
                   help="real-shaped preset to plan and build (default llama-3.2-1b)")
    p.add_argument("--gpu", default="h200", help="GPU description to plan for (default h200)")
    p.add_argument("--steps", type=int, default=8, help="decode steps of the executor check")
    p.add_argument("--build-dir", default=None,
                   help="where to write the AOT build (default: a temporary directory)")
    p.add_argument("--skip-build", action="store_true", help="skip the AOT compile")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def _plan(model: str, gpu: str) -> dict[str, Any]:
    from megakernel.plan_cli import plan

    r = plan(model, gpu, batch=1)
    print(f"[1/3] plan: {model} on {r['gpu']}, batch 1: {r['instructions']} instructions on "
          f"{r['num_sms']} SMs, {r['bytes_per_step'] / 1e9:.3f} GB per step")
    print(f"      predicted step {r['predicted_step_us']:.1f} us against a floor of "
          f"{r['floor_us']:.1f} us (bytes / {r['copy_bw_gbs']:.0f} GB/s achievable bandwidth): "
          f"{100 * r['predicted_efficiency']:.1f}% predicted efficiency, "
          f"{1e6 / r['predicted_step_us']:.0f} tokens/s per user predicted")
    return r


def _executor_vs_reference(steps: int) -> list[dict[str, Any]]:
    from megakernel.executor import generate as executor_generate
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as reference_generate

    out = []
    for name in EXECUTOR_MODELS:
        cfg = preset(name)
        w = random_weights(cfg, seed=0)
        t0 = time.perf_counter()
        ref = reference_generate(ReferenceModel(cfg, w, mode="bf16"), DEFAULT_PROMPTS, steps)
        t1 = time.perf_counter()
        exe = executor_generate(cfg, w, DEFAULT_PROMPTS, steps)
        t2 = time.perf_counter()
        same = ref == exe
        print(f"[2/3] {name}: ragged batch of {len(DEFAULT_PROMPTS)} (prompt lengths "
              f"{[len(p) for p in DEFAULT_PROMPTS]}), {steps} greedy steps: the CPU executor "
              f"(program run instruction by instruction, SM interleavings drawn at random, "
              f"scratch poisoned with NaN) {'matches' if same else 'DIFFERS FROM'} the torch "
              f"reference token for token (reference {t1 - t0:.2f} s, executor {t2 - t1:.2f} s)")
        print(f"      tokens: {exe}")
        out.append({"model": name, "tokens_match": same, "reference": ref, "executor": exe})
    return out


def _build(model: str, build_dir: str | None, predicted_us: float) -> list[dict[str, Any]]:
    from megakernel.arch import ARCHS
    from megakernel.kernel.build import build, report_line
    from megakernel.models import resolve

    cfg = resolve(model)
    with tempfile.TemporaryDirectory(prefix="megakernel-demo-") as tmp:
        t0 = time.perf_counter()
        manifests = build(cfg, list(ARCHS), build_dir or tmp, batch=1, tokens=1)
        dt = time.perf_counter() - t0
    print(f"[3/3] AOT build of the CuTe DSL megakernel for {model}, batch 1, on this CPU in "
          f"{dt:.1f} s (resources read from the cubins):")
    for m in manifests:
        print("      " + report_line(m))
    print(f"      predicted H200 step time {predicted_us:.1f} us; the kernel runs only on a GPU "
          f"(see `make gpu-check`)")
    return [{"arch": m["arch"], "resources": m["resources"], "symbol": m["symbol"]}
            for m in manifests]


def _gpu_run(model: str, steps: int) -> dict[str, Any]:
    """On a GPU: the kernel against the reference on the GPU, tokens/s of each."""
    import torch

    from megakernel.kernel_backend import generate as kernel_generate
    from megakernel.models import resolve
    from megakernel.models.weights import random_weights
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as reference_generate

    cfg = resolve(model)
    w = random_weights(cfg, seed=0)
    prompts = [DEFAULT_PROMPTS[0]]
    ref_model = ReferenceModel(cfg, w, mode="bf16", device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ref = reference_generate(ref_model, prompts, steps)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    ker = kernel_generate(cfg, w, prompts, steps)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    r = {"reference_tokens_per_s": steps / (t1 - t0), "kernel_tokens_per_s": steps / (t2 - t1),
         "tokens_match": ref == ker}
    print(f"[GPU] {model} batch 1, {steps} steps on {torch.cuda.get_device_name()}: kernel "
          f"{r['kernel_tokens_per_s']:.0f} tokens/s (incl. first-launch setup) vs reference "
          f"eager {r['reference_tokens_per_s']:.0f} tokens/s; tokens "
          f"{'match' if r['tokens_match'] else 'DIFFER'}")
    return r


def run(args: argparse.Namespace) -> int:
    import torch

    print("megakernel demo: one decode step of an LLM as one persistent kernel. Weights are "
          "random (seeded), with the real published shapes.")
    result: dict[str, Any] = {}
    result["plan"] = _plan(args.model, args.gpu)
    result["executor"] = _executor_vs_reference(args.steps)
    if not args.skip_build:
        result["build"] = _build(args.model, args.build_dir, result["plan"]["predicted_step_us"])
    if torch.cuda.is_available():
        result["gpu"] = _gpu_run(args.model, max(args.steps, 32))
    else:
        print("no CUDA GPU here: the kernel was compiled and checked on the CPU only; run "
              "`make gpu-check` on a GPU machine to run it (README: 'Running on a GPU').")
    ok = all(r["tokens_match"] for r in result["executor"])
    print("demo " + ("finished: every check passed" if ok else "FAILED: see the lines above"))
    if args.json:
        print(json.dumps(result, default=str))
    return 0 if ok else 1
