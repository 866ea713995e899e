"""FP8 weights against bf16 on a real model: greedy agreement, logit error, and what the weights'
quantization error predicts.

For each prompt the bf16 model (the reference in fp32 mode: each model's own truth) generates
`--tokens` greedy tokens; both models then score prompt + that continuation in one teacher-forced
step, so every position is compared on the same context:

    agreement    fraction of positions where the FP8 model's greedy token is the bf16 one's
    free-run     tokens the FP8 model generates on its own before its first different token
    logit error  relative RMS of the FP8 logits' difference (per position, then the mean) and
                 the largest absolute difference
    weights      the weights' relative quantization error |W8 - W| / |W| over the quantized
                 matrices (parameter-weighted RMS)
    predicted    the logit error of the bf16 model with Gaussian noise of the same size added to
                 each quantized matrix (|noise| = |W8 - W| per matrix): what the quantization
                 error predicts if it acts like independent noise
    near ties    of the disagreeing positions, those whose bf16 top-2 logit margin is below 1

    python bench/fp8_accuracy.py [--model PATH] [--tokens 64] [--granularity channel,block]
    [--executor N]   also run N decode steps of the FP8 program on the CPU executor and check its
                     tokens against the FP8 reference's (bf16 mirror)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megakernel.models import fp8  # noqa: E402
from megakernel.models.sources import load_model  # noqa: E402
from megakernel.reference.model import ReferenceModel  # noqa: E402
from megakernel.reference.model import generate as ref_generate  # noqa: E402

PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Photosynthesis is the process by which",
           "In 1969, the first humans to walk on the Moon were")


def tokenize(path: str) -> list[list[int]]:
    from megakernel.cli.generate import load_tokenizer

    tok = load_tokenizer(path)
    return [list(tok(p)["input_ids"]) for p in PROMPTS]


def weight_error(cfg, w_bf16, w_fp8) -> float:  # noqa: ANN001
    """Parameter-weighted RMS of the quantized matrices' relative Frobenius error."""
    num = den = 0.0
    deq = fp8.dequantized(cfg, w_fp8)
    for n in fp8.quantized_names(cfg):
        ref = w_bf16[n].float()
        num += float((deq[n] - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
    return math.sqrt(num / den)


def noisy(cfg8, w16, w8, seed: int = 0) -> dict:  # noqa: ANN001
    """The bf16 weights plus, per quantized matrix, Gaussian noise of the FP8 error's norm."""
    g = torch.Generator().manual_seed(seed)
    deq = fp8.dequantized(cfg8, w8)
    out = dict(w16)
    for n in fp8.quantized_names(cfg8):
        ref = w16[n].float()
        z = torch.randn(ref.shape, generator=g)
        out[n] = ref + z * ((deq[n] - ref).norm() / z.norm())
    return out


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over positions of |a - ref| / |ref| (RMS over the vocabulary)."""
    return float(((a - ref).pow(2).mean(-1) / ref.pow(2).mean(-1)).sqrt().mean())


def teacher_forced(model: ReferenceModel, prompt: list[int], cont: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(prompt) + len(cont), max_step_tokens=len(cont))
    first = model.prefill(cache, [prompt])  # [1, V]: predicts cont[0]
    rest = model.decode(cache, torch.tensor([cont[:-1]]))[0]  # [T - 1, V]
    return torch.cat((first, rest))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: the real "
                    "model megakernel fetches, SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--granularity", default="channel,block")
    ap.add_argument("--executor", type=int, default=0, metavar="N")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from megakernel.serve.real_models import fetch

        args.model = str(fetch())
    prompts = tokenize(args.model)
    cfg, w16 = load_model(args.model)
    w16 = dict(w16)
    base = ReferenceModel(cfg, w16, mode="fp32")
    conts = ref_generate(base, prompts, args.tokens)
    ref_logits = [teacher_forced(base, p, c) for p, c in zip(prompts, conts, strict=True)]
    rows = []
    for gran in args.granularity.split(","):
        t0 = time.perf_counter()
        cfg8, w8 = load_model(args.model, weights="fp8", granularity=gran)
        w8 = {n: w8[n] for n in w8}
        m8 = ReferenceModel(cfg8, w8, mode="fp32")
        mn = ReferenceModel(cfg, noisy(cfg8, w16, w8), mode="fp32")
        agree = total = ties = 0
        rel, pred, worst, free = [], [], 0.0, []
        for p, c, l16 in zip(prompts, conts, ref_logits, strict=True):
            l8 = teacher_forced(m8, p, c)
            differ = l8.argmax(-1) != l16.argmax(-1)
            agree += int((~differ).sum())
            total += len(c)
            top2 = l16.topk(2, dim=-1).values
            ties += int((differ & (top2[:, 0] - top2[:, 1] < 1.0)).sum())
            rel.append(rel_rms(l8, l16))
            pred.append(rel_rms(teacher_forced(mn, p, c), l16))
            worst = max(worst, float((l8 - l16).abs().max()))
            own = ref_generate(m8, [p], len(c))[0]
            free.append(next((i for i, (a, b) in enumerate(zip(own, c, strict=True)) if a != b),
                             len(c)))
        row = {"granularity": gran, "positions": total, "agreement": agree / total,
               "disagreements_near_ties": ties, "free_run_tokens": free,
               "logit_rel_rms": sum(rel) / len(rel), "predicted_rel_rms": sum(pred) / len(pred),
               "logit_max_abs": worst, "weight_rel_error": weight_error(cfg8, w16, w8),
               "seconds": round(time.perf_counter() - t0, 1)}
        if args.executor:
            row["executor"] = executor_check(cfg8, w8, prompts, args.executor)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"{cfg.name}: FP8 against bf16, {len(prompts)} prompts x {args.tokens} tokens "
          "(teacher-forced on the bf16 continuation; the reference in fp32)")
    print("| scales | greedy agreement (near ties among the rest) | free-run tokens before the "
          "first difference | logit rel. RMS error | predicted (same-size noise) | max abs "
          "logit error | weights' rel. error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['granularity']} | {100 * r['agreement']:.1f}% "
              f"({r['disagreements_near_ties']}) | {r['free_run_tokens']} | "
              f"{r['logit_rel_rms']:.4f} | {r['predicted_rel_rms']:.4f} | "
              f"{r['logit_max_abs']:.3f} | {r['weight_rel_error']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def executor_check(cfg, w8, prompts: list[list[int]], steps: int) -> dict:  # noqa: ANN001
    """The FP8 program on the CPU executor against the FP8 reference's bf16 mirror."""
    from megakernel.serve.executor_backend import generate as ex_generate

    mirror = ReferenceModel(cfg, w8, mode="bf16")
    want = ref_generate(mirror, prompts, steps)
    got = ex_generate(cfg, w8, prompts, steps)
    same = sum(a == b for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))
    return {"steps": steps, "tokens_equal": same, "tokens": steps * len(prompts)}


if __name__ == "__main__":
    raise SystemExit(main())
