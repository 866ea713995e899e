"""`python -m megakernel generate`: greedy generation of a preset (random weights) or a checkpoint
with a chosen backend (megakernel.serve.backends), from token ids or, with the checkpoint's
tokenizer, text; `run_generation` is the same without the command line and returns the JSON-ready
result."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import time
from collections.abc import Callable
from typing import Any

from megakernel.cli.main import CliError, add_weight_arguments, weight_options
from megakernel.serve.backends import BACKENDS, BF16_ONLY, SPECULATIVE


# ---- backends ------------------------------------------------------------------------------------
def backend_function(name: str, table: dict[str, tuple[str, str]] = BACKENDS
                     ) -> Callable[..., Any]:
    """The backend's generate function (from `table`: BACKENDS, or SPECULATIVE for
    --speculative), or CliError saying why it is not available."""
    module, attr = table[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise CliError(f"backend {name!r} is not available: cannot import {module} ({e})") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise CliError(f"backend {name!r} is not available: {module} has no function {attr}()")
    return fn


# ---- prompts -------------------------------------------------------------------------------------
DEFAULT_PROMPTS: list[list[int]] = [[5, 17, 3, 101, 42], [7, 1, 30]]  # a small ragged batch


def parse_prompt_ids(text: str) -> list[list[int]]:
    """"5,17,3;7,1,30" -> [[5, 17, 3], [7, 1, 30]]: prompts split by ';', ids by ','."""
    prompts = []
    for i, part in enumerate(text.split(";")):
        ids = []
        for tok in part.split(","):
            tok = tok.strip()
            if not tok:
                raise CliError(f"bad --prompt-ids {text!r}: prompt {i} has an empty token id")
            try:
                v = int(tok)
            except ValueError:
                raise CliError(
                    f"bad --prompt-ids {text!r}: {tok!r} in prompt {i} is not an integer"
                ) from None
            if v < 0:
                raise CliError(f"bad --prompt-ids {text!r}: token id {v} is negative")
            ids.append(v)
        prompts.append(ids)
    return prompts


# ---- generation ----------------------------------------------------------------------------------
def run_generation(
    model: str,
    prompts: list[list[int]],
    steps: int,
    backend: str = "reference",
    dtype: str = "bf16",
    seed: int = 0,
    max_seq_len: int | None = None,
    device: str = "cpu",
    replay_window: int | None = None,
    weights: dict[str, Any] | None = None,
    speculative: str | None = None,
) -> dict[str, Any]:
    """Load `model` (preset: random weights from `seed`; directory: checkpoint), generate greedily.

    Models with recurrent layers (Qwen3.5, Kimi Linear, Nemotron-H) run them by the recurrent
    update, or by ReplaySSM when `replay_window` (L >= 1) is given. `speculative` ("ngram:3",
    "mtp:2", "draft:MODEL:3"; megakernel.serve.speculative): after the first new token, steps of
    1 + k tokens that verify k drafts (the same tokens as plain greedy decoding); the result then
    holds "speculative" (engine.Generated.speculative_stats). Returns the JSON-ready result:
    tokens (new ids per prompt), timings and settings.
    """
    from megakernel.serve.speculative import parse

    spec = parse(speculative)  # SpeculativeError (a UserError) names a bad method string
    if backend not in BACKENDS:
        raise CliError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if dtype not in ("bf16", "fp32"):
        raise CliError(f"unknown dtype {dtype!r}; choose bf16 or fp32")
    if backend in BF16_ONLY and dtype != "bf16":
        raise CliError(
            f"backend {backend!r} computes in bf16; --dtype {dtype} is for the reference only"
        )
    if steps < 1:
        raise CliError(f"--steps must be at least 1, got {steps}")
    if not prompts or any(not p for p in prompts):
        raise CliError("every prompt needs at least one token")
    if replay_window is not None and replay_window < 1:
        raise CliError(f"--replay-window must be >= 1 (or 0 for the recurrent update), "
                       f"got {replay_window}")
    fn = backend_function(backend, SPECULATIVE if spec else BACKENDS)  # before loading weights
    if backend == "reference":
        import megakernel.reference.model  # noqa: F401 (import time is not generation time)

        fn = functools.partial(fn, mode=dtype, device=device)

    import torch

    from megakernel.models import presets
    from megakernel.models.sources import load_model

    t0 = time.perf_counter()
    # Random weights are drawn in bf16 for both dtypes, so bf16 and fp32 runs share one model;
    # a checkpoint keeps its own dtype in fp32 mode (the reference upcasts).
    load_dtype = torch.bfloat16 if dtype == "bf16" or model in presets() else None
    cfg, tensors = load_model(model, seed=seed, dtype=load_dtype,
                              mtp=spec is not None and spec.method == "mtp", **(weights or {}))
    load_s = time.perf_counter() - t0
    if replay_window is not None and not cfg.recurrent_layers():
        raise CliError(f"--replay-window applies to models with recurrent layers; {model!r} "
                       "has none")
    from megakernel.serve.backends import check_speculative

    check_speculative(spec, cfg, replay_window, "--replay-window L")

    longest = max(len(p) for p in prompts)
    needed = longest + steps - 1  # the last new token is never fed back
    if spec is not None:  # a live row's last step still verifies 1 + k tokens
        from megakernel.serve.engine import spec_max_seq_len

        needed = spec_max_seq_len(longest, steps, spec.k)
    given = max_seq_len is not None  # name only the flags the user passed
    if max_seq_len is None:
        max_seq_len = max(longest + steps, needed)
    if max_seq_len < needed:
        what = f" and --speculative {spec}" if spec is not None else ""
        raise CliError(f"--max-seq-len {max_seq_len} is too small: the longest prompt "
                       f"({longest} tokens) plus --steps {steps}{what} needs {needed}")
    if max_seq_len > cfg.max_position_embeddings:
        what = (f"--max-seq-len {max_seq_len}" if given else
                f"--steps {steps} after the longest prompt ({longest} tokens) needs "
                f"{max_seq_len} positions, which")
        raise CliError(f"{what} exceeds the model's max_position_embeddings "
                       f"({cfg.max_position_embeddings})")
    for i, p in enumerate(prompts):
        bad = [t for t in p if t >= cfg.vocab_size]
        if bad:
            raise CliError(f"token id {bad[0]} in prompt {i} is out of range for vocab size "
                           f"{cfg.vocab_size}")

    stats = None
    if spec is None:
        t0 = time.perf_counter()
        tokens = fn(cfg, tensors, prompts, steps, max_seq_len, seed, replay_window=replay_window)
        gen_s = time.perf_counter() - t0
    else:
        from megakernel.serve.backends import drafts_function

        drafts_fn = drafts_function(spec, cfg, tensors, backend, len(prompts), max_seq_len,
                                    seed=seed, mode=dtype, device=device)
        t0 = time.perf_counter()
        g = fn(cfg, tensors, prompts, steps, max_seq_len, seed, replay_window=replay_window,
               speculative=spec, drafts_fn=drafts_fn)
        gen_s = time.perf_counter() - t0
        tokens = g.tokens
        stats = g.speculative_stats(spec.method, spec.k)
        if spec.model is not None:
            stats["draft_model"] = spec.model
    tokens = [[int(t) for t in row] for row in tokens]
    if len(tokens) != len(prompts) or any(len(row) != steps for row in tokens):
        raise RuntimeError(f"backend {backend!r} returned {[len(r) for r in tokens]} tokens for "
                           f"{len(prompts)} prompts x {steps} steps")
    n_new = len(prompts) * steps
    r = {
        "model": model,
        "random_weights": model in presets(),
        "backend": backend,
        "replay_window": replay_window or 0,
        "dtype": dtype,
        "weights": "bf16" if cfg.quant is None else cfg.quant.describe(),
        "seed": seed,
        "steps": steps,
        "batch": len(prompts),
        "max_seq_len": max_seq_len,
        "prompts": prompts,
        "tokens": tokens,
        "load_s": round(load_s, 4),
        "generate_s": round(gen_s, 4),
        "tokens_per_s": round(n_new / gen_s, 2) if gen_s > 0 else None,
    }
    if stats is not None:
        r["speculative"] = stats
    return r


def describe_generation(r: dict[str, Any]) -> list[str]:
    """Plain-words lines for a `run_generation` result."""
    source = f"random weights, seed {r['seed']}" if r["random_weights"] else "checkpoint"
    lines = [f"model {r['model']} ({source}, weights {r['weights']}), backend {r['backend']}, "
             f"{r['dtype']}, "
             f"batch {r['batch']}, {r['steps']} steps"]
    for i, (p, t) in enumerate(zip(r["prompts"], r["tokens"], strict=True)):
        lines.append(f"  prompt {i} {p} -> new tokens {t}")
        if "texts" in r:
            lines.append(f"    text: {r['texts'][i]!r}")
    if "speculative" in r:
        s = r["speculative"]
        lines.append(f"  speculative {s['method']} with {s['k']} draft(s) a step: "
                     f"{s['accepted_per_step']:.2f} drafts accepted, {s['tokens_per_step']:.2f} "
                     f"tokens per step and sequence, over {s['steps']} speculative step(s)")
    lines.append(f"  {r['batch'] * r['steps']} new tokens in {r['generate_s']:.3f} s "
                 f"({r['tokens_per_s']} tokens/s); weights ready in {r['load_s']:.3f} s")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny",
                   help="preset name (random weights), Hugging Face checkpoint directory or "
                        ".gguf file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", help="token ids: '5,17,3;7,1,30' is a batch of two prompts "
                     f"(default: {';'.join(','.join(map(str, q)) for q in DEFAULT_PROMPTS)})")
    src.add_argument("--prompt", action="append",
                     help="text prompt (needs a tokenizer in the checkpoint); repeat for a batch")
    p.add_argument("--chat", action="store_true",
                   help="with --prompt: apply the model's chat template to each prompt (a user "
                        "message), stop at the model's EOS and print the reply's text")
    p.add_argument("--steps", type=int, default=8, help="new tokens per prompt (default 8)")
    p.add_argument("--backend", choices=list(BACKENDS), default="reference")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: the kernel's numerics (default); fp32: the reference's truth")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights of a preset")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache length (default: longest prompt + steps)")
    p.add_argument("--device", default="cpu", help="torch device of the reference (default cpu)")
    p.add_argument("--replay-window", type=int, default=None, metavar="L",
                   help="models with recurrent layers: ReplaySSM, folding the state every L tokens "
                        "(0 = plain recurrent update, the default)")
    p.add_argument("--speculative", default=None, metavar="METHOD",
                   help="speculative decoding with k drafts a step (1 <= k <= 7): ngram:K (prompt "
                        "lookup, drafted on the program), mtp:K (the checkpoint's MTP layer), "
                        "draft:MODEL:K (a draft model); the tokens are plain greedy decoding's. "
                        "Recurrent models need --replay-window")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    add_weight_arguments(p)


def check_device(device: str, backend: str) -> None:
    """CliError unless `--device` names a torch device this machine has (the reference's only)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise CliError(f"--device {device!r} is not a torch device (use cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {device} needs CUDA; torch.cuda.is_available() is False here "
                       "(use --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CliError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
                       "device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise CliError(f"--device {device}: use cpu or cuda")
    if backend != "reference" and dev.type != "cpu":
        raise CliError(f"--device is for the reference backend; --backend {backend} chooses "
                       "its own device")


def run(args: argparse.Namespace) -> int:
    tok = None
    if args.chat and not args.prompt:
        raise CliError("--chat needs --prompt (the user message)")
    if args.prompt:
        from megakernel.serve.chat import chat_ids, load_tokenizer

        tok = load_tokenizer(args.model)
        if args.chat:
            prompts = [chat_ids(tok, text) for text in args.prompt]
        else:
            prompts = [list(tok(text)["input_ids"]) for text in args.prompt]
    elif args.prompt_ids is not None:
        prompts = parse_prompt_ids(args.prompt_ids)
    else:
        prompts = [list(p) for p in DEFAULT_PROMPTS]
    replay = args.replay_window or None  # 0 = recurrent
    check_device(args.device, args.backend)
    from megakernel.common.progress import set_quiet

    set_quiet(args.json)
    if args.replay_window is not None and args.replay_window < 0:
        raise CliError(f"--replay-window must be >= 0, got {args.replay_window}")
    r = run_generation(args.model, prompts, args.steps, args.backend, args.dtype, args.seed,
                       args.max_seq_len, args.device, replay, weight_options(args),
                       args.speculative)
    if args.chat:
        from megakernel.serve.chat import model_eos, until_eos

        eos = model_eos(tok)
        r["tokens"] = [until_eos(t, eos) for t in r["tokens"]]
        r["eos_token_id"] = eos
    if tok is not None:
        r["texts"] = [tok.decode(t, skip_special_tokens=args.chat) for t in r["tokens"]]
    print("\n".join(describe_generation(r)))
    if args.json:
        print(json.dumps(r))
    return 0
