"""The targets of the first GPU measurements: for a (model, batch) run, a metric (the fraction of
the measured achievable bandwidth, the speedup over Hazy Research's megakernel or over the
torch.compile step, ReplaySSM over the recurrent update) and the bound it must reach, judged on
one run's measurements (`evaluate_targets`) by gpu-check's report and bench/decode.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Hazy Research's low-latency megakernel, Llama-3.2-1B, B = 1 on an H200: 759.83 us/step
HAZY_H200_S = 760e-6


# ---- targets: ratios measured in one run ---------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """`metric` of the (model, batch) run must be >= `bound`; `gpu`: the device it is set for
    (a substring of the device name; elsewhere it is reported, not judged)."""

    model: str
    batch: int
    metric: str  # "bw_fraction" | "vs_hazy" | "vs_compile"
    bound: float
    gpu: str | None
    doc: str


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
)


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
    raise ValueError(f"unknown target metric {name!r}")


def evaluate_targets(res: dict, targets=TARGETS) -> list[dict]:  # noqa: ANN001
    """Each target of this run's model: its measured value and met (True / False, None when it
    was not measured or the device is not the target's)."""
    out = []
    for t in targets:
        if t.model != res["model"]:
            continue
        run = next((r for r in res["runs"] if r["batch"] == t.batch
                    and not r.get("replay_window")), None)  # the recurrent update's row
        value, note = metric(t.metric, run, res) if run else (None, f"B={t.batch} not run")
        on_gpu = t.gpu is None or t.gpu in res["device"]
        met = value >= t.bound if value is not None and math.isfinite(value) and on_gpu else None
        if not on_gpu:
            note += f"; the target is for {t.gpu}"
        out.append({"target": f"{t.model} B={t.batch} {t.metric} >= {t.bound:g}",
                    "measured": value, "bound": t.bound, "met": met, "note": note,
                    "doc": t.doc})
    return out


def targets_text(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        v = "n/a" if r["measured"] is None else f"{r['measured']:.3f}"
        state = {True: "met", False: "NOT MET", None: "not judged"}[r["met"]]
        lines.append(f"{r['target']:40s} measured {v:>7s}  {state}  ({r['note']})")
    return "\n".join(lines)
