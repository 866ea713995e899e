"""Greedy generation with a hybrid model from a preset or checkpoint, recurrent or ReplaySSM.

The entry point `generate --backend reference` wires `--replay-window L` to: it runs the torch
reference (rung 1). The compiled hybrid program runs on the CPU executor through
`megakernel.hybrid_executor.generate` (`generate --backend cpu-executor`, same flags).
"""

from __future__ import annotations

import torch

from megakernel.config import ConfigError

from .weights import load_model

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
           "float32": torch.float32}


def generate(spec: str, prompts: list[list[int]], steps: int, replay_window: int | None = None,
             dtype: str | torch.dtype = "bf16", seed: int = 0, device: str = "cpu"
             ) -> list[list[int]]:
    """Greedy new tokens for each prompt.

    spec: a hybrid preset name (random weights from `seed`) or a checkpoint directory.
    replay_window: None for the recurrent update, L >= 1 for ReplaySSM folding every L tokens.
    dtype: "bf16" runs the bf16 mirror with bf16 weights; "fp32" the fp32 truth.
    """
    from reference.hybrid import build_model
    from reference.hybrid import generate as greedy

    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; use bf16 or fp32")
        dtype = _DTYPES[dtype]
    if dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"unsupported dtype {dtype}; use bf16 or fp32")
    cfg, weights = load_model(spec, seed=seed, dtype=dtype)
    mode = "bf16" if dtype == torch.bfloat16 else "fp32"
    model = build_model(cfg, weights, mode=mode, device=device, replay_window=replay_window)
    return greedy(model, prompts, steps)
