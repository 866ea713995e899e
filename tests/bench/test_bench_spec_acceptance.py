"""bench/spec_acceptance.py's arithmetic: the per-draft acceptance, a workload's row from the
drafts accepted, the speedups priced by the cost model and the target judged per input-grounded
workload (met and not met both reported). The SmolLM2 runs themselves are the bench's, not a
test's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megakernel.models import preset
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu

_spec = importlib.util.spec_from_file_location(
    "bench_spec_acceptance", Path(__file__).resolve().parents[2] / "bench" / "spec_acceptance.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_spec_acceptance"] = bench
_spec.loader.exec_module(bench)


def test_per_draft_acceptance_inverts_the_geometric_sum() -> None:
    for k, a in ((1, 0.3), (3, 0.6), (7, 0.9)):
        assert bench.per_draft_acceptance(sum(a**i for i in range(k + 1)), k) == \
            pytest.approx(a, abs=1e-9)
    assert bench.per_draft_acceptance(1.0, 3) == pytest.approx(0.0, abs=1e-9)


def test_workloads_name_both_kinds() -> None:
    names = [w.name for w in bench.WORKLOADS]
    assert len(set(names)) == len(names)
    grounded = {w.name for w in bench.WORKLOADS if w.grounded}
    assert {"code-edit", "quote", "summarise", "answer-from-context"} <= grounded
    assert any(not w.grounded for w in bench.WORKLOADS)
    assert all(w.chat or w.completions for w in bench.WORKLOADS)


def test_a_row_and_its_speedup() -> None:
    wl = bench.WORKLOADS[0]
    row = bench.accepted_row(wl, 3, [[3, 1], [2, 2], [0, 3]], 2, 64)  # 11 of 6 -> 1 + 11/6
    assert row["tokens_per_step"] == pytest.approx(1 + 11 / 6) and row["grounded"]
    sp = bench.speedups([row], [("llama-tiny", preset("llama-tiny"))], "h200", 16)
    g = gpu("h200")
    plain = compile_program(preset("llama-tiny"), 1, g).cost.predicted_s
    three = compile_program(preset("llama-tiny"), 1, g, drafts=3, ngram=3).cost.predicted_s
    assert sp[0]["speedup"] == pytest.approx((1 + 11 / 6) * plain / three, rel=1e-9)
    assert sp[0]["tokens_per_s_per_user"] == pytest.approx((1 + 11 / 6) / three, rel=1e-9)
    assert "| code-edit | 2.83 tok/step" in bench.table(sp)


def test_steps_past_the_end_of_the_answer_are_not_counted() -> None:
    """Row 0's answer is 6 tokens, the prefill's first included: its steps emitting 3 and 2
    reach it, its third step (3 accepted) is past it. A row with all its `steps` tokens is no
    longer in the steps' rows: with 10 steps, row 0 (10 tokens after three) leaves the fourth."""
    acc = [[2, 0], [1, 0], [3, 2], [0]]
    assert bench.counted_steps(acc, 2, 10, [6, 64]) == [2, 0, 1, 0, 2, 0]
    assert bench.counted_steps(acc, 2, 10) == [2, 0, 1, 0, 3, 2, 0]
    with pytest.raises(ValueError, match="a step of 2 rows, 1 still generating"):
        bench.counted_steps(acc[:3] + [[0, 0]], 2, 10)
    row = bench.accepted_row(bench.WORKLOADS[1], 3, acc, 2, 10, [6, 64])
    assert row["steps"] == 6 and row["accepted_per_step"] == pytest.approx(5 / 6)


def test_targets_take_the_best_k_of_each_grounded_workload() -> None:
    def r(wl: str, grounded: bool, k: int, speedup: float) -> dict:
        return dict(model="m", workload=wl, grounded=grounded, k=k, speedup=speedup)

    sp = [r("quote", True, 1, 1.5), r("quote", True, 5, 2.4), r("quote", True, 7, 2.1),
          r("summarise", True, 3, 1.2), r("free-text", False, 3, 3.0)]
    t = {x["workload"]: x for x in bench.targets(sp)}
    assert set(t) == {"quote", "summarise"}  # free text is not judged
    assert t["quote"]["k"] == 5 and t["quote"]["met"]
    assert t["summarise"]["speedup"] == 1.2 and not t["summarise"]["met"]
