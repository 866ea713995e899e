"""Cost-model refit (program/refit.py): recovery of known parameters from synthetic measurements,
refusals, gpu-check reports as input, and `plan --refit / --params` on the command line."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megakernel.cli.main import main
from megakernel.program.cost import CostParams
from megakernel.program.measurements import (
    Measurement,
    RefitError,
    from_gpu_check,
    load_measurements,
)
from megakernel.program.refit import ProgramCache, load_params, predict, refit

GPU16 = "h200/16sm"  # small programs: each replay takes milliseconds
TRUE = CostParams(mem_latency=300e-9, fixed_per_instr=0.5e-6)  # away from the defaults
# (model, batch, smem_window): like gpu-check, both kernel variants: the default build (its own
# ring, None) and the global-memory path (0), whose waits expose the latencies the ring hides
POINTS = [(m, b, None) for m in ("llama-tiny", "qwen3-tiny", "llama-mid") for b in (1, 16)]
POINTS += [("llama-mid", 1, 0)]


@pytest.fixture(scope="module")
def cache() -> ProgramCache:
    return ProgramCache()


@pytest.fixture(scope="module")
def synthetic(cache: ProgramCache) -> list[Measurement]:
    """'Measured' times made by the model itself under TRUE."""
    out = []
    for model, batch, window in POINTS:
        m = Measurement(model, GPU16, batch, 1, None, 1.0, smem_window=window,
                        label="global" if window == 0 else "")
        out.append(dataclasses.replace(m, step_s=predict(cache.get(m), m, TRUE)))
    return out


def test_recovers_known_parameters(synthetic: list[Measurement], cache: ProgramCache) -> None:
    r = refit(synthetic, cache=cache)
    assert r.params.mem_latency == pytest.approx(TRUE.mem_latency, rel=0.02)
    assert r.params.fixed_per_instr == pytest.approx(TRUE.fixed_per_instr, rel=0.02)
    # the rest keep their cited values
    assert (r.params.launch, r.params.l2_latency) == (CostParams().launch,
                                                      CostParams().l2_latency)
    assert r.rms_before > 0.1  # the defaults were really off
    assert r.rms_after < 1e-3
    for row in r.rows:
        assert row.after_ratio == pytest.approx(1.0, abs=2e-3)
        # the defaults (slower latencies) over-predict every point; least on llama-mid at B=1,
        # where the build's 192 KiB ring and sliding lookahead hide most of the latency
        assert row.before_ratio > 1.01
    assert r.evaluations <= 400


def test_recovers_three_parameters(synthetic: list[Measurement], cache: ProgramCache) -> None:
    """Launch is a constant offset: fit it too from a start away from the truth."""
    start = CostParams(launch=4e-6)
    r = refit(synthetic, ("mem_latency", "fixed_per_instr", "launch"), start=start, cache=cache)
    assert r.params.mem_latency == pytest.approx(TRUE.mem_latency, rel=0.05)
    assert r.params.fixed_per_instr == pytest.approx(TRUE.fixed_per_instr, rel=0.05)
    assert r.params.launch == pytest.approx(TRUE.launch, rel=0.15)
    assert r.rms_after < 2e-3


def test_warns_when_measurements_cannot_separate_parameters(
        synthetic: list[Measurement], cache: ProgramCache) -> None:
    """The same point twice fixes one combination of latency and fixed cost, not both."""
    from megakernel.program.refit import describe

    r = refit([synthetic[0], dataclasses.replace(synthetic[0], label="again")], cache=cache)
    assert r.rms_after < 1e-3 and r.condition > 100
    assert any(line.startswith("warning: the measurements barely separate mem_latency, "
                               "fixed_per_instr") for line in describe(r))
    good = refit(synthetic, cache=cache)
    assert good.condition < 100
    assert not any(line.startswith("warning") for line in describe(good))


def test_reports_a_parameter_stuck_at_its_bound(synthetic: list[Measurement],
                                                cache: ProgramCache) -> None:
    """Times far below what any fixed cost allows: the fit ends at the lower bound, and says so."""
    from megakernel.program.refit import BOUNDS, describe

    fast = [dataclasses.replace(m, step_s=0.2 * m.step_s) for m in synthetic[:2]]
    r = refit(fast, ("fixed_per_instr",), cache=cache)
    assert r.params.fixed_per_instr == pytest.approx(BOUNDS["fixed_per_instr"][0])
    assert r.rms_after > 0.5
    assert any("(at the lower search bound" in line for line in describe(r))


def test_refusals(synthetic: list[Measurement], cache: ProgramCache) -> None:
    with pytest.raises(RefitError, match="1 measurement.*cannot determine 2 parameters"):
        refit(synthetic[:1], cache=cache)
    for bad in (0.0, -1e-5, float("nan")):
        with pytest.raises(RefitError, match="must be positive and finite"):
            refit([synthetic[0], dataclasses.replace(synthetic[1], step_s=bad)], cache=cache)
    with pytest.raises(RefitError, match="unknown model 'no-such-model'"):
        refit([synthetic[0], dataclasses.replace(synthetic[1], model="no-such-model")])
    with pytest.raises(RefitError, match="cannot fit \\['prefetch_window'\\]"):
        refit(synthetic, ("prefetch_window",), cache=cache)
    with pytest.raises(RefitError, match="measurement GPU 'a100'"):
        refit([synthetic[0], dataclasses.replace(synthetic[1], gpu="a100")])
    with pytest.raises(RefitError, match="NAME/<n>sm"):
        refit([synthetic[0], dataclasses.replace(synthetic[1], gpu="h200/16")])
    with pytest.raises(RefitError, match="copy bandwidth must be positive"):
        refit([synthetic[0], dataclasses.replace(synthetic[1], copy_bw_gbs=0.0)], cache=cache)
    with pytest.raises(RefitError, match="unknown measurement fields \\['step_ms'\\]"):
        Measurement.from_dict({"model": "llama-tiny", "gpu": "h200", "batch": 1, "step_ms": 1})
    with pytest.raises(RefitError, match="lacks \\['step_s'\\]"):
        Measurement.from_dict({"model": "llama-tiny", "gpu": "h200", "batch": 1})


def test_measured_copy_bandwidth_slows_the_replay(cache: ProgramCache) -> None:
    """A measurement's copy bandwidth replaces the assumed one (same schedule, slower HBM)."""
    m = Measurement("llama-mid", GPU16, 16, 1, None, 1e-4)
    assumed = cache.get(m).gpu.copy_bw / 1e9
    slow = dataclasses.replace(m, copy_bw_gbs=assumed / 4)
    assert cache.get(slow).gpu.copy_bw_measured
    assert predict(cache.get(slow), slow, TRUE) > 1.2 * predict(cache.get(m), m, TRUE)


def _report() -> dict:
    """A hand-made gpu-check report (the structure gpu_check.gpu_check writes)."""
    return {
        "device": "NVIDIA H200", "arch": "sm_90a", "sms": 132, "copy_bandwidth_GBps": 4123.5,
        "cases": [], "skipped": [],
        "bench": [
            {"model": "llama-3.2-1b", "batch": 1, "tokens": 1, "context": 1024,
             "max_seq_len": 1188, "step_ms": 0.812, "predicted_ms": 0.72, "variant": "default"},
            {"model": "qwen3-0.6b", "batch": 1, "context": 1024, "step_ms": 0.9,
             "predicted_ms": 0.7, "variant": "default"},
            {"model": "qwen3-0.6b", "batch": 1, "context": 1024, "step_ms": 0.95,
             "predicted_ms": 0.7, "variant": "global"},
            {"model": "llama-3.2-1b", "error": "RuntimeError: boom", "variant": "global"},
        ],
    }


def test_gpu_check_report_to_measurements(tmp_path) -> None:  # noqa: ANN001
    from megakernel import gpu_check
    from megakernel.kernel.host.limits import SMEM_STAGE_BYTES

    stages = dict(gpu_check.variants())
    other = next(n for n in stages if n != "default")
    rep = _report()
    rep["bench"][2]["variant"] = other
    rows = from_gpu_check(rep)
    assert len(rows) == 3  # the failed bench row is left out
    assert rows[0] == {"model": "llama-3.2-1b", "gpu": "h200", "batch": 1, "tokens": 1,
                       "context": 1024, "step_s": pytest.approx(0.812e-3),
                       "copy_bw_gbs": 4123.5, "max_seq_len": 1188, "smem_window": None,
                       "label": "default"}
    assert rows[1]["tokens"] == 1 and rows[1]["max_seq_len"] is None
    assert rows[2]["smem_window"] == stages[other] * SMEM_STAGE_BYTES == 0  # the global path
    # gpu_check writes the same list into its report; the file is read through it
    assert gpu_check.measurements(rep) == rows
    f = tmp_path / "gpu_check.json"
    f.write_text(json.dumps({**rep, "measurements": rows}))
    ms = load_measurements(f)
    assert [m.step_s for m in ms] == pytest.approx([0.812e-3, 0.9e-3, 0.95e-3])
    assert ms[2].label == other and ms[0].copy_bw_gbs == 4123.5
    # an older report without the list: the bench rows are converted on reading
    f.write_text(json.dumps(rep))
    assert load_measurements(f) == ms
    # a device with fewer SMs than the datasheet part, and one without a description
    assert from_gpu_check({**rep, "sms": 114})[0]["gpu"] == "h200/114sm"
    assert from_gpu_check({**rep, "device": "NVIDIA H100 PCIe", "sms": 114})[0]["gpu"] \
        == "h100/114sm"
    odd = {**_report(), "device": "NVIDIA A100-SXM4-80GB", "notes": []}
    assert gpu_check.measurements(odd) == []
    assert "no GPU description for device 'NVIDIA A100-SXM4-80GB'" in odd["notes"][0]
    f.write_text(json.dumps({"cases": []}))
    with pytest.raises(RefitError, match="neither a 'measurements' list nor gpu-check"):
        load_measurements(f)


def test_cli_refit_and_params_round_trip(tmp_path, capsys,  # noqa: ANN001
                                         synthetic: list[Measurement]) -> None:
    meas = tmp_path / "measurements.json"
    meas.write_text(json.dumps([dataclasses.asdict(m) for m in synthetic[::2]]))
    out = tmp_path / "params.json"
    assert main(["plan", "--refit", str(meas), "--save-params", str(out)]) == 0
    text = capsys.readouterr().out
    # the fit starts from the default latency (cost.CostParams) and reports it
    start_ns = round(CostParams().mem_latency * 1e9)
    assert f"mem_latency: {start_ns} ns -> 300" in text and "after/meas" in text
    fitted = load_params(out)
    assert fitted.mem_latency == pytest.approx(TRUE.mem_latency, rel=0.02)
    assert fitted.fixed_per_instr == pytest.approx(TRUE.fixed_per_instr, rel=0.02)

    def planned(*extra: str) -> dict:
        assert main(["plan", "--model", "llama-tiny", "--gpu", "h100", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    base, refitted = planned(), planned("--params", str(out))
    assert refitted["cost_params"]["mem_latency"] == pytest.approx(fitted.mem_latency)
    assert refitted["predicted_step_us"] < 0.9 * base["predicted_step_us"]  # faster latencies
    assert main(["plan", "--model", "llama-tiny", "--gpu", "h100", "--params", str(out)]) == 0
    assert f"cost parameters refitted to measurements: {out}" in capsys.readouterr().out


def test_cli_refusals(tmp_path, capsys) -> None:  # noqa: ANN001
    assert main(["plan", "--gpu", "h200"]) == 2
    assert "plan needs --model (or --refit FILE.json)" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-tiny", "--save-params", "x.json"]) == 2
    assert "--save-params needs --refit" in capsys.readouterr().err
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"cost_params": {"mem_latency": 1e-7, "warp_speed": 9}}))
    assert main(["plan", "--model", "llama-tiny", "--params", str(bad)]) == 2
    assert "unknown cost parameters ['warp_speed']" in capsys.readouterr().err
