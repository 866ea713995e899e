"""bench/hindcast.py: Hazy Research's Llama-3.2-1B schedule under this project's cost model, the
held-out errors of the three folds, the JSON last line, and the calibrated defaults it backs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megakernel import isa
from megakernel.program.cost import CostParams

_spec = importlib.util.spec_from_file_location(
    "bench_hindcast", Path(__file__).resolve().parents[2] / "bench" / "hindcast.py")
hc = importlib.util.module_from_spec(_spec)
sys.modules["bench_hindcast"] = hc
_spec.loader.exec_module(hc)


@pytest.fixture(scope="module")
def result() -> dict:
    return hc.hindcast()


def test_hazy_schedule_is_65_instructions_per_sm() -> None:
    """At most one QKV, O-proj, up/gate and down slab per SM per layer (O-proj and down have
    128 slabs of 16 rows for 132 SMs) plus the LM head: 65 on the busiest SMs; attention on a
    few SMs; no embedding or argmax; every weight byte once; the replay finishes (no deadlock)
    above the read-bandwidth floor."""
    prog = hc.hazy_program("h200")
    ops = prog.ops_histogram()
    layers, n = prog.cfg.num_layers, prog.num_sms
    assert ops["QKV"] == ops["GATEUP"] == layers * n and ops["LMHEAD"] == n
    assert ops["OPROJ"] == ops["DOWN"] == layers * 128
    assert "EMBED" not in ops and "ARGMAX" not in ops
    for q in prog.queues:
        kinds = [(prog.instrs[i].op, prog.instrs[i].layer) for i in q
                 if prog.instrs[i].op != isa.Op.ATTN_PARTIAL]
        assert len(kinds) == len(set(kinds))  # one of each kind per layer
    per_sm = [sum(prog.instrs[i].op != isa.Op.ATTN_PARTIAL for i in q) for q in prog.queues]
    assert max(per_sm) == hc.INSTR_PER_SM
    weights = sum(i.w_bytes for i in prog.instrs if isa.spec(i.op).slab)
    assert weights == 2 * (prog.cfg.num_parameters() - 2 * 2048 * 16 - 2048)
    assert prog.ring_bytes == 13 * 16 * 1024
    r = hc.predict("h200")
    assert r.predicted_s > r.floor_s and r.instructions == len(prog.instrs)


def test_held_out_errors_within_ten_percent(result: dict) -> None:
    """Fit on two GPUs, predict the third: within +-10% for each choice of held-out GPU."""
    rows = result["held_out"]
    assert sorted(r["gpu"] for r in rows) == ["b200", "h100", "h200"]
    for r in rows:
        assert r["rel_error"] == pytest.approx(r["predicted_us"] / r["measured_us"] - 1, abs=1e-3)
        assert abs(r["rel_error"]) <= 0.10, r
    # the previous parameters (the ~125-instruction derivation) were 28% fast on B200
    assert result["previous_params_us"]["b200"] < 0.8 * hc.MEASURED_US["b200"]


def test_defaults_are_the_all_gpu_fit(result: dict) -> None:
    """CostParams' defaults are the fit on all three GPUs, rounded."""
    fitted, d = result["all_gpus"]["params"], CostParams()
    assert d.mem_latency * 1e9 == pytest.approx(fitted["mem_latency_ns"], rel=0.01)
    assert d.fixed_per_instr * 1e9 == pytest.approx(fitted["fixed_per_instr_ns"], rel=0.01)
    assert d.fma_efficiency == pytest.approx(fitted["fma_efficiency"], rel=0.01)
    for g, m in hc.MEASURED_US.items():
        assert abs(result["defaults_us"][g] / m - 1) <= 0.10


def test_json_last_line(capsys: pytest.CaptureFixture, result: dict,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hc, "hindcast", lambda: result)
    assert hc.main(["--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [set(r) for r in last["held_out"]] == [
        {"gpu", "predicted_us", "measured_us", "rel_error"}] * 3
    assert {f["held_out"] for f in last["folds"]} == set(hc.MEASURED_US)
