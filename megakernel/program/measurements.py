"""Measured decode-step times, the input of the cost-model refit (refit.py): `Measurement`, read
from a JSON list or from a gpu-check report (its `measurements` list, else its benchmark rows,
`from_gpu_check`), and the GPU description each names (`resolve_gpu`, `gpu_key`).

A measurement with a measured copy bandwidth is replayed on the GPU description with that
bandwidth; one of the kernel built without the shared-memory pipeline carries `smem_window` 0
(kernel/host/variants.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megakernel.isa.stages import PlanError


class RefitError(PlanError):
    """Measurements or options the refit cannot use (the message names the problem); a
    PlanError, so the CLI reports it as bad input."""


@dataclass(frozen=True)
class Measurement:
    """One measured decode step (the JSON rows of gpu_check's `measurements` list)."""

    model: str  # preset name or checkpoint dir
    gpu: str  # gpus.GPUS key, optionally restricted: "h200" or "h200/16sm"
    batch: int
    tokens: int
    context: int | None  # cached tokens per sequence when measured (None: compiler default)
    step_s: float  # measured seconds per step
    copy_bw_gbs: float | None = None  # copy bandwidth measured in the same run
    max_seq_len: int | None = None  # KV positions the measured program was compiled for
    smem_window: int | None = None  # None: the default build's ring (CostParams.smem_window)
    label: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise RefitError(f"unknown measurement fields {unknown}; known: {sorted(names)}")
        missing = [k for k in ("model", "gpu", "batch", "step_s") if k not in d]
        if missing:
            raise RefitError(f"measurement {d} lacks {missing}")
        return cls(**{"tokens": 1, "context": None, **d})

    def describe(self) -> str:
        s = f"{self.model} B={self.batch} T={self.tokens} on {self.gpu}"
        return f"{s} [{self.label}]" if self.label else s


# ---- reading -------------------------------------------------------------------------------------
def resolve_gpu(spec: str):  # noqa: ANN201 (gpus.GPU)
    """'h200' -> gpus.gpu('h200'); 'h200/16sm' -> the same restricted to 16 SMs."""
    from megakernel.program.gpus import GPUError, gpu

    name, _, sms = spec.partition("/")
    try:
        g = gpu(name)
        if sms:
            if not sms.endswith("sm") or not sms[:-2].isdigit():
                raise RefitError(f"GPU {spec!r}: expected NAME or NAME/<n>sm, e.g. h200/16sm")
            g = g.with_sms(int(sms[:-2]))
    except GPUError as e:
        raise RefitError(f"measurement GPU {spec!r}: {e}") from e
    return g


def load_measurements(path: str | Path) -> list[Measurement]:
    """Measurements from a JSON file: a gpu-check report (its `measurements` list, or its
    `bench` rows when the list is absent), or a plain list of measurement objects."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RefitError(f"cannot read measurements from {path}: {e}") from e
    if isinstance(data, dict):
        rows = data.get("measurements")
        if rows is None:
            if "bench" not in data:
                raise RefitError(f"{path}: neither a 'measurements' list nor gpu-check 'bench' "
                                 "rows")
            rows = from_gpu_check(data)
    elif isinstance(data, list):
        rows = data
    else:
        raise RefitError(f"{path}: expected a JSON object or list, got {type(data).__name__}")
    return [Measurement.from_dict(r) for r in rows]


def gpu_key(device: str, sms: int) -> str:
    """The gpus.GPUS key for a CUDA device name ('NVIDIA H200' -> 'h200'), restricted
    ('/<n>sm') when the device has fewer SMs than the datasheet part."""
    from megakernel.program.gpus import GPUS

    flat = device.lower().replace(" ", "").replace("-", "")
    key = next((k for k in GPUS if k in flat), None)
    if key is None:
        raise RefitError(f"no GPU description for device {device!r}; known: {', '.join(GPUS)}")
    return key if not sms or sms >= GPUS[key].num_sms else f"{key}/{sms}sm"


def from_gpu_check(report: dict[str, Any]) -> list[dict[str, Any]]:
    """gpu-check report -> measurement dicts (Measurement.from_dict input), one per benchmark
    row without an error. Rows of the variant without the shared-memory ring get its window."""
    from megakernel.kernel.host.limits import SMEM_STAGE_BYTES

    stages = _variant_stages()
    bw = report.get("copy_bandwidth_GBps")
    out = []
    for b in report.get("bench", []):
        if "error" in b or "step_ms" not in b:
            continue
        variant = b.get("variant", "default")
        if variant not in stages:
            raise RefitError(f"bench row {b.get('model')} has unknown variant {variant!r}; "
                             f"known: {sorted(stages)}")
        # None: the build's own ring for the row's model and batch (spec.build_ring_bytes)
        window = None if stages[variant] is None else stages[variant] * SMEM_STAGE_BYTES
        out.append({
            "model": b["model"], "gpu": gpu_key(str(report.get("device", "")),
                                                int(report.get("sms") or 0)),
            "batch": int(b["batch"]), "tokens": int(b.get("tokens", 1)),
            "context": b.get("context"), "step_s": float(b["step_ms"]) / 1e3,
            "copy_bw_gbs": float(bw) if bw else None, "max_seq_len": b.get("max_seq_len"),
            "smem_window": window,
            "label": variant,
        })
    return out


def _variant_stages() -> dict[str, int | None]:
    from megakernel.kernel.host.variants import variants

    return dict(variants())
