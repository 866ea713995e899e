"""The generation backends, one table for the CLI (`generate --backend`) and the Python API
(`load(backend=...)`): name -> the module and function of its batch `generate`, imported only when
that backend runs, and which backends compute in bf16 only.

Every backend's function is `generate(cfg, weights, prompts, steps, max_seq_len, seed,
replay_window=None) -> list[list[int]]`: the new tokens per prompt (prompt excluded).
"""

from __future__ import annotations

from typing import Any

BACKENDS: dict[str, tuple[str, str]] = {
    "kernel": ("megakernel.kernel_backend", "generate"),  # the fused kernel, sm_90a/sm_100a GPU
    "cpu-executor": ("megakernel.executor", "generate"),  # the same program on the CPU executor
    "reference": (__name__, "reference_generate"),  # the torch reference
}
BF16_ONLY = ("kernel", "cpu-executor")
AUTO = "auto"  # the API's choice: the kernel where it can run here, else the CPU executor


def reference_generate(
    cfg: Any, weights: dict, prompts: list[list[int]], steps: int, max_seq_len: int, seed: int,
    replay_window: int | None = None, mode: str = "bf16", device: str = "cpu",
) -> list[list[int]]:
    """The reference model's greedy generation (seed unused: greedy decoding is deterministic)."""
    from megakernel.reference.model import ReferenceModel, generate

    model = ReferenceModel(cfg, weights, mode=mode, device=device, replay_window=replay_window)
    return generate(model, prompts, steps, max_seq_len)
