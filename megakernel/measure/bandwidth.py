"""Measure on a GPU what the cost model assumes: HBM read and copy bandwidth, clocks, and the
timing of the torch.compile decode-step baseline the kernel is judged against (the step itself:
torch_decode.py; the targets the ratios are judged by: targets.py).

Needs torch and cuda-python only (never the DSL). Every function returns a plain dict and, when a
GPU, a build or a tool is missing, a dict with an "error" field instead of raising, so a GPU
check records what it could measure. For megakernel.gpu_check:

- `read_bandwidth(build_dir)`: the HBM read stream (megakernel/kernel/device/stream.py, one CTA per
SM,
  cp.async.bulk into a shared-memory ring) launched from its AOT build under
  `stream_build_dir(build_dir)`, result verified against `stream_reference`;
- `copy_bandwidth()`: device-to-device copy, bytes read + written per second;
- `clocks()` / `ClockSampler`: SM and memory clocks, read only (nvidia-smi, else NVML);
- `compile_timing(step, args)`: a step compiled with mode="reduce-overhead", eager if that fails
  (flagged).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STREAM_SUBDIR = "stream"
GiB = 1 << 30


def _error(e: BaseException) -> dict[str, Any]:
    return {"error": f"{type(e).__name__}: {e}"}


def stream_build_dir(build_dir: str | Path) -> Path:
    """Where the stream kernel's build lives under a gpu-check build dir (DIR/stream/<arch>/):
    `python -m megakernel.kernel.toolchain.stream_build --out <this>` (or stream_build.build_stream)
    writes it."""
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
    from megakernel.launch.runtime import KernelUnavailable, Manifest

    d = stream_build_dir(build_dir) / arch
    f = d / "manifest.json"
    if not f.is_file():
        raise KernelUnavailable(f"no {arch} stream build in {d}: build it with `python -m "
                                "megakernel.kernel.toolchain.stream_build --out "
                                f"{stream_build_dir(build_dir)}`")
    data = json.loads(f.read_text())
    return Manifest(d, data), data


def read_bandwidth(build_dir: str | Path, nbytes: int = 2 * GiB, iters: int = 10) -> dict:
    """HBM read bandwidth of the stream kernel on every SM (one CTA each): bytes/s by CUDA events
    over `iters` launches of `nbytes` (rounded down to whole stages per CTA), after checking the
    words the CTAs store against stream_reference (a kernel that reads nothing fails)."""
    try:
        _need_gpu()
        from megakernel.launch.runtime import LoadedKernel, device_info

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


# ---- torch.compile timing ------------------------------------------------------------------------
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
