"""bench/decode.py and its measurements on the CPU: the targets judged from synthetic numbers (met,
not met, not judged off their GPU, the eager fallback flagged), the torch.compile baseline's step
(torch_decode.TorchDecode) against the fp32 reference, and measure's clocks / sampler / compile
timing answering with error fields where nothing can be measured."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from megakernel.launch import torch_decode
from megakernel.measure import bandwidth as measure
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.reference.model import ReferenceModel

_spec = importlib.util.spec_from_file_location(
    "bench_decode", Path(__file__).resolve().parents[2] / "bench" / "decode.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_decode"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

GB = 2.47e9  # bytes per step (about Llama-3.2-1B's weights)


def _res(model: str = "llama-3.2-1b", device: str = "NVIDIA H200", kernel_ms: float = 0.6,
         compile_ms: float = 1.0, compiled: bool = True, bw_gbps: float = 4400.0) -> dict:
    run = {"batch": 1, "bytes_per_step": GB, "kernel": {"ms": kernel_ms},
           "torch_compile": {"ms": compile_ms, "compiled": compiled,
                             "error": None if compiled else "RuntimeError: boom"}}
    return {"model": model, "device": device, "achievable_GBps": bw_gbps, "runs": [run]}


def _by_metric(rows: list[dict], weights: str = "bf16") -> dict[str, dict]:
    return {r["metric"]: r for r in rows if r["weights"] == weights}


def test_targets_met_and_not_met_from_synthetic_numbers():
    # 0.6 ms: 2.47 GB / 0.6 ms = 4117 GB/s = 0.936 of 4400; 760/600 = 1.267; 1.0/0.6 = 1.667
    fast = _by_metric(bench.evaluate_targets(_res(kernel_ms=0.6)))
    assert set(fast) == {"bw_fraction", "vs_hazy", "vs_compile"}
    assert fast["bw_fraction"]["measured"] == pytest.approx(GB / 0.6e-3 / 4400e9)
    assert fast["vs_hazy"]["measured"] == pytest.approx(760 / 600)
    assert fast["vs_compile"]["measured"] == pytest.approx(1.0 / 0.6)
    assert all(r["met"] is True for r in fast.values()), fast
    # 0.8 ms: 0.702 of the bandwidth, 0.95x Hazy, 1.25x torch.compile: none met
    slow = _by_metric(bench.evaluate_targets(_res(kernel_ms=0.8)))
    assert all(r["met"] is False for r in slow.values()), slow
    # each bound separately: just above and just below it
    for metric_name, bound in (("vs_hazy", 1.10), ("vs_compile", 1.4)):
        for factor, met in ((1.01, True), (0.99, False)):
            k_ms = (0.76 if metric_name == "vs_hazy" else 1.0) / (bound * factor)
            r = _by_metric(bench.evaluate_targets(_res(kernel_ms=k_ms)))[metric_name]
            assert r["met"] is met, (metric_name, factor, r)
    text = bench.targets_text(bench.evaluate_targets(_res(kernel_ms=0.8)))
    assert text.count("NOT MET") == 3


def test_qwen_target_and_other_gpus():
    q = bench.evaluate_targets(_res(model="qwen3-0.6b", device="NVIDIA H100", kernel_ms=0.4,
                                    compile_ms=0.9))
    assert [r["target"] for r in q] == ["qwen3-0.6b B=1 vs_compile >= 2"]
    assert q[0]["met"] is True and q[0]["measured"] == pytest.approx(2.25)
    q = bench.evaluate_targets(_res(model="qwen3-0.6b", kernel_ms=0.5, compile_ms=0.9))
    assert q[0]["met"] is False
    # the Llama targets are set for an H200: elsewhere measured and reported, not judged
    h100 = _by_metric(bench.evaluate_targets(_res(device="NVIDIA H100 80GB HBM3"))).values()
    assert all(r["met"] is None and r["measured"] is not None for r in h100)
    assert all("for H200" in r["note"] for r in h100)
    assert bench.evaluate_targets(_res(model="llama-tiny")) == []


def test_targets_flag_the_eager_fallback_and_missing_numbers():
    r = _by_metric(bench.evaluate_targets(_res(compiled=False)))["vs_compile"]
    assert "EAGER" in r["note"] and "boom" in r["note"]
    res = _res()
    del res["runs"][0]["torch_compile"]["ms"]
    res["achievable_GBps"] = None
    rows = _by_metric(bench.evaluate_targets(res))
    assert rows["vs_compile"]["met"] is None and rows["vs_compile"]["measured"] is None
    assert rows["bw_fraction"]["met"] is None and rows["vs_hazy"]["met"] is True
    res["runs"] = []
    assert all(r["met"] is None and "not run" in r["note"] for r in bench.evaluate_targets(res))


def test_torch_decode_step_matches_the_fp32_reference():
    """The torch.compile baseline computes the model: TorchDecode's logits after a few tokens
    against the fp32 reference, within twice the reference bf16 mode's own error."""
    torch.manual_seed(0)
    cfg = preset("llama-tiny")
    w = random_weights(cfg, seed=3)
    prompt = torch.randint(0, cfg.vocab_size, (2, 5))  # [B, T]
    truth, bf16 = (ReferenceModel(cfg, w, mode=m) for m in ("fp32", "bf16"))
    c32, c16 = truth.new_cache(2, 16), bf16.new_cache(2, 16)
    want = truth.prefill(c32, prompt.tolist())  # [B, V] at the last token
    ref16 = bf16.prefill(c16, prompt.tolist())
    td = torch_decode.TorchDecode(cfg, w, batch=2, s_max=16, device="cpu")
    for t in range(prompt.shape[1]):
        got = td.logits(prompt[:, t], torch.full((2,), t, dtype=torch.int64))
    tol = 2 * (ref16 - want).abs().max().item() + 1e-6
    err = (got - want).abs().max().item()
    print(f"TorchDecode vs fp32 reference: {err:.3g} (bf16 reference: {tol / 2:.3g})")
    assert err <= tol
    nxt = td.step(prompt[:, 0], torch.full((2,), 5, dtype=torch.int64))  # greedy tokens [B]
    assert nxt.shape == (2,) and nxt.dtype == torch.int64


def test_clock_parsing_and_sampler():
    assert measure.parse_smi_clocks("1980, 2619, 1980, 3201\n") == {
        "sm_mhz": 1980, "mem_mhz": 2619, "max_sm_mhz": 1980, "max_mem_mhz": 3201}
    assert measure.parse_smi_clocks("345, [N/A], 1980, 2619")["mem_mhz"] is None
    with pytest.raises(ValueError, match="comma-separated"):
        measure.parse_smi_clocks("1980, 2619")
    ticks = iter(range(10_000))
    fake = lambda: {"sm_mhz": 1000 + next(ticks), "mem_mhz": 2619}
    with measure.ClockSampler(interval_s=0.001, read=fake) as cs:
        while len(cs.samples) < 5:
            pass
    s = cs.summary()
    n = s["samples"]
    assert n >= 6 and s["errors"] == 0 and "error" not in s
    assert s["sm_mhz"] == {"min": 1000, "max": 1000 + n - 1, "mean": pytest.approx(999.5 + n / 2)}
    assert s["mem_mhz"]["min"] == s["mem_mhz"]["max"] == 2619
    with measure.ClockSampler(interval_s=0.001, read=lambda: {"error": "no nvidia-smi"}) as cs:
        pass
    s = cs.summary()
    assert s["errors"] == s["samples"] >= 2 and s["error"] == "no nvidia-smi"
    assert "sm_mhz" not in s


def test_clocks_read_or_say_why_not():
    c = measure.clocks()
    assert "error" in c or (c["source"] in ("nvidia-smi", "nvml") and "sm_mhz" in c)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_compile_timing_without_a_gpu_is_flagged():
    r = measure.compile_timing(lambda x: x + 1, (torch.ones(2),))
    assert r["compiled"] is False and "no CUDA GPU" in r["error"] and "ms" not in r


def test_compile_timing_falls_back_to_eager_and_flags_it(monkeypatch):
    """A compile that fails is recorded and the eager step timed instead (CPU: the GPU check
    and the CUDA-event timer are stubbed; the step itself runs)."""
    calls = []
    monkeypatch.setattr(measure, "_need_gpu", lambda: None)
    monkeypatch.setattr(measure, "timed", lambda fn, iters: (fn(), 2e-3)[1])
    step = lambda x: calls.append(x) or x * 2
    r = measure.compile_timing(step, (torch.ones(2),), mode="no-such-mode")
    assert r["compiled"] is False and "no-such-mode" in r["error"]
    assert r["ms"] == pytest.approx(2.0) and calls  # the eager step ran and was timed
    assert "compile_s" not in r


def test_replay_targets_compare_rows_of_one_batch():
    """nemotron-h-8b: ReplaySSM against the recurrent update at the same B (the fastest window),
    the recurrent row the one judged for bandwidth; no ReplaySSM row: not measured."""
    runs = [{"batch": b, "replay_window": w, "bytes_per_step": GB, "kernel": {"ms": ms}}
            for b, w, ms in ((1, 0, 1.0), (1, 8, 1.02), (1, 16, 0.98), (64, 0, 4.0),
                             (64, 16, 2.9))]
    res = {"model": "nemotron-h-8b", "device": "NVIDIA H200", "achievable_GBps": 4400.0,
           "runs": runs}
    rows = {r["target"]: r for r in bench.evaluate_targets(res)}
    one, many = rows["nemotron-h-8b B=1 replay_speedup >= 1"], rows[
        "nemotron-h-8b B=64 replay_speedup >= 1.3"]
    assert one["measured"] == pytest.approx(1.0 / 0.98) and one["met"] is True
    assert "L=16" in one["note"]
    assert many["measured"] == pytest.approx(4.0 / 2.9) and many["met"] is True
    bw = rows["nemotron-h-8b B=1 bw_fraction >= 0.8"]
    assert bw["measured"] == pytest.approx(GB / 1.0e-3 / 4400e9)  # the recurrent row
    res["runs"] = [r for r in runs if not r["replay_window"]]
    rows = {r["target"]: r for r in bench.evaluate_targets(res)}
    assert rows["nemotron-h-8b B=64 replay_speedup >= 1.3"]["met"] is None


FP8_GB = 1.31e9  # about Llama-3.2-1B's FP8 bytes (e4m3 codes and scales, the bf16 embedding)


def _fp8_res(bf16_ms: float | None = 0.6, fp8_ms: float | None = 0.35,
             device: str = "NVIDIA H200") -> dict:
    """A run with llama-3.2-1b B=1 in bf16 and FP8 (the FP8 run's bytes its own)."""
    res = _res(device=device, kernel_ms=bf16_ms or 0.6)
    if bf16_ms is None:
        res["runs"] = []
    if fp8_ms is not None:
        res["runs"].append({"batch": 1, "weights": "fp8", "bytes_per_step": FP8_GB,
                            "kernel": {"ms": fp8_ms}})
    return res


def test_fp8_targets_are_judged_on_the_fp8_run():
    """bw_fraction of the FP8 run on its own bytes; vs_bf16: (bf16 step / FP8 step) over the byte
    ratio, both rows from the same run; the bf16 targets still judged on the bf16 row."""
    ratio = GB / FP8_GB  # 1.885
    # 0.35 ms: 1.31 GB / 0.35 ms = 3743 GB/s = 0.851 of 4400; 0.6 / 0.35 = 1.714 = 0.909 of 1.885
    fp8 = _by_metric(bench.evaluate_targets(_fp8_res(0.6, 0.35)), "fp8")
    assert set(fp8) == {"bw_fraction", "vs_bf16"}
    assert fp8["bw_fraction"]["measured"] == pytest.approx(FP8_GB / 0.35e-3 / 4400e9)
    assert fp8["vs_bf16"]["measured"] == pytest.approx((0.6 / 0.35) / ratio)
    assert fp8["bw_fraction"]["met"] is True and fp8["vs_bf16"]["met"] is True
    assert "fp8" in fp8["vs_bf16"]["target"] and "fewer bytes" in fp8["vs_bf16"]["note"]
    bf16 = _by_metric(bench.evaluate_targets(_fp8_res(0.6, 0.35)))
    assert bf16["bw_fraction"]["measured"] == pytest.approx(GB / 0.6e-3 / 4400e9)
    # vs_bf16 just above and just below 0.9 of the byte ratio; the bf16 step unchanged
    for factor, met in ((1.01, True), (0.99, False)):
        fp8_ms = 0.6 / (0.9 * ratio * factor)
        r = _by_metric(bench.evaluate_targets(_fp8_res(0.6, fp8_ms)), "fp8")["vs_bf16"]
        assert r["met"] is met and r["measured"] == pytest.approx(0.9 * factor), (factor, r)
    # 0.5 ms: 0.595 of the bandwidth, 1.2x for 1.885x fewer bytes (0.637): neither met
    slow = _by_metric(bench.evaluate_targets(_fp8_res(0.6, 0.5)), "fp8")
    assert slow["bw_fraction"]["met"] is False and slow["vs_bf16"]["met"] is False


def test_fp8_targets_not_measured():
    """No FP8 run: both not judged ("fp8 not run"); an FP8 run without a bf16 one at its batch:
    vs_bf16 not judged, bw_fraction judged; on another GPU: measured, not judged."""
    rows = _by_metric(bench.evaluate_targets(_fp8_res(0.6, None)), "fp8")
    assert all(r["met"] is None and r["measured"] is None and "fp8 not run" in r["note"]
               for r in rows.values())
    rows = _by_metric(bench.evaluate_targets(_fp8_res(None, 0.35)), "fp8")
    assert rows["vs_bf16"]["met"] is None and "no bf16 run" in rows["vs_bf16"]["note"]
    assert rows["bw_fraction"]["met"] is True
    res = _fp8_res(0.6, 0.35)
    res["runs"][0]["batch"] = 8  # a bf16 row of another batch is not the baseline
    assert _by_metric(bench.evaluate_targets(res), "fp8")["vs_bf16"]["met"] is None
    h100 = _by_metric(bench.evaluate_targets(_fp8_res(0.6, 0.35, "NVIDIA H100")), "fp8")
    assert all(r["met"] is None and r["measured"] is not None for r in h100.values())
    text = bench.targets_text(bench.evaluate_targets(_fp8_res(0.6, 0.5)))
    assert "llama-3.2-1b B=1 fp8 vs_bf16 >= 0.9" in text and text.count("NOT MET") == 2
