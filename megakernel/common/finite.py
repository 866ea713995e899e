"""Run-time check of a decode step's logits, shared by every backend (reference, CPU executor,
kernel).

Checkpoints are checked finite at load (models/weights.py and gguf.py), but finite weights can
still overflow at run time (a huge norm or projection weight, an exploding residual). Two ways
it shows in the logits, both of which greedy decoding would turn into token 0 forever:

- NaN or Inf logits (an Inf reached the LM head);
- a row whose logits are all equal: an RMSNorm's sum of squares overflowed fp32, so its
  1/sqrt(mean x^2 + eps) is 0 and the normalised row is exactly 0 (transformers computes the
  same). A trained or random model never gives one value for the whole vocabulary.

The check is one pass over the logits per step (isfinite, max, min per row): negligible next to
the step. Generation stops with an error naming the step and the rows.
"""

from __future__ import annotations

import torch

from megakernel.common.errors import UserError


class NonFiniteError(UserError, ValueError):
    """A step produced NaN or Inf logits: the model's numbers overflow (a user error, exit 2)."""


def check_logits(logits: torch.Tensor, step: int, backend: str) -> None:
    """NonFiniteError unless every row of logits [..., V] of step `step` (the backend's count: 0
    is its first step) is finite and not constant."""
    flat = logits.reshape(-1, logits.shape[-1])
    finite = torch.isfinite(flat).all(dim=-1)  # [rows]
    if not bool(finite.all()):
        raise NonFiniteError(f"{backend}: non-finite logits at step {step} (rows "
                             f"{_rows(~finite)}): the model's activations overflow; check the "
                             "weights")
    flat_rows = flat.amax(dim=-1) == flat.amin(dim=-1)
    if bool(flat_rows.any()):
        raise NonFiniteError(
            f"{backend}: degenerate logits at step {step} (rows {_rows(flat_rows)}: every logit "
            f"equals {float(flat[flat_rows][0, 0]):g}): the model's activations overflow (an "
            "RMSNorm's sum of squares beyond fp32 normalises the row to 0); check the weights")


def _rows(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in torch.nonzero(mask).reshape(-1)[:4]]
