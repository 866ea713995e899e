"""Run-time check that a decode step's logits are finite, shared by every backend.

Checkpoints are checked finite at load (models/weights.py), but finite weights can still overflow
at run time (a huge norm weight, an exploding residual). Greedy decoding of NaN logits silently
returns token 0 forever; this check stops generation instead, naming the step.
"""

from __future__ import annotations

import torch

from megakernel.errors import UserError


class NonFiniteError(UserError, ValueError):
    """A step produced NaN or Inf logits: the model's numbers overflow (a user error, exit 2)."""


def check_logits(logits: torch.Tensor, step: int, backend: str) -> None:
    """NonFiniteError unless every logit [rows, V] of step `step` (the backend's count: 0 is its
    first step) is finite."""
    ok = torch.isfinite(logits).all(dim=-1).reshape(-1)  # [rows]
    if not bool(ok.all()):
        rows = [int(i) for i in torch.nonzero(~ok).reshape(-1)[:4]]
        raise NonFiniteError(f"{backend}: non-finite logits at step {step} (rows "
                             f"{rows}): the model's activations overflow; check the weights")
