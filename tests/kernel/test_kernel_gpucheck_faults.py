"""gpu-check's verdicts pinned by planted faults: each verdict field must fail its case and the
report when the "kernel" gets that one thing wrong.

Simulated, the kernel *is* the CPU executor, so without a planted fault these paths only ever see
passing runs and a slip in the wiring (a field dropped from `ok`, a run compared with itself, a
loosened bound, an empty report counted as a pass) would leave every test green while the first
GPU report said PASS for a broken kernel. The seam is a test-only wrapper (monkeypatch, no
production change) around what serves the kernel's launches when simulated: `Megakernel.step`
(the contiguous kernel: its logits, KV cache and recurrent state after each step) and the op's
`torch_op._outputs` for the paged build. Every fault is planted so that only its own field sees
it; the test checks that the other fields still pass, that its field fails, that the case fails
and that a report holding it (next to a passing case) says FAIL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megakernel.gpu_check import driver
from megakernel.gpu_check.case import SIMULATED_STEPS, Weights, run_case
from megakernel.gpu_check.cases import Case, Group, Stage
from megakernel.gpu_check.report import Report
from megakernel.launch import torch_op
from megakernel.serve import kernel_backend

WEIGHTS = Weights()  # one set of random weights per model for the whole module
DENSE = Case("llama-tiny", 2, 1, 2, 2)  # 2 steps, both also run by the executor
HYBRID = Case("qwen3.5-tiny", 2, 1, 2, 2)  # recurrent layers: state parity after each step
PAGED = Case("llama-tiny", 3, 1, 2, 0, paged=4)
# a change of this many bf16 ulps of a row's largest magnitude: twice same_program's bound (2),
# yet, put on the row's smallest element, far inside the band (set by the largest errors). A
# literal: loosening same_program's bound past it must let this fault through (the tests fail)
ROW_ULPS_OFF = 4.0
# the recurrent state nudged by this fraction of the arena's largest magnitude: outside
# STATE_RTOL (1e-3), inside 10x it. A literal, not a multiple of STATE_RTOL: loosening the bound
# must let this fault through (so this test fails), not move the fault along with it
STATE_NUDGE = 3e-3

Fault = Callable[[kernel_backend.Megakernel, int, tuple], tuple]


def steps_of(c: Case) -> int:
    """The checked steps of a simulated case (the replays' steps come after them)."""
    return min(c.steps, SIMULATED_STEPS)


@pytest.fixture
def faulty_kernel(monkeypatch: pytest.MonkeyPatch) -> Callable[[Fault], None]:
    """Install `fault(mk, call, (tokens, logits)) -> (tokens, logits)` after every kernel step:
    `call` counts from 1, the case's checked steps first, then two replays of one step each."""
    def install(fault: Fault) -> None:
        real = kernel_backend.Megakernel.step
        calls = [0]

        def step(self: kernel_backend.Megakernel, *a: Any, **k: Any) -> tuple:
            out = real(self, *a, **k)
            calls[0] += 1
            return fault(self, calls[0], out)
        monkeypatch.setattr(kernel_backend.Megakernel, "step", step)
    return install


def off_by_ulps(x: torch.Tensor) -> None:
    """Move the smallest nonzero magnitude of x's first row (last dim) by ROW_ULPS_OFF bf16 ulps
    of that row's largest, in place: a few ulps to the same program's comparison, nothing to
    the band."""
    row = x.view(-1, x.shape[-1])[0]
    mag = row.float().abs().masked_fill(row.float() == 0, float("inf"))
    i = int(mag.argmin())
    before = float(row[i])
    row[i] = (before + ROW_ULPS_OFF * 2.0 ** -8 * row.float().abs().max()).to(row.dtype)
    assert float(row[i]) != before


def judged(tmp_path: Path, res: dict[str, Any]) -> dict[str, Any]:
    """The report of a run holding `res` and one passing case: what its summary says."""
    r = Report(tmp_path / "report", tmp_path / "builds", simulate=True, budget_s=60.0)
    r.stage(Stage(1, "shapes", "planted faults"))
    r.result(1, {"kind": "check", "name": "check clean [default]", "variant": "default"},
             {"case": "clean", "ok": True})
    r.result(1, {"kind": "check", "name": f"check {res['case']} [default]",
                 "variant": "default"}, res)
    r.finish(1.0)
    md = (tmp_path / "report" / "gpu_check.md").read_text()
    assert "**FAIL**" in md and "**PASS**" not in md
    return r.data


def assert_fails_alone(tmp_path: Path, res: dict[str, Any], field: str) -> None:
    """`field` failed, the case failed, and the report (with a passing case beside it) failed."""
    assert res[field] is False, res
    assert not res["ok"], res
    d = judged(tmp_path, res)
    assert not d["ok"] and d["ok_by_stage"] == {"1": False}


def test_a_wrong_kv_cache_fails(tmp_path: Path, faulty_kernel) -> None:  # noqa: ANN001
    """An old cache position overwritten at the last step (the step's logits and its new entries
    are right): only the KV band can see it."""
    def fault(mk, call, out):  # noqa: ANN001, ANN202
        if call == steps_of(DENSE):
            mk.k_cache[0, 0, 0, 0] += 1.0
        return out
    faulty_kernel(fault)
    r = run_case(DENSE, None, WEIGHTS, simulate=True)
    assert r["band_failures"] == 0 and r["deterministic"] and r["executor_ok"]
    assert r["kv_max_err"] > r["kv_allowed"]
    assert_fails_alone(tmp_path, r, "kv_ok")


def test_a_replay_that_differs_in_one_element_fails(tmp_path: Path, faulty_kernel) -> None:  # noqa: ANN001
    """A racy kernel: the second replay of the same step from the same snapshot differs from the
    first by one ulp in one logit."""
    def fault(mk, call, out):  # noqa: ANN001, ANN202
        tok, logits = out
        if call == steps_of(DENSE) + 2:  # the second replay
            logits = logits.clone()
            logits.view(-1)[5] = torch.nextafter(logits.view(-1)[5], torch.tensor(float("inf")))
        return tok, logits
    faulty_kernel(fault)
    r = run_case(DENSE, None, WEIGHTS, simulate=True)
    assert r["band_failures"] == 0 and r["kv_ok"] and r["executor_ok"]
    assert_fails_alone(tmp_path, r, "deterministic")


def test_logits_inside_the_band_but_not_the_executors_fail(tmp_path: Path,  # noqa: ANN001
                                                           faulty_kernel) -> None:
    """A summation-order bug: one logit a few ulps off the executor's at every executor step,
    far inside the band and no token changed."""
    def fault(mk, call, out):  # noqa: ANN001, ANN202
        tok, logits = out
        if call <= DENSE.executor_steps:
            logits = logits.clone()
            off_by_ulps(logits)
        return tok, logits
    faulty_kernel(fault)
    r = run_case(DENSE, None, WEIGHTS, simulate=True)
    assert r["band_failures"] == 0 and r["token_mismatches"] == r["not_own_argmax"] == 0
    assert r["kv_ok"] and r["deterministic"] and r["executor_kv_over"] == 0
    assert r["executor_logit_over"] == DENSE.executor_steps
    assert_fails_alone(tmp_path, r, "executor_ok")


def test_new_kv_entries_inside_the_band_but_not_the_executors_fail(tmp_path: Path,  # noqa: ANN001
                                                                   faulty_kernel) -> None:
    """The last executor step's new key entries a few ulps off the executor's (inside the KV
    band): only the same-program comparison of the new entries sees it."""
    def fault(mk, call, out):  # noqa: ANN001, ANN202
        if call == DENSE.executor_steps:
            n = mk.lengths[0] - 1  # the position this step wrote for sequence 0
            off_by_ulps(mk.k_cache[0, 0, 0, n])
        return out
    faulty_kernel(fault)
    r = run_case(DENSE, None, WEIGHTS, simulate=True)
    assert r["band_failures"] == 0 and r["kv_ok"] and r["deterministic"]
    assert r["executor_logit_over"] == 0 and r["executor_kv_over"] == 1
    assert_fails_alone(tmp_path, r, "executor_ok")


def test_a_state_off_by_three_times_the_bound_fails(tmp_path: Path, faulty_kernel) -> None:  # noqa: ANN001
    """The recurrent state after the last step nudged in one element by STATE_NUDGE of the
    arena's largest magnitude (no logit sees it): outside STATE_RTOL, inside 10x it."""
    def fault(mk, call, out):  # noqa: ANN001, ANN202
        if call == steps_of(HYBRID):
            mk.state[mk.state.numel() // 2] += STATE_NUDGE * float(mk.state.abs().max())
        return out
    faulty_kernel(fault)
    r = run_case(HYBRID, None, WEIGHTS, simulate=True)
    assert r["band_failures"] == 0 and r["kv_ok"] and r["deterministic"]
    assert r["executor_logit_over"] == r["executor_kv_over"] == 0
    assert r["executor_state_max_diff"] > 0
    assert_fails_alone(tmp_path, r, "executor_state_ok")
    assert r["executor_ok"] is False


def test_paged_logits_off_the_contiguous_kernels_fail(tmp_path: Path,  # noqa: ANN001
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The paged build's logits a few ulps off the contiguous kernel's in one element of a live
    row (inside the band, its token unchanged): only the paged comparison sees it."""
    real = torch_op._outputs

    def outputs(e, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        tok, logits = real(e, *a, **k)
        if e.prog is not None and e.prog.buffers.paged is not None and logits.numel():
            off_by_ulps(logits[0])  # row 0: a live sequence
        return tok, logits
    monkeypatch.setattr(torch_op, "_outputs", outputs)
    r = run_case(PAGED, None, WEIGHTS, simulate=True)
    assert r["band_failures"] == 0 and r["kv_ok"] and r["deterministic"]
    assert r["paged_band_failures"] == r["paged_token_mismatches"] == 0
    assert r["paged_logit_over"] == steps_of(PAGED) and not r["paged_identical"]
    assert_fails_alone(tmp_path, r, "paged_ok")


def test_a_report_with_no_case_run_fails(tmp_path: Path) -> None:
    """Nothing judged is not a pass: an empty report, and a run whose every case was skipped
    (no build for this arch: a wrong --build-dir on the GPU machine)."""
    r = Report(tmp_path / "empty", tmp_path / "builds", simulate=False, budget_s=60.0)
    r.finish(0.0)
    assert r.data["cases"] == [] and not r.data["ok"]
    assert "**FAIL**" in (tmp_path / "empty" / "gpu_check.md").read_text()

    stages = (Stage(0, "launch", "doc", (Group("default", (Case("llama-tiny", 1, 1, 8),)),)),)
    d = driver.run(tmp_path / "out", tmp_path / "no-builds", [0], simulate=False, budget_s=60.0,
                   arch="sm_90a", stage_table=stages)
    assert d["cases"] == [] and len(d["skipped"]) == 1 and not d["ok"]
    assert "**FAIL**" in (tmp_path / "out" / "gpu_check.md").read_text()
