"""The "cpu-executor" generation backend: greedy generation whose prefill and decode steps run the
program on the CPU executor (megakernel.serve.engine), and its steppers (`executor_steppers`), which
the Python API's cpu-executor backend drives too."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megakernel.executor.core import Executor, ExecutorError
from megakernel.executor.gpu import DEFAULT_SMS, executor_gpu
from megakernel.serve.engine import PREFILL_CHUNK, STATE_ARENAS, program_generate, spec_max_seq_len


def generate(cfg, weights: dict[str, torch.Tensor], prompts: list[list[int]], steps: int,  # noqa: ANN001
             max_seq_len: int | None = None, seed: int = 0, num_sms: int = DEFAULT_SMS,
             check: bool = True, replay_window: int | None = None,
             chunk_tokens: int = PREFILL_CHUNK, drafts: int = 0, ngram: int = 0,
             drafts_fn=None) -> list[list[int]]:  # noqa: ANN001
    """Greedy generation like `reference.generate`, prefill and decode run by the program.

    The prompts run through the program from an empty cache and state (megakernel.serve.engine): in
    chunks of `chunk_tokens` per sequence as far as the shortest prompt allows, then one token
    per step with per-row feeding; the output at a prompt's last token is its first new token.
    `replay_window`: None runs recurrent layers by the recurrent update, L by ReplaySSM.
    `drafts` k > 0: after the prefill, speculative steps of 1 + k tokens, drafted by the device
    n-gram drafter (`ngram`: its longest suffix) or by `drafts_fn(histories, k)` (engine.py).
    """
    from megakernel.program.compiler import compile_program
    from megakernel.program.pack import pack_weights

    if steps < 0:
        raise ExecutorError(f"steps must be >= 0, got {steps}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ExecutorError("every prompt needs at least one token")
    if steps == 0:
        return [[] for _ in prompts]
    if max_seq_len is None:
        max_seq_len = spec_max_seq_len(max(len(p) for p in prompts), steps, drafts)
    chunk_tokens = min(chunk_tokens, min(len(p) for p in prompts) - 1)

    def compile_fn(tokens: int, drafts: int = 0, ngram: int = 0):  # noqa: ANN202
        return compile_program(cfg, len(prompts), executor_gpu(num_sms), tokens=tokens,
                               max_seq_len=max_seq_len, replay_window=replay_window,
                               drafts=drafts, ngram=ngram)

    packed = pack_weights(cfg, weights)
    single, chunk = executor_steppers(cfg, packed, len(prompts), max_seq_len, replay_window,
                                      chunk_tokens, check, seed, compile_fn)
    spec = (speculative_stepper(single, packed, compile_fn, drafts, ngram, check, seed)
            if drafts else None)
    return program_generate(single, prompts, steps, chunk=chunk, spec=spec,
                            drafts_fn=drafts_fn).tokens


# ---- steppers -----------------------------------------------------------------------------------
class ExecutorStepper:
    """An engine.Stepper: a program on the CPU executor (`check`: its race detector and write
    counts)."""

    def __init__(self, prog, packed, check: bool = False, seed: int = 0,  # noqa: ANN001
                 arenas: dict[str, torch.Tensor] | None = None) -> None:
        self.prog, self.tokens = prog, prog.tokens
        self.ex = Executor(prog, packed, check=check, arenas=arenas)
        self.ex.state.zero_()  # recurrent state and conv windows start empty
        self.seed = seed
        self.steps = 0  # steps run, named by a logits error

    def step(self, tokens: torch.Tensor | None) -> torch.Tensor:
        from megakernel.common.finite import check_logits

        self.seed += 1
        out = self.ex.step(tokens, seed=self.seed)
        check_logits(self.ex.logits, self.steps, "cpu-executor")  # greedy of them is token 0
        self.steps += 1
        return out

    def arenas(self) -> dict[str, torch.Tensor]:
        return {n: self.ex.arena_tensor(n) for n in STATE_ARENAS}

    def hidden(self) -> torch.Tensor:
        """f32 h [N, H] of the last step: the residual stream before the final norm."""
        return self.ex.region("f32", "h")

    def sync(self) -> None:
        pass


def executor_steppers(cfg, packed, batch: int, max_seq_len: int,  # noqa: ANN001
                      replay_window: int | None = None, chunk_tokens: int = 1,
                      check: bool = False, seed: int = 0,
                      compile_fn: Callable[..., object] | None = None
                      ) -> tuple[ExecutorStepper, ExecutorStepper | None]:
    """(single, chunk) steppers on fresh, empty arenas; the two share the KV cache tensors.
    `compile_fn(tokens)` returns the program for T tokens (cached by the caller)."""
    from megakernel.program.compiler import compile_program

    if compile_fn is None:
        def compile_fn(tokens: int) -> object:
            return compile_program(cfg, batch, executor_gpu(), tokens=tokens,
                                   max_seq_len=max_seq_len, replay_window=replay_window)

    single = ExecutorStepper(compile_fn(1), packed, check=check, seed=seed)
    chunk = None
    if chunk_tokens > 1:
        kv = {n: single.ex.arena_tensor(n) for n in ("k", "v")}
        chunk = ExecutorStepper(compile_fn(chunk_tokens), packed, check=check,
                                seed=seed + 10_000, arenas=kv)
    return single, chunk


def speculative_stepper(single: ExecutorStepper, packed, compile_fn: Callable[..., object],  # noqa: ANN001
                        drafts: int, ngram: int = 0, check: bool = False, seed: int = 0
                        ) -> ExecutorStepper:
    """The speculative program's stepper (1 + `drafts` tokens; `ngram`: the device drafter),
    sharing `single`'s KV cache tensors."""
    kv = {n: single.ex.arena_tensor(n) for n in ("k", "v")}
    return ExecutorStepper(compile_fn(1 + drafts, drafts=drafts, ngram=ngram), packed,
                           check=check, seed=seed + 20_000, arenas=kv)
