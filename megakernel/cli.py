"""Command line: `python -m megakernel <command> [options]`.

Commands live in the `COMMANDS` table: name -> `Command(help, module, add, run)`. Only the chosen
command's module is imported, so a heavy or missing module (the DSL build, the GPU check) never
slows down or breaks the others, and this module imports nothing but the standard library at the
top. (The package itself imports torch and registers the op when loaded, never the DSL: the GPU
machine runs every command but build without it.) Adding a command is one `register(...)` line
plus a module exposing `add_arguments(parser)` and `run(args) -> int`.

Errors that are the user's input (bad config, bad checkpoint, bad token ids, ...) print
`error: <message>` on stderr and exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PROG = "python -m megakernel"


class CliError(ValueError):
    """Bad command-line input (syntax of --prompt-ids, incompatible options, ...)."""


@dataclass(frozen=True)
class Command:
    help: str
    module: str  # imported only when this command runs
    add: str = "add_arguments"  # add(parser) -> None
    run: str = "run"  # run(args) -> int (exit status)


COMMANDS: dict[str, Command] = {}


def register(
    name: str, help: str, module: str, add: str = "add_arguments", run: str = "run"
) -> None:
    """Add (or replace) a subcommand; see the module docstring."""
    COMMANDS[name] = Command(help, module, add, run)


# Exceptions that mean "bad input", by (module, class name). Looked up only in modules already
# imported, so listing one here never imports anything.
USER_ERRORS: list[tuple[str, str]] = [
    (__name__, "CliError"),
    ("megakernel.models.config", "ConfigError"),
    ("megakernel.models.weights", "WeightError"),
    ("megakernel.reference.layers.common", "ReferenceError"),
    ("megakernel.program.stages", "PlanError"),
    ("megakernel.program.gpus", "GPUError"),
    ("megakernel.runtime", "KernelUnavailable"),
    ("megakernel.runtime", "ManifestError"),
    ("megakernel.runtime", "ArgumentError"),
    ("megakernel.kernel.spec", "SpecError"),
    ("megakernel.finite", "NonFiniteError"),
]


def check_names(flag: str, text: str, known: Sequence[str]) -> list[str]:
    """A comma list of names -> the list; CliError naming `flag` and the known names when one is
    unknown (for sweeps, so a typo fails before the first long stage, not after)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known] or ([] if names else [text])
    if bad:
        raise CliError(f"{flag}: unknown name {bad[0]!r}; known: {', '.join(known)}")
    return names


def run_main(fn: Callable[[], int | None]) -> int:
    """Run a script's main(): a user error (USER_ERRORS) is one `error:` line and status 2."""
    try:
        return int(fn() or 0)
    except Exception as e:
        if not _is_user_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def check_writable(path: str, flag: str, is_dir: bool = False) -> None:
    """CliError naming `flag` unless `path` (a file, or a directory with `is_dir`) can be created:
    a file's directory must exist, a directory's nearest existing ancestor must be a directory,
    and either must be writable."""
    import os
    from pathlib import Path

    p = Path(path)
    if is_dir and p.exists() and not p.is_dir():
        raise CliError(f"{flag} {path}: exists and is not a directory")
    if not is_dir and p.is_dir():
        raise CliError(f"{flag} {path}: is a directory, expected a file name")
    parent = p if is_dir else p.parent
    if not is_dir and not parent.exists():
        raise CliError(f"{flag} {path}: directory {parent} does not exist")
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"{flag} {path}: {parent} is not writable")


def _is_user_error(e: BaseException) -> bool:
    for module, name in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return True
    return False


# ---- backends ------------------------------------------------------------------------------------
# Each backend: generate(cfg, weights, prompts, steps, max_seq_len, seed, replay_window=None)
# -> list[list[int]] of new tokens per prompt (prompt excluded). Imported lazily; a missing one is
# reported, not raised.
BACKENDS: dict[str, tuple[str, str]] = {
    "reference": (__name__, "reference_generate"),
    "cpu-executor": ("megakernel.executor", "generate"),
    "kernel": ("megakernel.torch_op", "generate"),
}
BF16_ONLY = ("cpu-executor", "kernel")


def backend_function(name: str) -> Callable[..., list[list[int]]]:
    """The backend's generate function, or CliError saying why it is not available."""
    module, attr = BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise CliError(f"backend {name!r} is not available: cannot import {module} ({e})") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise CliError(f"backend {name!r} is not available: {module} has no function {attr}()")
    return fn


def reference_generate(
    cfg: Any, weights: dict, prompts: list[list[int]], steps: int, max_seq_len: int, seed: int,
    replay_window: int | None = None, mode: str = "bf16", device: str = "cpu",
) -> list[list[int]]:
    """The reference model's greedy generation (seed unused: greedy decoding is deterministic)."""
    from megakernel.reference.model import ReferenceModel, generate

    model = ReferenceModel(cfg, weights, mode=mode, device=device, replay_window=replay_window)
    return generate(model, prompts, steps, max_seq_len)


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


def _tokenizer(spec: str) -> Any:
    """AutoTokenizer for a checkpoint directory; CliError when there is none."""
    from pathlib import Path

    root = Path(spec)
    if not root.is_dir():
        raise CliError(f"--prompt needs a checkpoint directory with a tokenizer; {spec!r} is a "
                       "preset with random weights (use --prompt-ids)")
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((root / n).is_file() for n in names):
        raise CliError(f"no tokenizer in {spec} (looked for {', '.join(names)}); use --prompt-ids")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise CliError(f"--prompt needs the transformers package ({e})") from None
    return AutoTokenizer.from_pretrained(str(root))


# ---- generate ------------------------------------------------------------------------------------
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
) -> dict[str, Any]:
    """Load `model` (preset: random weights from `seed`; directory: checkpoint), generate greedily.

    Models with recurrent layers (Qwen3.5, Kimi Linear, Nemotron-H) run them by the recurrent
    update, or by ReplaySSM when `replay_window` (L >= 1) is given. Returns the JSON-ready
    result: tokens (new ids per prompt), timings and settings.
    """
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
    fn = backend_function(backend)  # fail early, before loading weights
    if backend == "reference":
        import megakernel.reference.model  # noqa: F401 (import time is not generation time)

        fn = functools.partial(fn, mode=dtype, device=device)

    import torch

    from megakernel.models import presets
    from megakernel.models.weights import load_model

    t0 = time.perf_counter()
    # Random weights are drawn in bf16 for both dtypes, so bf16 and fp32 runs share one model;
    # a checkpoint keeps its own dtype in fp32 mode (the reference upcasts).
    load_dtype = torch.bfloat16 if dtype == "bf16" or model in presets() else None
    cfg, weights = load_model(model, seed=seed, dtype=load_dtype)
    load_s = time.perf_counter() - t0
    if replay_window is not None and not cfg.recurrent_layers():
        raise CliError(f"--replay-window applies to models with recurrent layers; {model!r} "
                       "has none")

    longest = max(len(p) for p in prompts)
    needed = longest + steps - 1  # the last new token is never fed back
    given = max_seq_len is not None  # name only the flags the user passed
    if max_seq_len is None:
        max_seq_len = longest + steps
    if max_seq_len < needed:
        raise CliError(f"--max-seq-len {max_seq_len} is too small: the longest prompt "
                       f"({longest} tokens) plus --steps {steps} needs {needed}")
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

    t0 = time.perf_counter()
    tokens = fn(cfg, weights, prompts, steps, max_seq_len, seed, replay_window=replay_window)
    gen_s = time.perf_counter() - t0
    tokens = [[int(t) for t in row] for row in tokens]
    if len(tokens) != len(prompts) or any(len(row) != steps for row in tokens):
        raise RuntimeError(f"backend {backend!r} returned {[len(r) for r in tokens]} tokens for "
                           f"{len(prompts)} prompts x {steps} steps")
    n_new = len(prompts) * steps
    return {
        "model": model,
        "random_weights": model in presets(),
        "backend": backend,
        "replay_window": replay_window or 0,
        "dtype": dtype,
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


def describe_generation(r: dict[str, Any]) -> list[str]:
    """Plain-words lines for a `run_generation` result."""
    source = f"random weights, seed {r['seed']}" if r["random_weights"] else "checkpoint"
    lines = [f"model {r['model']} ({source}), backend {r['backend']}, {r['dtype']}, "
             f"batch {r['batch']}, {r['steps']} steps"]
    for i, (p, t) in enumerate(zip(r["prompts"], r["tokens"], strict=True)):
        lines.append(f"  prompt {i} {p} -> new tokens {t}")
        if "texts" in r:
            lines.append(f"    text: {r['texts'][i]!r}")
    lines.append(f"  {r['batch'] * r['steps']} new tokens in {r['generate_s']:.3f} s "
                 f"({r['tokens_per_s']} tokens/s); weights ready in {r['load_s']:.3f} s")
    return lines


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny",
                   help="preset name (random weights) or Hugging Face checkpoint directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", help="token ids: '5,17,3;7,1,30' is a batch of two prompts "
                     f"(default: {';'.join(','.join(map(str, q)) for q in DEFAULT_PROMPTS)})")
    src.add_argument("--prompt", action="append",
                     help="text prompt (needs a tokenizer in the checkpoint); repeat for a batch")
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
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


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


def run_generate(args: argparse.Namespace) -> int:
    tok = None
    if args.prompt:
        tok = _tokenizer(args.model)
        prompts = [list(tok(text)["input_ids"]) for text in args.prompt]
    elif args.prompt_ids is not None:
        prompts = parse_prompt_ids(args.prompt_ids)
    else:
        prompts = [list(p) for p in DEFAULT_PROMPTS]
    replay = args.replay_window or None  # 0 = recurrent
    check_device(args.device, args.backend)
    from megakernel.progress import set_quiet

    set_quiet(args.json)
    if args.replay_window is not None and args.replay_window < 0:
        raise CliError(f"--replay-window must be >= 0, got {args.replay_window}")
    r = run_generation(args.model, prompts, args.steps, args.backend, args.dtype, args.seed,
                       args.max_seq_len, args.device, replay)
    if tok is not None:
        r["texts"] = [tok.decode(t) for t in r["tokens"]]
    print("\n".join(describe_generation(r)))
    if args.json:
        print(json.dumps(r))
    return 0


# ---- info ----------------------------------------------------------------------------------------
KERNEL_ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def machine_info() -> dict[str, Any]:
    """Versions, GPU, and what each backend can do here. Never imports the DSL."""
    import platform

    versions = {d: _version(d) for d in ("torch", "nvidia-cutlass-dsl", "cuda-python")}
    gpu: dict[str, Any] = {"available": False}
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            gpu = {"available": True, "name": torch.cuda.get_device_name(0),
                   "capability": f"sm_{major}{minor}", "count": torch.cuda.device_count(),
                   "kernel_arch": KERNEL_ARCHS.get((major, minor))}
    except ImportError:
        gpu["why"] = "torch is not installed"

    def can(ok: bool, why: str, module: str) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": ok} if ok else {"ok": False, "why": why}
        out["module"] = module
        out["module_present"] = _has_module(module)
        return out

    dsl = versions["nvidia-cutlass-dsl"]
    run_ok = bool(gpu.get("kernel_arch")) and versions["cuda-python"] is not None
    if not gpu["available"]:
        run_why = "no CUDA GPU"
    elif not gpu.get("kernel_arch"):
        run_why = f"GPU is {gpu['capability']}; the kernel targets sm_90a and sm_100a"
    else:
        run_why = "cuda-python is not installed"
    backends = {
        "reference": {**can(versions["torch"] is not None, "torch is not installed",
                            "megakernel.reference.model"),
                      "devices": ["cpu"] + (["cuda"] if gpu["available"] else [])},
        "cpu-executor": can(versions["torch"] is not None, "torch is not installed",
                            BACKENDS["cpu-executor"][0]),
        "kernel-compile": can(dsl is not None, "nvidia-cutlass-dsl is not installed",
                              "megakernel.kernel"),
        "kernel-run": can(run_ok, run_why, BACKENDS["kernel"][0]),
    }
    return {"python": platform.python_version(), "versions": versions, "gpu": gpu,
            "backends": backends}


def add_info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run_info(args: argparse.Namespace) -> int:
    info = machine_info()
    print(f"python {info['python']}")
    for dist, v in info["versions"].items():
        print(f"{dist} {v or 'not installed'}")
    g = info["gpu"]
    if g["available"]:
        arch = g["kernel_arch"] or "not a kernel target"
        print(f"GPU: {g['name']} ({g['capability']}, {arch}) x{g['count']}")
    else:
        print("GPU: none (torch.cuda.is_available() is False)")
    what = {"reference": "reference model", "cpu-executor": "CPU executor of the kernel program",
            "kernel-compile": "kernel compile (AOT, needs the DSL, no GPU)",
            "kernel-run": "kernel run (needs an sm_90a/sm_100a GPU)"}
    for name, b in info["backends"].items():
        state = "yes" if b["ok"] else f"no: {b['why']}"
        extra = f" on {', '.join(b['devices'])}" if b["ok"] and "devices" in b else ""
        missing = "" if b["module_present"] else f" ({b['module']} is not in this tree yet)"
        print(f"  {what[name]}: {state}{extra}{missing}")
    if args.json:
        print(json.dumps(info))
    return 0


register("info", "versions, GPU, and what each backend can do here", __name__,
         "add_info_arguments", "run_info")
register("generate", "greedy generation with a chosen backend", __name__,
         "add_generate_arguments", "run_generate")
register("demo", "the main job: plan, CPU executor vs reference, AOT build (GPU run if any)",
         "megakernel.demo")
register("plan", "compile a decode-step program and print its predicted cost",
         "megakernel.plan_cli")
register("build", "AOT-compile the kernel for sm_90a/sm_100a (needs the DSL, not a GPU)",
         "megakernel.kernel.build")
register("gpu-check", "check prebuilt cubins on this GPU against the reference and executor",
         "megakernel.gpu_check")


# ---- entry point ---------------------------------------------------------------------------------
def _chosen(argv: Sequence[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
        if a in ("-h", "--help"):
            return None
    return None


def build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, Command | None]:
    """The parser, with full arguments only for the command named in `argv`."""
    parser = argparse.ArgumentParser(prog=PROG, description="One fused decode-step kernel for "
                                     "dense and hybrid LLMs: reference, CPU executor, CuTe DSL "
                                     "kernel.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    name = _chosen(argv)
    chosen = None
    for cmd_name, cmd in COMMANDS.items():
        p = sub.add_parser(cmd_name, help=cmd.help, description=cmd.help)
        if cmd_name == name:
            try:
                add = getattr(importlib.import_module(cmd.module), cmd.add)
            except (ImportError, AttributeError) as e:
                raise CliError(f"command {cmd_name!r} is not available: {e}") from None
            add(p)
            chosen = cmd
    return parser, chosen


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def run_command() -> int:
        parser, cmd = build_parser(argv)
        args = parser.parse_args(argv)  # exits 2 with usage on bad syntax
        assert cmd is not None
        return getattr(importlib.import_module(cmd.module), cmd.run)(args)

    return run_main(run_command)
