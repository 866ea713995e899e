"""The targets of the first GPU measurements: for a (model, batch, weight format) run, a metric
(the fraction of the measured achievable bandwidth, the speedup over Hazy Research's megakernel or
over the torch.compile step, ReplaySSM over the recurrent update, FP8 over bf16 against their byte
ratio) and the bound it must reach, judged on one run's measurements (`evaluate_targets`) by
gpu-check's report and bench/decode.py.

A run (an entry of `res["runs"]`) says its weight format in `weights` ("bf16" when absent, "fp8"
for channel scales, "fp8-block"); a target applies to the runs of its own format only, and its
bytes per step are that format's (an FP8 run's `bytes_per_step` are the FP8 program's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Hazy Research's low-latency megakernel, Llama-3.2-1B, B = 1 on an H200: 759.83 us/step
HAZY_H200_S = 760e-6


# ---- targets: ratios measured in one run ---------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """`metric` of the (model, batch, weights) run must be >= `bound`; `gpu`: the device it is
    set for (a substring of the device name; elsewhere it is reported, not judged)."""

    model: str
    batch: int
    # "bw_fraction" | "vs_hazy" | "vs_compile" | "replay_speedup" | "vs_bf16"
    metric: str
    bound: float
    gpu: str | None
    doc: str
    weights: str = "bf16"  # the run's weight format: "bf16", "fp8" (channel), "fp8-block"

    @property
    def label(self) -> str:
        w = "" if self.weights == "bf16" else f" {self.weights}"
        return f"{self.model} B={self.batch}{w} {self.metric} >= {self.bound:g}"


TARGETS = (
    Target("llama-3.2-1b", 1, "bw_fraction", 0.85, "H200",
           "bytes/step / kernel time vs the measured achievable bandwidth (max of read, copy)"),
    Target("llama-3.2-1b", 1, "vs_hazy", 1.10, "H200", "Hazy's 760 us / kernel time"),
    Target("llama-3.2-1b", 1, "vs_compile", 1.4, "H200", "torch.compile step / kernel step"),
    Target("qwen3-0.6b", 1, "vs_compile", 2.0, None, "torch.compile step / kernel step"),
    # hybrid models: bandwidth at B = 1, ReplaySSM against the recurrent update
    Target("qwen3.5-0.8b", 1, "bw_fraction", 0.80, None,
           "bytes/step / kernel time vs the measured achievable bandwidth"),
    Target("nemotron-h-8b", 1, "bw_fraction", 0.80, None,
           "bytes/step / kernel time vs the measured achievable bandwidth"),
    Target("nemotron-h-8b", 1, "replay_speedup", 1.0, None,
           "recurrent step / fastest ReplaySSM step at the same B (no slower)"),
    Target("nemotron-h-8b", 64, "replay_speedup", 1.3, None,
           "recurrent step / fastest ReplaySSM step at the same B"),
    # Kimi Linear: the routed experts' bytes, weights made on the GPU
    Target("kimi-linear-48b-a3b", 1, "bw_fraction", 0.70, None,
           "bytes/step / kernel time vs the measured achievable bandwidth"),
    # FP8 (e4m3, channel scales) weights: the FP8 bytes streamed near the bandwidth, and the
    # bytes saved turned into time (against the bf16 kernel of the same run)
    Target("llama-3.2-1b", 1, "bw_fraction", 0.75, "H200",
           "FP8 bytes/step / kernel time vs the measured achievable bandwidth", weights="fp8"),
    Target("llama-3.2-1b", 1, "vs_bf16", 0.90, "H200",
           "(bf16 step / FP8 step) / (bf16 bytes / FP8 bytes), both from the same run",
           weights="fp8"),
)


def run_weights(run: dict) -> str:
    """A run's weight format ("bf16" when the run does not say)."""
    return run.get("weights") or "bf16"


def metric(name: str, run: dict, res: dict) -> tuple[float | None, str]:
    """(value, note) of one target metric from a run's measurements; None when not measured."""
    k_ms = run.get("kernel", {}).get("ms")
    if not k_ms:
        return None, "kernel not measured"
    k_s = k_ms / 1e3
    if name == "bw_fraction":
        bw = res.get("achievable_GBps")
        if not bw:
            return None, "no achievable bandwidth measured"
        return run["bytes_per_step"] / k_s / (bw * 1e9), f"of {bw:.0f} GB/s"
    if name == "vs_hazy":
        return HAZY_H200_S / k_s, "vs 760 us"
    if name == "vs_compile":
        c = run.get("torch_compile", {})
        if not c.get("ms"):
            return None, f"no torch.compile timing ({c.get('error') or 'not run'})"
        flag = "" if c.get("compiled") else f" (EAGER: compile failed: {c.get('error')})"
        return c["ms"] / k_ms, "vs torch.compile" + flag
    if name == "replay_speedup":
        rep = [r for r in res.get("runs", []) if r["batch"] == run["batch"]
               and r.get("replay_window") and r.get("kernel", {}).get("ms")]
        if not rep:
            return None, "no ReplaySSM run at this batch (--replay-windows)"
        best = min(rep, key=lambda r: r["kernel"]["ms"])
        return k_ms / best["kernel"]["ms"], f"vs ReplaySSM L={best['replay_window']}"
    if name == "vs_bf16":  # the speedup over bf16 as a fraction of the byte ratio
        base = next((r for r in res.get("runs", []) if r["batch"] == run["batch"]
                     and run_weights(r) == "bf16" and not r.get("replay_window")
                     and r.get("kernel", {}).get("ms")), None)
        if base is None:
            return None, "no bf16 run at this batch in the same run"
        if not run.get("bytes_per_step") or not base.get("bytes_per_step"):
            return None, "bytes per step not recorded"
        speedup = base["kernel"]["ms"] / k_ms
        ratio = base["bytes_per_step"] / run["bytes_per_step"]
        return speedup / ratio, f"{speedup:.3f}x faster for {ratio:.3f}x fewer bytes"
    raise ValueError(f"unknown target metric {name!r}")


def evaluate_targets(res: dict, targets=TARGETS) -> list[dict]:  # noqa: ANN001
    """Each target of this run's model: its measured value and met (True / False, None when it
    was not measured or the device is not the target's). A target is judged on the run of its
    batch and weight format (the recurrent update's row of a hybrid model)."""
    out = []
    for t in targets:
        if t.model != res["model"]:
            continue
        run = next((r for r in res["runs"] if r["batch"] == t.batch
                    and run_weights(r) == t.weights and not r.get("replay_window")), None)
        value, note = metric(t.metric, run, res) if run else (
            None, f"B={t.batch}{'' if t.weights == 'bf16' else ' ' + t.weights} not run")
        on_gpu = t.gpu is None or t.gpu in res["device"]
        met = value >= t.bound if value is not None and math.isfinite(value) and on_gpu else None
        if not on_gpu:
            note += f"; the target is for {t.gpu}"
        out.append({"target": t.label, "model": t.model, "batch": t.batch,
                    "weights": t.weights, "metric": t.metric,
                    "measured": value, "bound": t.bound, "met": met, "note": note,
                    "doc": t.doc})
    return out


def targets_text(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        v = "n/a" if r["measured"] is None else f"{r['measured']:.3f}"
        state = {True: "met", False: "NOT MET", None: "not judged"}[r["met"]]
        lines.append(f"{r['target']:44s} measured {v:>7s}  {state}  ({r['note']})")
    return "\n".join(lines)
