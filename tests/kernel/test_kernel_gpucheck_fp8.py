"""gpu-check's FP8 cases (docs/GPU-CHECK.md, docs/FP8.md): the cases in the stages, their builds
distinct from the bf16 ones, a simulated FP8 case run end to end on the FP8 program against the
FP8 model's references, a kernel that computes the bf16 model failing it, the benchmark's FP8 row
with the FP8 program's bytes, and the report showing the format and judging the FP8 targets.

The FP8 targets' metric itself (vs_bf16: met, not met, not measured) is in
tests/bench/test_bench_decode.py with the other targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megakernel.gpu_check import driver
from megakernel.gpu_check.case import Weights, fp8_matrices, run_case
from megakernel.gpu_check.cases import BENCH_CASES, STAGES, Case, Stage
from megakernel.gpu_check.report import Report
from megakernel.serve import kernel_backend

WEIGHTS = Weights()
CHANNEL = Case("llama-tiny", 2, 1, 2, 2, fp8="channel")  # 2 steps, both against the executor


def _stage_cases(number: int, variant: str) -> list[Case]:
    return [c for g in STAGES[number].groups if g.variant == variant for c in g.cases]


def test_fp8_cases_are_in_the_stages():
    from megakernel.kernel.config.model_spec import make_spec
    from megakernel.kernel.host.variants import VARIANTS

    s1 = _stage_cases(1, "default")
    fp8 = {(c.model, c.batch, c.tokens, c.fp8) for c in s1 if c.fp8}
    assert fp8 == {("llama-tiny", 1, 1, "channel"), ("llama-tiny", 16, 1, "channel"),
                   ("llama-tiny", 4, 1, "block"), ("qwen3.5-tiny", 1, 1, "channel"),
                   ("qwen3.5-tiny", 4, 1, "channel")}
    for c in (c for c in s1 if c.fp8):
        assert c.executor_steps > 0 and c.cap_s <= 30, c  # as their bf16 neighbours
        assert c.config().quant.granularity == c.fp8
    # the FMA GEMV at B = 1 and the mma GEMV at B = 16 (default variant), FP8 builds
    mma = {c.batch: make_spec(c.config(), c.batch, c.tokens, "sm_90a", **VARIANTS["default"])
           for c in s1 if c.fp8 and c.model == "llama-tiny" and c.fp8 == "channel"}
    assert not mma[1].mma and mma[16].mma and mma[1].fp8 == mma[16].fp8 == "channel"
    glob = {(c.model, c.batch, c.fp8) for c in _stage_cases(1, "global") if c.fp8}
    assert {("llama-tiny", 1, "channel"), ("llama-tiny", 16, "channel"),
            ("llama-tiny", 1, "block"), ("qwen3.5-tiny", 1, "channel")} <= glob
    # stage 2: llama-3.2-1b FP8 at B = 1, benchmarked next to its bf16 model
    real = [c for c in _stage_cases(2, "default") if c.fp8]
    assert [(c.model, c.batch, c.fp8, c.bench) for c in real] == [
        ("llama-3.2-1b", 1, "channel", True)]
    assert real[0].cap_s <= 90 and real[0].executor_steps > 0
    bench = {(c.model, c.batch, c.weights) for c in BENCH_CASES}
    assert {("llama-3.2-1b", 1, "bf16"), ("llama-3.2-1b", 1, "fp8")} <= bench
    assert not BENCH_CASES[0].fp8  # the first bench case (timeline, A/B variants) is bf16
    # the compile baseline is a bf16 torch step: none for an FP8 case
    items = driver.bench_items(Path("."), None)
    assert not any(it["kind"] == "compile" and it["case"]["fp8"] for it in items)
    assert any(it["kind"] == "bench" and it["case"]["fp8"] for it in items)


def test_fp8_case_names_and_dicts():
    c = Case("llama-tiny", 4, 1, 16, 1, fp8="block")
    assert c.name == "llama-tiny B=4 T=1 fp8-block" and c.weights == "fp8-block"
    assert Case("llama-tiny", 4, 1, 16, fp8="channel").name.endswith(" fp8")
    assert Case("llama-tiny", 4, 1, 16).name == "llama-tiny B=4 T=1"  # bf16 names unchanged
    assert Case.from_dict(c.to_dict()) == c and c.to_dict()["fp8"] == "block"
    assert Case.from_dict({k: v for k, v in Case("llama-tiny", 1, 1, 8).to_dict().items()
                           if k != "fp8"}).fp8 == ""  # an older job's dict
    assert Case("llama-tiny", 1, 1, 8).config().quant is None


def test_prepare_builds_each_fp8_case_in_its_own_format(tmp_path):
    """--prepare's list holds every FP8 case on its variants, and each one's build (its spec's
    tag: the directory find_build looks in) is not the bf16 build of the same shape; the run looks
    an FP8 item's build up there (have_build), not in the bf16 one's directory."""
    from megakernel.gpu_check.prepare import wanted
    from megakernel.kernel.config.model_spec import make_spec

    w = wanted()
    fp8 = [(c, v) for c, v in w if c.fp8]
    assert {(c.model, c.batch, c.fp8, v) for c, v in fp8} >= {
        ("llama-tiny", 1, "channel", "default"), ("llama-tiny", 16, "channel", "default"),
        ("llama-tiny", 1, "channel", "global"), ("llama-tiny", 4, "block", "default"),
        ("qwen3.5-tiny", 4, "channel", "default"), ("llama-3.2-1b", 1, "channel", "default")}
    for c, _ in fp8:
        tag = make_spec(c.config(), c.batch, c.tokens, "sm_90a").tag
        bf16 = make_spec(Case(c.model, c.batch, c.tokens, 1).config(), c.batch, c.tokens,
                         "sm_90a").tag
        assert tag != bf16 and tag.endswith({"channel": "-fp8c", "block": "-fp8b"}[c.fp8]), tag
    # the FP8 item finds its build under its own tag only
    c = Case("llama-tiny", 1, 1, 8, 1, fp8="channel")
    it = driver.item("check", c, "default")
    bf16_tag = make_spec(Case("llama-tiny", 1, 1, 8).config(), 1, 1, "sm_90a").tag
    (tmp_path / bf16_tag / "sm_90a").mkdir(parents=True)
    (tmp_path / bf16_tag / "sm_90a" / "manifest.json").write_text("{}")
    assert not driver.have_build(tmp_path, it, "sm_90a")
    fp8_tag = make_spec(c.config(), 1, 1, "sm_90a").tag
    (tmp_path / fp8_tag / "sm_90a").mkdir(parents=True)
    (tmp_path / fp8_tag / "sm_90a" / "manifest.json").write_text("{}")
    assert driver.have_build(tmp_path, it, "sm_90a")


@pytest.mark.slow  # two kernel builds
def test_prepare_builds_an_fp8_case_beside_its_bf16_build(tmp_path, capsys):
    """A real --prepare of an FP8 case and its bf16 twin: two builds in two directories of the
    build set, the FP8 one's spec carrying the format (megakernel/kernel's FP8 build)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel.gpu_check import prepare

    c = Case("llama-tiny", 1, 1, 8, 1, fp8="channel")
    ms, failed = prepare(tmp_path, ["sm_90a"], [(c, "default"),
                                                (Case("llama-tiny", 1, 1, 8, 1), "default")])
    assert failed == [] and len(ms) == 2
    assert [m["spec"]["fp8"] for m in ms] == ["channel", ""]
    assert len(list(tmp_path.glob("*/sm_90a/manifest.json"))) == 2
    out = capsys.readouterr().out
    assert "built default llama-tiny B=1 T=1 fp8 sm_90a" in out
    assert "built default llama-tiny B=1 T=1 sm_90a" in out
    assert driver.have_build(tmp_path, driver.item("check", c, "default"), "sm_90a")


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_a_simulated_fp8_case_runs_the_fp8_program_and_passes(tmp_path, granularity):
    c = CHANNEL if granularity == "channel" else Case("llama-tiny", 2, 1, 2, 1, fp8="block")
    r = run_case(c, None, WEIGHTS, simulate=True)
    assert r["ok"] and r["weights"] == c.weights and r["fp8_matrices"] > 0, r
    assert r["executor_ok"] and r["kv_ok"] and r["deterministic"]
    assert 0 < r["max_err_kernel"] <= r["max_allowed"]
    md = judged(tmp_path, [r])
    assert f"| {c.name} | default" in md and "**PASS**" in md


def test_a_bf16_program_has_no_fp8_matrix():
    """What a bf16 case reports as fp8_matrices (read from the program, not the case)."""
    from megakernel.program.compiler import compile_program
    from megakernel.program.gpus import gpu

    c = Case("llama-tiny", 2, 1, 2)
    assert fp8_matrices(compile_program(c.config(), 2, gpu("h200"))) == 0
    fp8 = Case("llama-tiny", 2, 1, 2, fp8="channel").config()
    assert fp8_matrices(compile_program(fp8, 2, gpu("h200"))) > 0


def judged(tmp_path: Path, results: list[dict]) -> str:
    """The markdown of a simulated report holding `results` (stage 1, default variant)."""
    rep = Report(tmp_path / "report", tmp_path / "builds", simulate=True, budget_s=60.0)
    rep.stage(Stage(1, "shapes", "fp8"))
    for res in results:
        rep.result(1, {"kind": "check", "name": f"check {res['case']} [default]",
                       "variant": "default"}, res)
    rep.finish(1.0)
    return (tmp_path / "report" / "gpu_check.md").read_text()


def test_a_kernel_computing_the_bf16_model_fails_an_fp8_case(tmp_path, monkeypatch):
    """Planted: the "kernel" is built and packed for the bf16 model the FP8 weights came from
    (an FP8 build that reads its slabs as bf16 would be garbage; this is the subtle case: the
    right model before quantization). The references are the FP8 model's, so the band fails it
    at every step."""
    real = kernel_backend.Megakernel.__init__

    def bf16_kernel(self, cfg, weights, **k):  # noqa: ANN001, ANN003, ANN202
        base = cfg.replace(quant=None)
        real(self, base, WEIGHTS.get(base), **k)
    monkeypatch.setattr(kernel_backend.Megakernel, "__init__", bf16_kernel)
    r = run_case(CHANNEL, None, WEIGHTS, simulate=True)
    assert r["fp8_matrices"] == 0  # it ran the bf16 program
    assert r["band_failures"] == r["steps"] > 0 and r["max_err_kernel"] > r["max_allowed"]
    assert not r["ok"]
    assert "**FAIL**" in judged(tmp_path, [r])


def test_the_fp8_bench_row_counts_fp8_bytes(tmp_path):
    """The benchmark's FP8 row: the FP8 program's bytes per step (codes and scales, about half
    the bf16 row's weights), its format recorded; a synthetic FP8 case quantizes the lazily drawn
    weights one tensor at a time (models.fp8.QuantizedWeights over LazyRandomWeights)."""
    from megakernel.gpu_check import bench

    rows = {}
    for c in (Case("llama-tiny", 1, 1, 4, bench=True),
              Case("llama-tiny", 1, 1, 4, bench=True, fp8="channel"),
              Case("llama-tiny", 1, 1, 4, bench=True, fp8="channel", synthetic=True)):
        rows[c.name + (" synthetic" if c.synthetic else "")] = r = bench.bench_case(
            c, tmp_path, WEIGHTS, "default", 1e12, simulate=True)
        assert r["logits_finite"] and r["own_argmax"] and r["weights"] == c.weights, r
    bf16, fp8, syn = rows.values()
    assert fp8["bytes_per_step"] == syn["bytes_per_step"]
    # llama-tiny: 2 layers of 256x(512+256+256... ) weights in e4m3 + 4 B/row, a bf16 embedding
    assert 0.5 * bf16["bytes_per_step"] < fp8["bytes_per_step"] < 0.8 * bf16["bytes_per_step"]
    assert fp8["fraction_of_achievable"] == pytest.approx(
        fp8["bytes_per_step"] / (fp8["step_us"] / 1e6) / 1e12)


def test_the_report_shows_fp8_rows_and_judges_the_fp8_targets(tmp_path):
    """A synthetic H200 report with a bf16 and an FP8 row of llama-3.2-1b B=1: the decode table
    shows each row's format and bytes, the FP8 targets are judged on the FP8 row (its bytes, and
    against the bf16 row), the refit's measurements hold the bf16 rows only."""
    r = Report(tmp_path, tmp_path / "b", simulate=False, budget_s=510)
    r.device({"device": "NVIDIA H200", "arch": "sm_90a", "sms": 132})
    r.stage(Stage(2, "real", "doc"))
    r.result(2, {"kind": "measure", "name": "measure"},
             {"read": {"bytes_per_s": 4.0e12}, "copy": {"bytes_per_s": 3.8e12}, "clocks": {}})
    bf16 = {"case": "llama-3.2-1b B=1 T=1", "model": "llama-3.2-1b", "batch": 1,
            "weights": "bf16", "variant": "default", "step_us": 660.0, "tokens_per_s": 1515.0,
            "bytes_per_step": 2.5e9, "predicted_us": 700.0, "timed": "cuda graph",
            "fraction_of_achievable": 2.5e9 / 660e-6 / 4.0e12}
    # 1.3 GB in 400 us: 3.25 TB/s = 0.8125 of 4.0; 660/400 = 1.65 for 2.5/1.3 = 1.923: 0.858
    fp8 = {**bf16, "case": "llama-3.2-1b B=1 T=1 fp8", "weights": "fp8", "step_us": 400.0,
           "bytes_per_step": 1.3e9, "fraction_of_achievable": 1.3e9 / 400e-6 / 4.0e12}
    r.result(2, {"kind": "bench", "name": "bench a", "variant": "default"}, bf16)
    r.result(2, {"kind": "bench", "name": "bench b", "variant": "default"}, fp8)
    r.finish(12.0)
    d = json.loads((tmp_path / "gpu_check.json").read_text())
    t = {(x["weights"], x["metric"]): x for x in d["targets"]}
    assert t[("fp8", "bw_fraction")]["measured"] == pytest.approx(0.8125)
    assert t[("fp8", "bw_fraction")]["met"] is True
    assert t[("fp8", "vs_bf16")]["measured"] == pytest.approx((660 / 400) / (2.5 / 1.3))
    assert t[("fp8", "vs_bf16")]["met"] is False  # 0.858 < 0.9
    assert t[("bf16", "bw_fraction")]["measured"] == pytest.approx(0.947, abs=1e-3)
    assert t[("bf16", "vs_hazy")]["measured"] == pytest.approx(760 / 660)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| llama-3.2-1b B=1 T=1 fp8 | default | fp8 | 400.0 | 1515 | 1300.0 | 81.2% |" in md
    assert "| llama-3.2-1b B=1 T=1 | default | bf16 | 660.0 | 1515 | 2500.0 | 94.7% |" in md
    assert "target llama-3.2-1b B=1 fp8 vs_bf16 >= 0.9: measured 0.858 (not met;" in md
    from megakernel.gpu_check.report import measurements

    rows = measurements({**d, "bench": [{**b, "step_ms": b["step_us"] / 1e3}
                                        for b in d["bench"]]})
    assert [m["step_s"] for m in rows] == [pytest.approx(660e-6)]
