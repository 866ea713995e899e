"""The "cpu-executor" generation backend: greedy decoding whose decode steps run the program on
the CPU executor."""

from __future__ import annotations

import torch

from megakernel.executor.core import Executor, ExecutorError
from megakernel.program.gpus import GPU
from megakernel.program.gpus import gpu as gpu_by_name

DEFAULT_SMS = 8  # SMs of the description the CPU backend compiles for (fewer = faster on a CPU)


def executor_gpu(num_sms: int = DEFAULT_SMS, base: str = "h100") -> GPU:
    return gpu_by_name(base).with_sms(num_sms)


def generate(cfg, weights: dict[str, torch.Tensor], prompts: list[list[int]], steps: int,  # noqa: ANN001
             max_seq_len: int | None = None, seed: int = 0, num_sms: int = DEFAULT_SMS,
             check: bool = True, replay_window: int | None = None) -> list[list[int]]:
    """Greedy generation like `reference.generate`, decode steps run by the program.

    The prompt is prefilled by the reference in "bf16" mode (its cache is copied into the
    program's buffers); every decode step is one program step, and since the program feeds its
    own tokens back and advances the lengths, the host only reads tokens_out between steps.
    `replay_window`: None runs recurrent layers by the recurrent update, L by ReplaySSM.
    """
    from megakernel.program.compiler import compile_program
    from megakernel.program.pack import pack_weights
    from megakernel.reference.model import ReferenceModel, greedy

    if steps < 0:
        raise ExecutorError(f"steps must be >= 0, got {steps}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ExecutorError("every prompt needs at least one token")
    if steps == 0:
        return [[] for _ in prompts]
    if max_seq_len is None:
        max_seq_len = max(len(p) for p in prompts) + steps - 1
    ref = ReferenceModel(cfg, weights, mode="bf16", replay_window=replay_window)
    cache = ref.new_cache(len(prompts), max_seq_len)
    first = greedy(ref.prefill(cache, prompts))  # [B]
    out = [first]
    if steps > 1:
        prog = compile_program(cfg, len(prompts), executor_gpu(num_sms), tokens=1,
                               max_seq_len=max_seq_len, replay_window=replay_window)
        ex = Executor(prog, pack_weights(cfg, weights), check=check)
        ex.load_cache(cache)
        tok = ex.step(first[:, None], seed=seed)
        out.append(tok[:, 0])
        for i in range(steps - 2):
            out.append(ex.step(None, seed=seed + 1 + i)[:, 0])
    return torch.stack(out, dim=1).tolist()
