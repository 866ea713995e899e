"""What the dense and hybrid executor tests share: the logit check of one step."""

from __future__ import annotations

import torch


def check_logits(step: int, mine: torch.Tensor, l16: torch.Tensor, l32: torch.Tensor,
                 tol: float) -> float:
    """Asserts the executor's logits are within `tol` of the bf16 reference's and within 2x the
    bf16 reference's own error against the fp32 reference plus 0.01; returns the first error."""
    err = (mine - l16).abs().max().item()
    assert err <= tol, f"step {step}: executor vs bf16 reference {err:.3g}"
    e_ex, e_16 = (mine - l32).abs().max().item(), (l16 - l32).abs().max().item()
    assert e_ex <= 2 * e_16 + 0.01, f"step {step}: vs fp32 {e_ex:.3g} > 2 x {e_16:.3g}"
    return err
