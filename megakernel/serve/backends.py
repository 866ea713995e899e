"""The generation backends, one table for the CLI (`generate --backend`) and the Python API
(`load(backend=...)`): name -> the module and function of its batch `generate`, imported only when
that backend runs, and which backends compute in bf16 only.

Every backend's function is `generate(cfg, weights, prompts, steps, max_seq_len, seed,
replay_window=None) -> list[list[int]]`: the new tokens per prompt (prompt excluded).
"""

from __future__ import annotations

from typing import Any

BACKENDS: dict[str, tuple[str, str]] = {
    # the fused kernel, sm_90a/sm_100a GPU
    "kernel": ("megakernel.serve.kernel_backend", "generate"),
    # the same program on the CPU executor
    "cpu-executor": ("megakernel.serve.executor_backend", "generate"),
    # the kernel's own build (JIT through the DSL here), its PTX run by the CPU emulator
    "emulator": ("megakernel.serve.kernel_backend", "emulated_generate"),
    "reference": (__name__, "reference_generate"),  # the torch reference
}
BF16_ONLY = ("kernel", "cpu-executor", "emulator")
# the API's choice: the kernel where it can run here, else the CPU executor (never the emulator:
# it checks the kernel, it is not a way to serve)
AUTO = "auto"


def reference_generate(
    cfg: Any, weights: dict, prompts: list[list[int]], steps: int, max_seq_len: int, seed: int,
    replay_window: int | None = None, mode: str = "bf16", device: str = "cpu",
) -> list[list[int]]:
    """The reference model's greedy generation (seed unused: greedy decoding is deterministic)."""
    from megakernel.reference.model import ReferenceModel, generate

    model = ReferenceModel(cfg, weights, mode=mode, device=device, replay_window=replay_window)
    return generate(model, prompts, steps, max_seq_len)


# ---- speculative decoding (`--speculative`, `load(speculative=)`) --------------------------------
# name -> the module and function of its speculative generate: `fn(cfg, weights, prompts, steps,
# max_seq_len, seed, replay_window=None, speculative=Speculative, drafts_fn=None, ...)` ->
# engine.Generated (tokens per prompt, accepted drafts per step and live row)
SPECULATIVE: dict[str, tuple[str, str]] = {
    "kernel": ("megakernel.serve.kernel_backend", "speculative_generate"),
    "emulator": ("megakernel.serve.kernel_backend", "emulated_speculative_generate"),
    "cpu-executor": (__name__, "executor_speculative_generate"),
    "reference": (__name__, "reference_speculative_generate"),
}


def check_speculative(spec: Any, cfg: Any, replay_window: int | None, flag: str) -> None:
    """SpeculativeError (a UserError) for a method this model cannot run as asked: recurrent
    layers need ReplaySSM (`flag` names how the caller passes the window)."""
    from megakernel.serve.speculative import SpeculativeError

    if spec is not None and cfg.recurrent_layers() and replay_window is None:
        raise SpeculativeError(
            f"speculative decoding ({spec}) of {cfg.name or cfg.family}'s recurrent layers needs "
            f"ReplaySSM: the recurrent update keeps no committed state to return to after a "
            f"rejected draft; pass {flag} (e.g. 16)")


def drafts_function(spec: Any, cfg: Any, weights: dict, backend: str, batch: int,
                    max_seq_len: int, seed: int = 0, mode: str = "bf16",
                    device: str = "cpu") -> Any:
    """The host drafter of a method (`drafts_fn(histories, k)` for engine.program_generate and
    reference.speculative.generate) from megakernel.serve.drafters.make, or None for ngram:K, which
    the program drafts on the device. `mode`, `device`: the reference backend's; `seed`: a
    preset draft model's random weights. SpeculativeError names what a method cannot do here
    (an mtp:K target without MTP modules, a draft model of another vocabulary, a host drafter
    on the kernel backend)."""
    if spec is None or spec.method == "ngram":
        return None
    from megakernel.serve import drafters

    return drafters.make(spec, cfg, weights, batch, max_seq_len, backend, seed=seed, mode=mode,
                         device=device)


def reference_speculative_generate(
    cfg: Any, weights: dict, prompts: list[list[int]], steps: int, max_seq_len: int, seed: int,
    replay_window: int | None = None, speculative: Any = None, drafts_fn: Any = None,
    mode: str = "bf16", device: str = "cpu",
) -> Any:
    """The reference's greedy speculative generation (reference/speculative.generate: the same
    tokens as plain greedy decoding) as an engine.Generated with the accepted drafts of the live
    rows per step."""
    import time

    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.speculative import generate
    from megakernel.serve.engine import Generated

    t0 = time.perf_counter()
    model = ReferenceModel(cfg, weights, mode=mode, device=device, replay_window=replay_window)
    k = speculative.k
    # finished rows are not stepped: a live row's cache needs the engine's length
    tokens, acc = generate(model, prompts, steps, k, drafts_fn, max_seq_len)
    return Generated(tokens, total_s=time.perf_counter() - t0, steps={1 + k: len(acc)},
                     accepted=acc)


def executor_speculative_generate(
    cfg: Any, weights: dict, prompts: list[list[int]], steps: int, max_seq_len: int, seed: int,
    replay_window: int | None = None, speculative: Any = None, drafts_fn: Any = None,
    check: bool = True,
) -> Any:
    """The CPU executor's speculative generation (megakernel.serve.engine): prefill and the first
    token on the T = 1 program, then steps of 1 + k tokens that accept on the program; ngram:K
    drafts on the program too (NGRAM), other methods through `drafts_fn`. Returns
    engine.Generated."""
    from megakernel.program.compiler import compile_program
    from megakernel.program.pack import pack_weights
    from megakernel.serve.engine import PREFILL_CHUNK, program_generate
    from megakernel.serve.executor_backend import (
        DEFAULT_SMS,
        executor_gpu,
        executor_steppers,
        speculative_stepper,
    )

    b = len(prompts)

    def compile_fn(tokens: int, drafts: int = 0, ngram: int = 0) -> Any:
        return compile_program(cfg, b, executor_gpu(DEFAULT_SMS), tokens=tokens,
                               max_seq_len=max_seq_len, replay_window=replay_window,
                               drafts=drafts, ngram=ngram)

    packed = pack_weights(cfg, weights)
    chunk = min(PREFILL_CHUNK, min(len(p) for p in prompts) - 1)
    single, chunk_st = executor_steppers(cfg, packed, b, max_seq_len, replay_window, chunk,
                                         check, seed, compile_fn)
    ngram = speculative.ngram if drafts_fn is None else 0
    spec = speculative_stepper(single, packed, compile_fn, speculative.k, ngram, check, seed)
    return program_generate(single, prompts, steps, chunk=chunk_st, spec=spec,
                            drafts_fn=drafts_fn,
                            hidden_log=getattr(drafts_fn, "hidden_log", None))  # mtp:K
