"""Measure on a GPU what the cost model assumes: HBM read and copy bandwidth, clocks, and the
torch.compile decode-step baseline the kernel is judged against.

Needs torch and cuda-python only (never the DSL). Every function returns a plain dict and, when a
GPU, a build or a tool is missing, a dict with an "error" field instead of raising, so a GPU
check records what it could measure. For megakernel.gpu_check:

- `read_bandwidth(build_dir)`: the HBM read stream (megakernel/kernel/stream.py, one CTA per SM,
  cp.async.bulk into a shared-memory ring) launched from its AOT build under
  `stream_build_dir(build_dir)`, result verified against `stream_reference`;
- `copy_bandwidth()`: device-to-device copy, bytes read + written per second;
- `clocks()` / `ClockSampler`: SM and memory clocks, read only (nvidia-smi, else NVML);
- `compile_timing(step, args)`: a step compiled with mode="reduce-overhead", eager if that fails
  (flagged); `TorchDecode`: the static-cache bf16 decode step it is used on.
"""

from __future__ import annotations

import ctypes
import json
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

STREAM_SUBDIR = "stream"
GiB = 1 << 30


def _error(e: BaseException) -> dict[str, Any]:
    return {"error": f"{type(e).__name__}: {e}"}


def stream_build_dir(build_dir: str | Path) -> Path:
    """Where the stream kernel's build lives under a gpu-check build dir (DIR/stream/<arch>/):
    `python -m megakernel.kernel.stream --out <this>` (or kernel.stream.build_stream) writes it."""
    return Path(build_dir) / STREAM_SUBDIR


def timed(fn: Callable[[], object], iters: int, warmup: int = 3, groups: int = 7) -> float:
    """Median seconds per call: CUDA events around `groups` groups of `iters` calls each."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(groups):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3 / iters)
    return sorted(times)[len(times) // 2]


def _need_gpu() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is available (torch.cuda.is_available() is False)")


# ---- bandwidth ----------------------------------------------------------------------------------
def stream_reference(words: torch.Tensor, ctas: int, chunks: int, stage_bytes: int) -> list[int]:
    """What each CTA of the stream kernel stores: int32 words [ctas * chunks * W] -> [ctas].
    Lane l of chunk j reads word l * (W / 32) + j % (W / 32) of the stage; all are xored."""
    w = stage_bytes // 4
    seg = w // 32
    j = torch.arange(chunks, device=words.device)
    idx = torch.arange(32, device=words.device)[None, :] * seg + (j % seg)[:, None]  # [chunks, 32]
    v = torch.gather(words.view(ctas, chunks, w), 2, idx.expand(ctas, chunks, 32))
    v = v.reshape(ctas, -1).to(torch.int64) & 0xFFFFFFFF  # [ctas, chunks * 32], as unsigned
    acc = torch.zeros(ctas, dtype=torch.int64, device=words.device)
    for b in range(32):  # xor-reduce = parity of each bit
        acc |= ((v >> b) & 1).sum(1).remainder(2) << b
    return [x - (1 << 32) if x >= 1 << 31 else x for x in acc.tolist()]  # as int32


def load_stream(build_dir: str | Path, arch: str):  # noqa: ANN201
    """The stream kernel's (runtime.Manifest, manifest dict) for `arch` from stream_build_dir."""
    from megakernel.runtime import KernelUnavailable, Manifest

    d = stream_build_dir(build_dir) / arch
    f = d / "manifest.json"
    if not f.is_file():
        raise KernelUnavailable(f"no {arch} stream build in {d}: build it with `python -m "
                                f"megakernel.kernel.stream --out {stream_build_dir(build_dir)}`")
    data = json.loads(f.read_text())
    return Manifest(d, data), data


def read_bandwidth(build_dir: str | Path, nbytes: int = 2 * GiB, iters: int = 10) -> dict:
    """HBM read bandwidth of the stream kernel on every SM (one CTA each): bytes/s by CUDA events
    over `iters` launches of `nbytes` (rounded down to whole stages per CTA), after checking the
    words the CTAs store against stream_reference (a kernel that reads nothing fails)."""
    try:
        _need_gpu()
        from megakernel.runtime import LoadedKernel, device_info

        dev = device_info()
        manifest, data = load_stream(build_dir, dev.arch)
        kernel = LoadedKernel(manifest)
        stage = int(data["stage_bytes"])
        ctas = dev.sm_count
        chunks = nbytes // (ctas * stage)
        if chunks < 1:
            raise ValueError(f"{nbytes} B is less than one {stage} B stage per SM")
        total = ctas * chunks * stage
        g = torch.Generator(device="cuda").manual_seed(0)
        buf = torch.randint(-(1 << 31), (1 << 31) - 1, (total // 4,), dtype=torch.int32,
                            device="cuda", generator=g)
        out = torch.randint(-(1 << 31), (1 << 31) - 1, (ctas,), dtype=torch.int32,
                            device="cuda", generator=g)  # not what the CTAs will store
        want = stream_reference(buf, ctas, chunks, stage)
        run = lambda: kernel.launch(ctas, {"src": buf, "out": out}, {"chunks": chunks})
        run()
        torch.cuda.synchronize()
        got = out.tolist()
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        res = {"nbytes": total, "ctas": ctas, "stage_bytes": stage, "stages": data["stages"],
               "iters": iters, "arch": dev.arch, "device": dev.name, "verified": not bad}
        if bad:
            res["error"] = (f"stream result differs from the reference on {len(bad)} of {ctas} "
                            f"CTAs (first: CTA {bad[0]}: {got[bad[0]]} != {want[bad[0]]})")
            return res
        s = timed(run, iters, warmup=1, groups=3)
        res["bytes_per_s"] = total / s
        res["GBps"] = total / s / 1e9
        return res
    except Exception as e:  # recorded, not raised: a GPU check keeps going
        return _error(e)


def copy_bandwidth(nbytes: int = GiB, iters: int = 20) -> dict:
    """Device-to-device copy bandwidth: bytes read + written per second (CUDA events)."""
    try:
        _need_gpu()
        a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        b = torch.empty_like(a)
        s = timed(lambda: b.copy_(a), iters, warmup=1, groups=3)
        moved = 2 * a.numel() * a.element_size()
        return {"nbytes": moved, "iters": iters, "bytes_per_s": moved / s,
                "GBps": moved / s / 1e9}
    except Exception as e:
        return _error(e)


# ---- clocks (read only: nothing here changes a GPU setting) -------------------------------------
CLOCK_FIELDS = ("sm_mhz", "mem_mhz", "max_sm_mhz", "max_mem_mhz")
_SMI_QUERY = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem"


def parse_smi_clocks(line: str) -> dict:
    """One `nvidia-smi --query-gpu=<_SMI_QUERY> --format=csv,noheader,nounits` line -> MHz per
    CLOCK_FIELDS (None where the tool says N/A)."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != len(CLOCK_FIELDS):
        raise ValueError(f"expected {len(CLOCK_FIELDS)} comma-separated clocks, got {line!r}")
    return {k: (int(float(p)) if p.replace(".", "", 1).isdigit() else None)
            for k, p in zip(CLOCK_FIELDS, parts, strict=True)}


def _smi_clocks(device: int) -> dict:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        raise FileNotFoundError("nvidia-smi not found")
    out = subprocess.run([tool, f"--query-gpu={_SMI_QUERY}", "--format=csv,noheader,nounits",
                          "-i", str(device)], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:200]}")
    return {**parse_smi_clocks(out.stdout.strip().splitlines()[0]), "source": "nvidia-smi"}


def _nvml_clocks(device: int) -> dict:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    if nvml.nvmlInit_v2() != 0:
        raise RuntimeError("nvmlInit failed")
    try:
        h = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(device), ctypes.byref(h)) != 0:
            raise RuntimeError(f"NVML has no device {device}")
        res: dict[str, Any] = {"source": "nvml"}
        for key, fn, clk in (("sm_mhz", nvml.nvmlDeviceGetClockInfo, 1),  # NVML_CLOCK_SM
                             ("mem_mhz", nvml.nvmlDeviceGetClockInfo, 2),  # NVML_CLOCK_MEM
                             ("max_sm_mhz", nvml.nvmlDeviceGetMaxClockInfo, 1),
                             ("max_mem_mhz", nvml.nvmlDeviceGetMaxClockInfo, 2)):
            v = ctypes.c_uint()
            res[key] = int(v.value) if fn(h, ctypes.c_int(clk), ctypes.byref(v)) == 0 else None
        return res
    finally:
        nvml.nvmlShutdown()


def clocks(device: int = 0) -> dict:
    """Current and maximum SM / memory clocks in MHz (CLOCK_FIELDS) and their "source", read
    only, from nvidia-smi or else NVML; {"error": ...} naming both failures without either."""
    errors = []
    for reader in (_smi_clocks, _nvml_clocks):
        try:
            return reader(device)
        except Exception as e:
            errors.append(f"{reader.__name__.strip('_')}: {type(e).__name__}: {e}")
    return {"error": "; ".join(errors)}


class ClockSampler:
    """Samples `read()` (default: clocks) every `interval_s` in a thread while the block runs:

        with ClockSampler() as cs:
            run()
        cs.summary()  # {"samples", "errors", "sm_mhz": {"min", "max", "mean"}, ...}
    """

    def __init__(self, interval_s: float = 0.1, device: int = 0,
                 read: Callable[[], dict] | None = None):
        self.interval_s = interval_s
        self.read = read or (lambda: clocks(device))
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            self.samples.append({"t": time.monotonic(), **self.read()})
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> ClockSampler:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append({"t": time.monotonic(), **self.read()})  # one at the end too

    def summary(self) -> dict:
        good = [s for s in self.samples if "error" not in s]
        out: dict[str, Any] = {"samples": len(self.samples),
                               "errors": len(self.samples) - len(good)}
        if len(good) < len(self.samples):
            out["error"] = next(s["error"] for s in self.samples if "error" in s)
        for k in CLOCK_FIELDS:
            vals = [s[k] for s in good if s.get(k) is not None]
            if vals:
                out[k] = {"min": min(vals), "max": max(vals), "mean": sum(vals) / len(vals)}
        return out


# ---- torch baselines ----------------------------------------------------------------------------
def compile_timing(step: Callable[..., object], args: tuple, iters: int = 50,
                   mode: str = "reduce-overhead") -> dict:
    """Seconds per `step(*args)` compiled with torch.compile(mode); if compiling or running the
    compiled step fails (a graph break included: fullgraph), the error is recorded and the eager
    step timed instead ("compiled": False flags it). Keys: s, ms, compiled, compile_s, mode,
    error (None when compiled)."""
    res: dict[str, Any] = {"mode": mode, "error": None}
    try:
        _need_gpu()
    except RuntimeError as e:
        return {**res, **_error(e), "compiled": False}
    try:
        t0 = time.perf_counter()
        fn = torch.compile(step, mode=mode, fullgraph=True)  # a graph break is an error here
        with torch.no_grad():
            for _ in range(3):  # compile, record the CUDA graphs, replay
                fn(*args)
        torch.cuda.synchronize()
        res["compile_s"] = time.perf_counter() - t0
        res["compiled"] = True
    except Exception as e:
        res.update(_error(e), compiled=False)
        fn = step
    try:
        with torch.no_grad():
            s = timed(lambda: fn(*args), iters)
        res.update(s=s, ms=s * 1e3)
    except Exception as e:
        res.update(_error(e))
    return res


TORCH_DECODE_FAMILIES = ("llama", "qwen3", "qwen2")  # what TorchDecode implements


class TorchDecode:
    """One decode step (T = 1) of the dense families (Llama, Qwen3, Qwen2) in plain torch ops
    with bf16 weights and a static KV cache [L, B, Hkv, S_max, D] (graph-safe: no host syncs),
    the rounding points of the reference's bf16 mode. The torch.compile baseline's step."""

    def __init__(self, cfg, w: dict[str, torch.Tensor], batch: int, s_max: int,  # noqa: ANN001
                 device: str | torch.device = "cuda"):
        self.cfg, self.b = cfg, batch
        self.w = {k: v.to(device, torch.bfloat16) for k, v in w.items()}
        L, hkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.k = torch.zeros(L, batch, hkv, s_max, d, dtype=torch.bfloat16, device=device)
        self.v = torch.zeros_like(self.k)
        inv = torch.tensor(cfg.rope.inv_freq(d), dtype=torch.float64)
        ang = torch.arange(s_max, dtype=torch.float64)[:, None] * inv
        self.cos = torch.cat((ang.cos(), ang.cos()), -1).float().to(device)
        self.sin = torch.cat((ang.sin(), ang.sin()), -1).float().to(device)
        self.mask_pos = torch.arange(s_max, device=device)

    def norm(self, x, w):  # noqa: ANN001, ANN201
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
                * w.float()).to(torch.bfloat16)

    def rope(self, x, pos):  # noqa: ANN001, ANN201
        c, s = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x1, x2 = x.chunk(2, -1)
        return x * c + torch.cat((-x2, x1), -1) * s

    def logits(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tok [B] int64, pos [B] int64 (cache position of the new token) -> fp32 [B, V];
        writes this token's k, v into the cache."""
        cfg, w = self.cfg, self.w
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = w["model.embed_tokens.weight"][tok].float()  # [B, H]
        bidx = torch.arange(self.b, device=tok.device)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            x = self.norm(h, w[p + "input_layernorm.weight"])
            q = F.linear(x, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = F.linear(x, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = F.linear(x, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q, k = q.float().view(self.b, hq, d), k.float().view(self.b, hkv, d)
            v = v.view(self.b, hkv, d)
            if cfg.qk_norm:
                q = self.norm(q, w[p + "self_attn.q_norm.weight"]).float()
                k = self.norm(k, w[p + "self_attn.k_norm.weight"]).float()
            q, k = self.rope(q, pos).to(torch.bfloat16), self.rope(k, pos).to(torch.bfloat16)
            self.k[i, bidx, :, pos] = k
            self.v[i, bidx, :, pos] = v
            mask = self.mask_pos[None, :] <= pos[:, None]  # [B, S]
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], self.k[i], self.v[i], attn_mask=mask[:, None, None, :],
                enable_gqa=True)  # [B, Hq, 1, D]
            h = h + F.linear(o.reshape(self.b, hq * d), w[p + "self_attn.o_proj.weight"]).float()
            x = self.norm(h, w[p + "post_attention_layernorm.weight"])
            g = F.linear(x, w[p + "mlp.gate_proj.weight"]).float()
            u = F.linear(x, w[p + "mlp.up_proj.weight"]).float()
            a = (F.silu(g) * u).to(torch.bfloat16)
            h = h + F.linear(a, w[p + "mlp.down_proj.weight"]).float()
        x = self.norm(h, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return F.linear(x, head).float()

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tok [B], pos [B] -> the greedy next tokens [B]."""
        return torch.argmax(self.logits(tok, pos), dim=-1)


# Hazy Research's low-latency megakernel, Llama-3.2-1B, B = 1 on an H200: 759.83 us/step
HAZY_H200_S = 760e-6


# ---- targets of the first measurements: ratios measured in one run ------------------------------
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
    # hybrid models (issue 12): bandwidth at B = 1, ReplaySSM against the recurrent update
    Target("qwen3.5-0.8b", 1, "bw_fraction", 0.80, None,
           "bytes/step / kernel time vs the measured achievable bandwidth"),
    Target("nemotron-h-8b", 1, "bw_fraction", 0.80, None,
           "bytes/step / kernel time vs the measured achievable bandwidth"),
    Target("nemotron-h-8b", 1, "replay_speedup", 1.0, None,
           "recurrent step / fastest ReplaySSM step at the same B (no slower)"),
    Target("nemotron-h-8b", 64, "replay_speedup", 1.3, None,
           "recurrent step / fastest ReplaySSM step at the same B"),
    # Kimi Linear (issue 13): the routed experts' bytes, weights made on the GPU
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
