"""bench/replay.py's byte accounting: the analytic stand-in equal to step_bytes_by_category of the
compiled programs, parts summing to totals, ReplaySSM moving fewer state bytes than the recurrent
update, and the compiler's refusals (checked before scheduling) as the analytic rows' reason."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megakernel import isa
from megakernel.isa.stages import PlanError
from megakernel.layers.base import StepShape
from megakernel.models import preset, real_presets
from megakernel.program.buffers import plan_buffers
from megakernel.program.bytes import step_bytes_by_category
from megakernel.program.compiler import compile_program
from megakernel.program.gpus import gpu
from tests.registries import HYBRID_TINY

_spec = importlib.util.spec_from_file_location(
    "bench_replay", Path(__file__).resolve().parents[2] / "bench" / "replay.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_replay"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

TINY = HYBRID_TINY  # the tiny preset of every hybrid family
H200 = gpu("h200")
INT32_MAX = 2**31 - 1


def expert_op(op: int) -> bool:
    return isa.spec(op).slab and isa.spec(op).kind == "moe"


@pytest.fixture(scope="module")
def bases():
    return {m: compile_program(preset(m), 1, H200, policy="structure") for m in TINY}


@pytest.mark.parametrize("model", TINY)
@pytest.mark.parametrize("batch,L", [(64, None), (256, 16), (3, 4)])
def test_analytic_equals_compiled(bases, model, batch, L):
    """The stand-in program (batch-1 slabs, experts re-weighted) gives step_bytes_by_category of
    the program compiled at that batch, and the cost report counts the same total."""
    prog = compile_program(preset(model), batch, H200, replay_window=L)
    hb = bench.integral(step_bytes_by_category(prog))
    assert bench.analytic_bytes(bases[model], batch, replay_window=L) == hb
    assert prog.cost.bytes_per_step == hb["total"]


@pytest.mark.parametrize("model", TINY)
def test_rows_parts_sum_and_replay_moves_less_state(model):
    rows = bench.bench_model(model, [1, 256], H200, 16, None, compile_max_batch=256)
    assert [(r.batch, r.mode, r.source) for r in rows] == [
        (1, "recurrent", "compiled"), (1, "replay L=16", "compiled"),
        (256, "recurrent", "compiled"), (256, "replay L=16", "compiled")]
    for r in rows:
        s = r.split()
        assert sum(s.values()) == r.bytes["total"] > 0
        assert r.bytes["total"] == r.bytes["read"] + r.bytes["written"]
        assert r.floor_s == pytest.approx(r.bytes["total"] / H200.copy_bw)
        assert r.predicted_s is not None and r.predicted_s > r.floor_s
    rec, rep = rows[2].split(), rows[3].split()
    for k in ("weights", "per_seq_weights", "expert", "kv", "conv", "state_read"):
        assert rec[k] == rep[k], k
    # ReplaySSM writes the state once per L steps and pays a ring instead
    assert rec["ring"] == 0 < rep["ring"]
    assert rep["state_written"] == pytest.approx(rec["state_written"] / 16, abs=1)
    assert rep["state_read"] + rep["state_written"] < rec["state_read"] + rec["state_written"]
    # the state bytes are the configuration's fp32 state of every sequence: the buffer plan's
    # state regions (per recurrent layer: conv window, state, ring), the "state" ones only
    buf = plan_buffers(preset(model), StepShape(256, 1, 64, 1, H200.num_sms, 0))
    assert len(buf.state) == len(preset(model).recurrent_layers())
    assert rec["state_read"] == 4 * sum(regs["state"].numel for regs in buf.state.values())


def test_experts_reweighted_with_batch(bases):
    """Kimi's routed experts: E (1 - (1 - k/E)^N) of them are expected to be streamed: more
    rows, more expert bytes, never more than every expert once."""
    base = bases["kimi-linear-tiny"]
    ex = [bench.analytic_bytes(base, b)["expert"] for b in (1, 8, 64, 256)]
    assert ex == sorted(ex) and ex[0] < ex[-1]
    e = base.cfg.kind_config("moe")
    times = {0: e.num_experts, -1: 1}  # work slot 0 is expert 0's matrix, -1 the shared expert's
    every = sum(i.operands["NROWS"] * i.operands["K"] * 2 * times.get(i.operands["SLOT"], 0)
                for i in base.instrs if expert_op(i.op))
    assert ex[1] < ex[-1] <= every
    assert bench.analytic_bytes(bases["qwen3.5-tiny"], 64)["expert"] == 0


@pytest.mark.parametrize("model,least", [("qwen3.5-9b", 1.1), ("nemotron-h-8b", 1.2),
                                         ("kimi-linear-48b-a3b", 1.01)])
def test_real_presets_replay_wins_at_large_batch(model, least):
    """On the real shapes ReplaySSM moves fewer bytes in total at B = 64 (ring included); the
    saving is the state writes skipped minus the ring. Kimi's step is mostly routed experts at
    B = 64, so its gain is small; at B = 1 the weights dominate every model."""
    base = compile_program(preset(model), 1, H200, policy="structure")
    rec, rep = (bench.analytic_bytes(base, 64, replay_window=L) for L in (None, 16))
    assert rec["total"] / rep["total"] > least
    saved = rec["state_written"] - rep["state_written"] - rep["ring_read"] - rep["ring_written"]
    assert rec["total"] - rep["total"] == saved > 0
    one = [bench.analytic_bytes(base, 1, replay_window=L)["total"] for L in (None, 16)]
    assert one[0] / one[1] == pytest.approx(1.0, abs=0.05)


def test_refusal_is_the_compilers_own():
    """By design the state arena no longer limits a plan (64-bit state offsets: the header
    carries STATE_NUMEL as two int32 words), so the B = 256 rows the old bench had to leave
    analytic ("state arena exceeds int32 STATE_NUMEL") compile now; refusal() still names what
    the compiler refuses before scheduling (too many rows, a cache larger than the GPU)."""
    assert bench.refusal(preset("qwen3.5-9b"), 256, H200, 16) is None
    assert bench.refusal(preset("nemotron-h-8b"), 256, H200, None) is None
    prog = compile_program(preset("nemotron-h-8b"), 256, H200, replay_window=16,
                           policy="structure")
    numel = prog.buffers.state_numel
    assert numel > INT32_MAX  # what the int32 STATE_NUMEL field could not hold
    assert prog.header["STATE_NUMEL_LO"] == isa.split64(numel)[0]
    assert prog.header["STATE_NUMEL_HI"] == isa.split64(numel)[1] > 0
    assert bench.refusal(preset("qwen3.5-tiny"), 256, H200, 16) is None
    why = bench.refusal(preset("qwen3.5-tiny"), 512, H200, None)
    assert "activation rows" in why
    with pytest.raises(PlanError, match="activation rows"):
        compile_program(preset("qwen3.5-tiny"), 512, H200, policy="structure")
    why = bench.refusal(preset("qwen3.5-9b"), 256, H200, 16, max_seq_len=262144)
    assert why is not None and "too many sequences for the cache" in why


def test_slow_programs_are_compiled_at_batch_1_only(monkeypatch):
    """Above SLOW_INSTRUCTIONS (Kimi Linear's ~120k) only B = 1 is compiled; the rest are the
    stand-in, with the reason in the source column."""
    monkeypatch.setattr(bench, "SLOW_INSTRUCTIONS", 10)
    rows = bench.bench_model("nemotron-h-tiny", [1, 2], H200, 4, None, None)
    assert [r.source for r in rows] == ["compiled"] * 2 + [
        "analytic (compile > 1 rows too slow for a bench)"] * 2
    assert all(r.predicted_s is None for r in rows[2:])
    assert rows[3].floor_s == pytest.approx(rows[3].bytes["total"] / H200.copy_bw)


def test_bench_catches_a_stand_in_that_disagrees(monkeypatch):
    """The byte-for-byte check of every compiled row is live: experts never re-weighted."""
    monkeypatch.setattr(bench, "expert_share", lambda cfg, expert, rows: 1.0)
    with pytest.raises(AssertionError, match="analytic != compiled bytes.*expert"):
        bench.bench_model("kimi-linear-tiny", [2], H200, 4, None, None)


def test_default_models_are_the_real_recurrent_presets():
    names = bench.recurrent_presets()
    assert {"qwen3.5-0.8b", "qwen3.5-9b", "nemotron-h-8b", "kimi-linear-48b-a3b"} <= set(names)
    assert set(names) <= set(real_presets())
    assert "llama-3.2-1b" not in names and not any(n.endswith("-tiny") for n in names)


def test_main_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--models", "nemotron-h-tiny", "--batches", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| nemotron-h-tiny | 2 | replay L=16 |" in text and "runtime" in text
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["rows"]] == ["recurrent", "replay L=16"]
    assert data["rows"][0]["bytes"]["total"] == sum(data["rows"][0]["split"].values())


def test_bad_replay_window_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--models", "qwen3.5-tiny", "--batches", "1", "--replay-window", "0"])
    assert "--replay-window must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("model", TINY)
def test_weights_once_do_not_grow_with_batch(bases, model):
    """Splitting off the per-sequence reads leaves the matrices, read once at any batch."""
    once = set()
    for b in (1, 8, 256):
        hb = bench.analytic_bytes(bases[model], b)
        per_seq = bench.per_sequence_weight_bytes(preset(model), b)
        assert 0 < per_seq < hb["weights"]
        once.add(hb["weights"] - per_seq)
    assert len(once) == 1
