"""gpu-check's paged case, simulated (the op on CPU tensors runs the CPU executor): the paged
program next to the contiguous one from the same prefill; pages scattered to the wrong
sequences must fail it."""

from __future__ import annotations

import pytest

from megakernel.gpu_check.case import Weights, run_case
from megakernel.gpu_check.cases import STAGES, Case
from megakernel.program import paged as paged_mod

CASE = Case("llama-tiny", 3, 1, 3, 0, paged=4, cap_s=30)


def test_stage_one_runs_paged_cases_on_both_variants():
    for g in STAGES[1].groups:
        assert any(c.paged for c in g.cases), g.variant


def test_simulated_paged_case_agrees_with_the_contiguous_program():
    r = run_case(CASE, None, Weights(), simulate=True)
    assert r["ok"] and r["paged_ok"] and r["paged_identical"], r
    assert r["paged_pages_untouched"] and r["paged_pad_finite"]


def test_simulated_paged_case_fails_misplaced_pages(monkeypatch: pytest.MonkeyPatch):
    """The prefill's pages scattered through a block table whose rows are rotated (sequence b's
    keys land in sequence b + 1's blocks): the step's reads are right, what they find is not."""
    right = paged_mod.load_pages

    def rotated(k, v, kv_slot, cache, table, block_size) -> None:  # noqa: ANN001
        right(k, v, kv_slot, cache, table.roll(1, 0), block_size)

    monkeypatch.setattr(paged_mod, "load_pages", rotated)
    r = run_case(CASE, None, Weights(), simulate=True)
    assert r["paged_logit_over"] > 0 and not r["paged_ok"] and not r["ok"]
