"""`python -m megakernel info`: the versions, the GPU, and what each backend can do on this machine
(`machine_info`, the JSON-ready answer). It never imports the DSL."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
from typing import Any

from megakernel.common.arch import CAPABILITY_ARCH
from megakernel.serve.backends import BACKENDS


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def machine_info() -> dict[str, Any]:
    """Versions, GPU, and what each backend can do here. Never imports the DSL."""
    import platform

    versions = {d: _version(d) for d in ("torch", "nvidia-cutlass-dsl", "cuda-python")}
    gpu: dict[str, Any] = {"available": False}
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            gpu = {"available": True, "name": torch.cuda.get_device_name(0),
                   "capability": f"sm_{major}{minor}", "count": torch.cuda.device_count(),
                   "kernel_arch": CAPABILITY_ARCH.get((major, minor))}
    except ImportError:
        gpu["why"] = "torch is not installed"

    def can(ok: bool, why: str, module: str) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": ok} if ok else {"ok": False, "why": why}
        out["module"] = module
        out["module_present"] = _has_module(module)
        return out

    dsl = versions["nvidia-cutlass-dsl"]
    run_ok = bool(gpu.get("kernel_arch")) and versions["cuda-python"] is not None
    if not gpu["available"]:
        run_why = "no CUDA GPU"
    elif not gpu.get("kernel_arch"):
        run_why = f"GPU is {gpu['capability']}; the kernel targets sm_90a and sm_100a"
    else:
        run_why = "cuda-python is not installed"
    backends = {
        "reference": {**can(versions["torch"] is not None, "torch is not installed",
                            "megakernel.reference.model"),
                      "devices": ["cpu"] + (["cuda"] if gpu["available"] else [])},
        "cpu-executor": can(versions["torch"] is not None, "torch is not installed",
                            BACKENDS["cpu-executor"][0]),
        "kernel-compile": can(dsl is not None, "nvidia-cutlass-dsl is not installed",
                              "megakernel.kernel"),
        "kernel-run": can(run_ok, run_why, BACKENDS["kernel"][0]),
    }
    return {"python": platform.python_version(), "versions": versions, "gpu": gpu,
            "backends": backends}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    info = machine_info()
    print(f"python {info['python']}")
    for dist, v in info["versions"].items():
        print(f"{dist} {v or 'not installed'}")
    g = info["gpu"]
    if g["available"]:
        arch = g["kernel_arch"] or "not a kernel target"
        print(f"GPU: {g['name']} ({g['capability']}, {arch}) x{g['count']}")
    else:
        print("GPU: none (torch.cuda.is_available() is False)")
    what = {"reference": "reference model", "cpu-executor": "CPU executor of the kernel program",
            "kernel-compile": "kernel compile (AOT, needs the DSL, no GPU)",
            "kernel-run": "kernel run (needs an sm_90a/sm_100a GPU)"}
    for name, b in info["backends"].items():
        state = "yes" if b["ok"] else f"no: {b['why']}"
        extra = f" on {', '.join(b['devices'])}" if b["ok"] and "devices" in b else ""
        missing = "" if b["module_present"] else f" ({b['module']} is not in this tree yet)"
        print(f"  {what[name]}: {state}{extra}{missing}")
    if args.json:
        print(json.dumps(info))
    return 0
