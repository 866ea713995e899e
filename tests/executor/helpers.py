"""What the dense and hybrid executor tests share: the logit check of one step."""

from __future__ import annotations

import torch

# |executor - bf16 reference| / |bf16 reference - fp32 reference| per step: measured at most 0.54
# (dense, tests/executor/test_executor_dense.py) and 0 (hybrid, bit-identical)
REL_TOL = 0.75


def check_logits(step: int, mine: torch.Tensor, l16: torch.Tensor, l32: torch.Tensor,
                 tol: float, rel: float = REL_TOL) -> float:
    """Asserts the executor's logits are within `tol` of the bf16 reference's and within `rel` x
    the bf16 reference's own error against the fp32 reference (the executor rounds where the
    bf16 reference does: a result rounded otherwise, or not at all, fails), and within 2x that
    own error plus 0.01 of the fp32 truth (docs/TESTING.md, Numerics); returns the first error."""
    err = (mine - l16).abs().max().item()
    e_ex, e_16 = (mine - l32).abs().max().item(), (l16 - l32).abs().max().item()
    assert err <= tol, f"step {step}: executor vs bf16 reference {err:.3g}"
    assert err <= rel * e_16, (f"step {step}: executor vs bf16 reference {err:.3g} > {rel} x "
                               f"the bf16 reference's own error {e_16:.3g}")
    assert e_ex <= 2 * e_16 + 0.01, f"step {step}: vs fp32 {e_ex:.3g} > 2 x {e_16:.3g}"
    return err
