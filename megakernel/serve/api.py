"""The Python API: one call to load a model, one to generate.

    import megakernel as mk
    llm = mk.load("llama-tiny", backend="auto", max_batch=8, max_seq_len=256)
    out = llm.generate([[5, 17, 3], [7, 1]], max_new_tokens=16, eos_token_id=None)
    out.tokens  # new tokens per prompt, each ending at its EOS

Backends: "kernel" (the fused kernel on an sm_90a/sm_100a GPU), "cpu-executor" (the same program on
the CPU executor), "emulator" (the kernel's own build, made here through the DSL, its PTX run by the
CPU emulator: slow, for checking the kernel), "reference" (the torch reference, bf16 mode); "auto"
takes the kernel where a GPU and a build are available, else the CPU executor (never the emulator),
and says which on stderr. Prefill and decode both run on the program (megakernel.serve.engine).
Programs (and the kernel's builds) are made per batch bucket 1, 2, 4, ... up to max_batch, as
CUDA-graph engines do; a call's batch is padded to its bucket with copies of its first prompt whose
outputs are dropped (copies, so that the chunked prefill still covers the shortest real prompt).

`load(..., speculative="ngram:3")` (or "mtp:K", "draft:MODEL:K"; megakernel/serve/speculative.py)
decodes speculatively: after every prompt's first new token, steps of 1 + k tokens verify k
drafts and keep the accepted ones, on the program (the reference backend: its own loop). The
tokens are plain greedy decoding's; `out.speculative` says how many drafts were accepted.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megakernel.launch.checks import ArgumentError
from megakernel.launch.runtime import KernelUnavailable
from megakernel.serve.backends import AUTO
from megakernel.serve.backends import BACKENDS as _GENERATORS
from megakernel.serve.engine import PREFILL_CHUNK

BACKENDS = (AUTO, *_GENERATORS)  # "auto", then megakernel.serve.backends' table
KERNEL_BACKENDS = ("kernel", "emulator")  # the kernel's build: on the GPU, or emulated


class GenerationError(ArgumentError):
    """Bad input to the Python API (a user error: the CLI prints it and exits 2)."""


@dataclass
class GenerationOutput:
    """tokens: new ids per prompt (each ends at its EOS when it met one); texts: their decoding
    when the model has a tokenizer; first_token_s: time until every prompt had its first new
    token (None for the reference); total_s: the whole call."""

    tokens: list[list[int]]
    backend: str
    texts: list[str] | None = None
    first_token_s: float | None = None
    total_s: float = 0.0
    # with speculative decoding: engine.Generated.speculative_stats ("method", "k", "steps",
    # "accepted_per_step", "tokens_per_step"); None without
    speculative: dict | None = None


def bucket(n: int, max_batch: int) -> int:
    """The batch a call of n prompts runs at: the next power of two, at most max_batch."""
    return min(1 << (n - 1).bit_length(), max_batch)


def _kernel_available(cfg, replay: bool = False) -> str | None:  # noqa: ANN001
    """None when the kernel can run `cfg` here (`replay`: with a ReplaySSM window), else why
    not."""
    from megakernel.common.errors import SpecError
    from megakernel.kernel.config.model_spec import check_kernel_support
    from megakernel.launch.device_state import ENV_BUILD_DIR

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        check_kernel_support(cfg, replay)
    except SpecError as e:
        return str(e)
    if not os.environ.get(ENV_BUILD_DIR) and importlib.util.find_spec("cutlass") is None:
        return f"no build (${ENV_BUILD_DIR} unset and the DSL is not installed)"
    return None


class LLM:
    """A loaded model and its generation backend; see the module docstring."""

    def __init__(self, cfg, weights: dict[str, torch.Tensor], backend: str = "auto",  # noqa: ANN001
                 max_batch: int = 8, max_seq_len: int = 4096, replay_window: int | None = None,
                 tokenizer: Any = None, build_dir: str | Path | None = None,
                 speculative: Any = None, seed: int = 0) -> None:
        from megakernel.serve.backends import check_speculative
        from megakernel.serve.speculative import parse

        if backend not in BACKENDS:
            raise GenerationError(f"unknown backend {backend!r}; choose from "
                                  f"{', '.join(BACKENDS)}")
        if max_batch < 1:
            raise GenerationError(f"max_batch must be >= 1, got {max_batch}")
        if not 1 <= max_seq_len <= cfg.max_position_embeddings:
            raise GenerationError(f"max_seq_len must be in [1, {cfg.max_position_embeddings}] "
                                  f"(the model's max_position_embeddings), got {max_seq_len}")
        if replay_window is not None and (replay_window < 1 or not cfg.recurrent_layers()):
            raise GenerationError(f"replay_window {replay_window} needs a model with recurrent "
                                  f"layers and L >= 1")
        spec = parse(speculative)  # SpeculativeError (a UserError) names a bad method string
        check_speculative(spec, cfg, replay_window, "replay_window=L")
        host_drafts = spec is not None and spec.method != "ngram"
        if backend == AUTO:
            why = _kernel_available(cfg, bool(replay_window))
            if why is None and host_drafts:
                why = f"speculative {spec} drafts on the host, which the kernel backend does not"
            backend = "kernel" if why is None else "cpu-executor"
            print(f"megakernel: backend {backend}" + (f" ({why})" if why else ""),
                  file=sys.stderr)
        elif backend in KERNEL_BACKENDS:
            from megakernel.kernel.config.model_spec import check_kernel_support
            from megakernel.serve.kernel_backend import require_gpu

            if host_drafts:
                from megakernel.serve.speculative import SpeculativeError

                raise SpeculativeError(f"speculative {spec} drafts on the host (megakernel."
                                       "drafters), which runs on the cpu-executor and reference "
                                       "backends, not the kernel; use ngram:K on the kernel")
            # SpecError names the layer kinds it cannot run
            check_kernel_support(cfg, bool(replay_window), drafts=spec.k if spec else 0,
                                 ngram=spec.ngram if spec else 0)
            if backend == "kernel":
                require_gpu()  # KernelUnavailable
        self.cfg, self.weights, self.backend = cfg, weights, backend
        self.max_batch, self.max_seq_len, self.replay_window = max_batch, max_seq_len, replay_window
        self.tokenizer, self.build_dir = tokenizer, build_dir
        self.speculative, self.seed = spec, seed  # megakernel.serve.speculative.Speculative | None
        self._programs: dict[tuple[int, ...], object] = {}  # (batch, tokens[, k, n]) -> Program
        self._kernels: dict[int, object] = {}  # batch -> kernel_backend.Megakernel
        self._packed = None

    # ---- input ---------------------------------------------------------------------------------
    def _prompts(self, prompts: list[list[int]] | list[str], max_new_tokens: int,
                 chat: bool = False) -> list[list[int]]:
        if isinstance(prompts, str) or not prompts:
            raise GenerationError("prompts must be a non-empty list (of token id lists or, with "
                                  "a tokenizer, of strings)")
        if chat:
            from megakernel.serve.chat import chat_ids

            if not all(isinstance(p, str | list) and p and not isinstance(p[0], int)
                       for p in prompts):
                raise GenerationError("chat=True takes text prompts (or conversations of "
                                      "messages), not token ids")
            prompts = [chat_ids(self.tokenizer, p) for p in prompts]
        elif all(isinstance(p, str) for p in prompts):
            if self.tokenizer is None:
                raise GenerationError("text prompts need a checkpoint with a tokenizer; pass "
                                      "token ids")
            prompts = [list(self.tokenizer(p)["input_ids"]) for p in prompts]
        ids = [[int(t) for t in p] for p in prompts]
        if len(ids) > self.max_batch:
            raise GenerationError(f"{len(ids)} prompts exceed max_batch {self.max_batch}")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.cfg.vocab_size
        for i, p in enumerate(ids):
            if not p:
                raise GenerationError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise GenerationError(f"token id {bad[0]} in prompt {i} is outside the "
                                      f"vocabulary [0, {vocab})")
            need = len(p) + max_new_tokens - 1
            if self.speculative is not None:  # the last step still verifies 1 + k tokens
                from megakernel.serve.engine import spec_max_seq_len

                need = spec_max_seq_len(len(p), max_new_tokens, self.speculative.k)
            if need > self.max_seq_len:
                what = f" and speculative {self.speculative}" if self.speculative else ""
                raise GenerationError(f"prompt {i} ({len(p)} tokens) plus {max_new_tokens} new "
                                      f"tokens{what} needs {need} positions, more than "
                                      f"max_seq_len {self.max_seq_len}")
        return ids

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]] | list[str], max_new_tokens: int = 16,
                 eos_token_id: int | None = None, chat: bool = False) -> GenerationOutput:
        """Greedy generation of up to max_new_tokens per prompt; a prompt stops at its EOS
        (included) and the call returns when every prompt has stopped. `chat`: each prompt (a
        user message, or a list of {"role", "content"} messages) goes through the model's chat
        template, generation stops at the model's EOS unless `eos_token_id` says otherwise, and
        the texts leave special tokens out."""
        from megakernel.serve.chat import model_eos, until_eos

        ids = self._prompts(prompts, max_new_tokens, chat)
        if chat and eos_token_id is None:
            eos_token_id = model_eos(self.tokenizer)
        t0 = time.perf_counter()
        first_s, stats = None, None
        if self.backend == "reference":
            if self.speculative is not None:
                g = self._reference_speculative(ids, max_new_tokens)
                tokens, stats = g.tokens, self._stats(g)
            else:
                tokens = self._reference(ids, max_new_tokens)
        else:
            g = self._program(ids, max_new_tokens, eos_token_id)
            tokens, first_s = g.tokens, g.first_token_s
            stats = self._stats(g) if self.speculative is not None else None
        tokens = [until_eos(t, eos_token_id) for t in tokens]
        texts = ([self.tokenizer.decode(t, skip_special_tokens=chat) for t in tokens]
                 if self.tokenizer is not None else None)
        return GenerationOutput(tokens, self.backend, texts, first_s, time.perf_counter() - t0,
                                stats)

    def _stats(self, g) -> dict:  # noqa: ANN001 (engine.Generated)
        sp = self.speculative
        stats = g.speculative_stats(sp.method, sp.k)
        if sp.model is not None:
            stats["draft_model"] = sp.model
        return stats

    def _drafts_fn(self, batch: int):  # noqa: ANN202
        """This call's host drafter (None for ngram:K: the program drafts); drafters keep
        per-row state, so each call gets its own."""
        from megakernel.serve.backends import drafts_function

        return drafts_function(self.speculative, self.cfg, self.weights, self.backend, batch,
                               self.max_seq_len, seed=self.seed)

    def _reference(self, ids: list[list[int]], steps: int) -> list[list[int]]:
        from megakernel.reference.model import ReferenceModel, generate

        ref = ReferenceModel(self.cfg, self.weights, mode="bf16",
                             replay_window=self.replay_window)
        return generate(ref, ids, steps, self.max_seq_len)

    def _reference_speculative(self, ids: list[list[int]], steps: int):  # noqa: ANN202
        from megakernel.serve.backends import reference_speculative_generate

        return reference_speculative_generate(
            self.cfg, self.weights, ids, steps, self.max_seq_len, self.seed, self.replay_window,
            self.speculative, self._drafts_fn(len(ids)))

    def _program(self, ids: list[list[int]], steps: int, eos: int | None):  # noqa: ANN202
        """Run the bucket's program with copies of the first prompt padding the batch (they never
        shorten the chunked prefill); drop their rows."""
        n = len(ids)
        b = bucket(n, self.max_batch)
        padded = ids + [ids[0]] * (b - n)
        live = [True] * n + [False] * (b - n)
        sp = self.speculative
        drafts_fn = self._drafts_fn(b) if sp is not None else None
        if self.backend in KERNEL_BACKENDS:
            g = self._kernel(b).generate_program(padded, steps, eos, live=live,
                                                 chunk_tokens=PREFILL_CHUNK, speculative=sp,
                                                 drafts_fn=drafts_fn)
        else:
            from megakernel.program.pack import pack_weights
            from megakernel.serve.engine import program_generate
            from megakernel.serve.executor_backend import executor_steppers, speculative_stepper

            if self._packed is None:
                self._packed = pack_weights(self.cfg, self.weights)
            chunk = min(PREFILL_CHUNK, min(len(p) for p in ids) - 1)

            def compile_fn(t: int, drafts: int = 0, ngram: int = 0) -> object:
                return self._compiled(b, t, drafts, ngram)

            single, chunk_st = executor_steppers(
                self.cfg, self._packed, b, self.max_seq_len, self.replay_window, chunk,
                compile_fn=compile_fn)
            spec = None
            if sp is not None:
                ngram = sp.ngram if drafts_fn is None else 0
                spec = speculative_stepper(single, self._packed, compile_fn, sp.k, ngram)
            g = program_generate(single, padded, steps, eos, chunk=chunk_st, live=live,
                                 spec=spec, drafts_fn=drafts_fn)
        g.tokens = g.tokens[:n]
        return g

    def _compiled(self, batch: int, tokens: int, drafts: int = 0, ngram: int = 0):  # noqa: ANN202
        from megakernel.program.compiler import compile_program
        from megakernel.serve.executor_backend import executor_gpu

        key = (batch, tokens, drafts, ngram) if drafts else (batch, tokens)
        if key not in self._programs:
            self._programs[key] = compile_program(
                self.cfg, batch, executor_gpu(), tokens=tokens, max_seq_len=self.max_seq_len,
                replay_window=self.replay_window, drafts=drafts, ngram=ngram)
        return self._programs[key]

    def _kernel(self, batch: int):  # noqa: ANN202
        from megakernel.serve.kernel_backend import Megakernel

        if batch not in self._kernels:
            where = (dict(device="cpu", emulate=True) if self.backend == "emulator" else {})
            self._kernels[batch] = Megakernel(self.cfg, self.weights, batch=batch,
                                              max_seq_len=self.max_seq_len,
                                              build_dir=self.build_dir,
                                              replay_window=self.replay_window, **where)
        return self._kernels[batch]


def load(model: str | Path, backend: str = "auto", max_batch: int = 8, max_seq_len: int = 4096,
         replay_window: int | None = None, seed: int = 0,
         build_dir: str | Path | None = None, weights: str = "bf16",
         fp8_granularity: str = "channel", fp8_lm_head: bool = False,
         speculative: str | None = None) -> LLM:
    """Load a preset (random bf16 weights from `seed`), a Hugging Face checkpoint directory or a
    GGUF file (its tokenizer too, when it has one) and pick the backend; see the module
    docstring. `weights="fp8"` quantizes the block matrices to e4m3 on load (scales per output
    channel, or per 128x128 block with `fp8_granularity="block"`; the LM head too with
    `fp8_lm_head`); an FP8 checkpoint loads as FP8 either way (docs/FP8.md). `speculative`:
    "ngram:K", "mtp:K" or "draft:MODEL:K" (the module docstring; a model with recurrent layers
    needs `replay_window`)."""
    from megakernel.models.gguf import is_gguf
    from megakernel.models.sources import load_model

    if weights != "fp8" and (fp8_granularity != "channel" or fp8_lm_head):
        from megakernel.common.errors import ConfigError

        raise ConfigError("fp8_granularity and fp8_lm_head apply with weights='fp8'")
    from megakernel.serve.speculative import parse

    mtp = (parse(speculative) or parse("ngram:1")).method == "mtp"  # loads the MTP modules
    cfg, weights = load_model(str(model), seed=seed, dtype=torch.bfloat16, weights=weights,
                              granularity=fp8_granularity, lm_head=fp8_lm_head, mtp=mtp)
    tokenizer = None
    if Path(model).is_dir() or is_gguf(model):
        from megakernel.common.errors import ConfigError
        from megakernel.serve.chat import ChatError, load_tokenizer

        try:
            tokenizer = load_tokenizer(str(model))
        except (ChatError, ConfigError):  # no tokenizer files, or none in the GGUF metadata
            tokenizer = None  # token ids only
    return LLM(cfg, weights, backend, max_batch, max_seq_len, replay_window, tokenizer,
               build_dir, speculative, seed)


__all__ = ["BACKENDS", "GenerationError", "GenerationOutput", "KernelUnavailable", "LLM",
           "bucket", "load"]
