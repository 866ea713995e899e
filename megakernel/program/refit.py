"""Refit cost-model parameters (cost.CostParams) to measured decode-step times.

The cited defaults (cost.CITATIONS) are published figures from other GPUs and kernels; a GPU run
(`gpu-check`'s benchmark) measures real step times. `refit` compiles the program of every
measurement once (with the default parameters: that is the schedule the measured kernel ran), then
searches a few parameters (default: `mem_latency` and `fixed_per_instr`; the others keep their
cited values) that minimise the mean relative squared error of the fluid replay (replay.py)
against the measured times:

    loss(p) = mean_m ((replay(prog_m, p) - measured_m) / measured_m)^2

The search works in log space inside `BOUNDS`: a coarse grid (so that a kink of the piecewise
smooth replay cannot trap the start), then Levenberg-Marquardt steps from the best grid point with
a forward-difference Jacobian until a step moves less than `tol`. Each evaluation replays every
measurement once, so the cost is about evaluations x measurements x one replay.

The measurements come from measurements.py. One with a measured copy bandwidth is replayed on
the GPU description with that bandwidth, its program still compiled on the description without it
(as the kernel's own program is: it compiles for `gpus.from_device()`). `fit_timeline`
(measure/timeline_fit.py) runs the same search on one step's per-instruction timeline.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megakernel.program.cost import CostParams
from megakernel.program.measurements import Measurement, RefitError, resolve_gpu

# search bounds per fittable parameter (seconds); wide around the cited values
BOUNDS: dict[str, tuple[float, float]] = {
    "mem_latency": (20e-9, 5e-6),
    "fixed_per_instr": (20e-9, 20e-6),
    "launch": (0.1e-6, 50e-6),
    "l2_latency": (10e-9, 2e-6),
}
DEFAULT_FIT = ("mem_latency", "fixed_per_instr")
ILL_CONDITIONED = 100.0  # Jacobian condition number above which describe() warns


@dataclass
class FitRow:
    measurement: Measurement
    before_s: float  # predicted with the starting parameters
    after_s: float  # predicted with the fitted parameters

    @property
    def before_ratio(self) -> float:
        return self.before_s / self.measurement.step_s

    @property
    def after_ratio(self) -> float:
        return self.after_s / self.measurement.step_s


@dataclass
class FitResult:
    start: CostParams
    params: CostParams
    fitted: tuple[str, ...]
    rows: list[FitRow]
    loss_before: float
    loss_after: float
    evaluations: int
    # condition number of the relative residuals' Jacobian in log parameters at the fit: large
    # means the measurements barely tell the fitted parameters apart (a valley, not a point)
    condition: float = 1.0

    @property
    def rms_before(self) -> float:
        return math.sqrt(self.loss_before)

    @property
    def rms_after(self) -> float:
        return math.sqrt(self.loss_after)

    def to_json(self) -> dict[str, Any]:
        return {
            "cost_params": dataclasses.asdict(self.params),
            "fitted": list(self.fitted),
            "start": {k: getattr(self.start, k) for k in self.fitted},
            "rms_rel_error_before": self.rms_before,
            "rms_rel_error_after": self.rms_after,
            "evaluations": self.evaluations,
            "condition": self.condition,
            "rows": [{**dataclasses.asdict(r.measurement), "predicted_before_s": r.before_s,
                      "predicted_after_s": r.after_s} for r in self.rows],
        }


# ---- programs -----------------------------------------------------------------------------------
class ProgramCache:
    """Compiled programs keyed by what shapes them; each compiled once (the expensive part)."""

    def __init__(self) -> None:
        self._progs: dict[tuple, Any] = {}

    def get(self, m: Measurement):  # noqa: ANN201 (compiler.Program)
        from megakernel.models import ConfigError, resolve
        from megakernel.program.compiler import compile_program

        key = (m.model, m.gpu, m.batch, m.tokens, m.context, m.max_seq_len, m.copy_bw_gbs)
        if key not in self._progs:
            try:
                cfg = resolve(m.model)
            except (ConfigError, OSError) as e:
                raise RefitError(f"unknown model {m.model!r} in measurement "
                                 f"{m.describe()}: {e}") from e
            g = resolve_gpu(m.gpu)
            prog = compile_program(cfg, m.batch, g, tokens=m.tokens, max_seq_len=m.max_seq_len,
                                   context=m.context)
            if m.copy_bw_gbs is not None:  # same schedule, replayed at the measured bandwidth
                prog = dataclasses.replace(prog, gpu=g.with_copy_bandwidth(m.copy_bw_gbs * 1e9))
            self._progs[key] = prog
        return self._progs[key]


def predict(prog, m: Measurement, params: CostParams) -> float:  # noqa: ANN001
    """Replayed step seconds of one measurement's program under `params`."""
    from megakernel.program.replay import replay

    if m.smem_window is not None:
        params = dataclasses.replace(params, smem_window=m.smem_window)
    return replay(prog, params).predicted_s


# ---- fit ----------------------------------------------------------------------------------------
def validate(measurements: list[Measurement], fit: tuple[str, ...]) -> None:
    validate_fit(fit)
    if len(measurements) < len(fit):
        raise RefitError(f"{len(measurements)} measurement(s) cannot determine {len(fit)} "
                         f"parameters ({', '.join(fit)}): need at least {len(fit)}")
    for m in measurements:
        if not (isinstance(m.step_s, (int, float)) and m.step_s > 0 and math.isfinite(m.step_s)):
            raise RefitError(f"measured step time must be positive and finite, got {m.step_s} "
                             f"for {m.describe()}")
        if m.copy_bw_gbs is not None and not m.copy_bw_gbs > 0:
            raise RefitError(f"measured copy bandwidth must be positive, got {m.copy_bw_gbs} "
                             f"GB/s for {m.describe()}")


def validate_fit(fit: tuple[str, ...]) -> None:
    """The parameter names are fittable and distinct."""
    if not fit:
        raise RefitError("nothing to fit: name at least one parameter")
    bad = [f for f in fit if f not in BOUNDS]
    if bad:
        raise RefitError(f"cannot fit {bad}; fittable parameters: {', '.join(BOUNDS)}")
    if len(set(fit)) != len(fit):
        raise RefitError(f"parameters to fit repeat: {list(fit)}")


def refit(measurements: list[Measurement], fit: tuple[str, ...] = DEFAULT_FIT,
          start: CostParams | None = None, grid: int = 7, tol: float = 1e-3,
          max_evals: int = 400, cache: ProgramCache | None = None) -> FitResult:
    """Fit the parameters named in `fit` to the measurements (module docstring).

    `grid` points per parameter in the coarse search (log-spaced inside BOUNDS), `tol` the
    smallest step in log space that continues the search (1e-3: 0.1%), `max_evals` a cap on
    evaluations (each replays every measurement once).
    """
    fit = tuple(fit)
    validate(measurements, fit)
    start = start or CostParams()
    cache = cache or ProgramCache()
    progs = [cache.get(m) for m in measurements]
    meas = np.array([m.step_s for m in measurements])

    def residuals(p: CostParams) -> np.ndarray:  # [M] relative errors
        pred = np.array([predict(pr, m, p) for pr, m in zip(progs, measurements, strict=True)])
        return pred / meas - 1.0

    before = (residuals(start) + 1.0) * meas
    params, loss0, fbest, evals, cond = least_squares(residuals, fit, start, grid, tol, max_evals)
    after = [predict(pr, m, params) for pr, m in zip(progs, measurements, strict=True)]
    rows = [FitRow(m, float(b), a) for m, b, a in zip(measurements, before, after,
                                                       strict=True)]
    return FitResult(start, params, fit, rows, loss0, fbest, evals, cond)


def least_squares(residuals, fit: tuple[str, ...], start: CostParams, grid: int = 7,  # noqa: ANN001
                  tol: float = 1e-3, max_evals: int = 400
                  ) -> tuple[CostParams, float, float, int, float]:
    """Minimise mean(residuals(params)^2) over the parameters named in `fit` (module docstring:
    log space inside BOUNDS, coarse grid, then Levenberg-Marquardt). `residuals`: CostParams ->
    1-D array. Returns (fitted params, loss at start, loss at the fit, evaluations, condition
    number of the Jacobian at the fit)."""
    lo = np.array([math.log(BOUNDS[k][0]) for k in fit])
    hi = np.array([math.log(BOUNDS[k][1]) for k in fit])
    seen: dict[tuple[float, ...], np.ndarray] = {}

    def params_at(x: np.ndarray) -> CostParams:
        return dataclasses.replace(start, **{k: math.exp(v) for k, v in zip(fit, x, strict=True)})

    def resid(x: np.ndarray) -> np.ndarray:  # residuals at log-parameters x
        key = tuple(np.clip(x, lo, hi).tolist())
        if key not in seen:
            seen[key] = residuals(params_at(np.array(key)))
        return seen[key]

    def loss(x: np.ndarray) -> float:
        return float(np.mean(resid(x) ** 2))

    x0 = np.clip([math.log(getattr(start, k)) for k in fit], lo, hi)
    loss0 = loss(x0)
    # coarse grid (fewer points per axis when the cap would be exceeded)
    n = max(3, min(grid, int((max_evals // 2) ** (1 / len(fit)))))
    axes = [np.linspace(a, b, n) for a, b in zip(lo, hi, strict=True)]
    best = min([x0, *(np.array(x) for x in itertools.product(*axes))], key=loss)
    fbest = loss(best)
    # Levenberg-Marquardt on the relative residuals in log space, forward-difference Jacobian:
    # the step time is close to linear in latencies and fixed costs (sums along the critical
    # path), so the Gauss-Newton steps follow the narrow valley where latency trades against
    # fixed cost, which an axis-wise search crawls along
    lam, h = 1e-3, 1e-4
    while len(seen) < max_evals:
        r = resid(best)
        jac = np.stack([(resid(best + h * e) - r) / h for e in np.eye(len(fit))], axis=1)
        jtj, g = jac.T @ jac, jac.T @ r
        improved = False
        while lam < 1e8 and len(seen) < max_evals:
            dx = -np.linalg.solve(jtj + lam * np.diag(np.diag(jtj) + 1e-12), g)
            x = np.clip(best + dx, lo, hi)
            f = loss(x)
            if f < fbest:
                improved = float(np.abs(x - best).max()) > tol
                best, fbest, lam = x, f, max(lam / 10, 1e-9)
                break
            lam *= 10
        if not improved:
            break
    r = resid(best)
    jac = np.stack([(resid(best + h * e) - r) / h for e in np.eye(len(fit))], axis=1)
    sv = np.linalg.svd(jac, compute_uv=False)
    cond = float(sv[0] / sv[-1]) if sv[-1] > 0 else float("inf")
    return params_at(best), loss0, fbest, len(seen), cond


# ---- saved parameters ---------------------------------------------------------------------------
def save_params(result: FitResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=2) + "\n")


def load_params(path: str | Path) -> CostParams:
    """CostParams from a file written by `save_params` (or a plain {field: value} object)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RefitError(f"cannot read cost parameters from {path}: {e}") from e
    if not isinstance(data, dict):
        raise RefitError(f"{path}: expected a JSON object of cost parameters")
    values = data.get("cost_params", data)
    names = {f.name for f in dataclasses.fields(CostParams)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise RefitError(f"{path}: unknown cost parameters {unknown}; known: {sorted(names)}")
    return CostParams(**values)


def describe(result: FitResult) -> list[str]:
    """The fitted parameters and the before/after table (printed by `plan --refit`)."""
    unit = {k: (1e9, "ns") if k in ("mem_latency", "l2_latency") else (1e6, "us")
            for k in BOUNDS}
    lines = [f"refit of {', '.join(result.fitted)} to {len(result.rows)} measurement(s) "
             f"({result.evaluations} loss evaluations):"]
    for k in result.fitted:
        s, u = unit[k]
        v = getattr(result.params, k)
        edge = next((w for w, b in zip(("lower", "upper"), BOUNDS[k], strict=True)
                     if abs(math.log(v / b)) < 1e-6), None)
        lines.append(f"  {k}: {getattr(result.start, k) * s:.3g} {u} -> {v * s:.4g} {u}"
                     + (f" (at the {edge} search bound: the model cannot match the "
                        "measurements with this parameter alone)" if edge else ""))
    lines.append(f"rms relative error: {100 * result.rms_before:.2f}% -> "
                 f"{100 * result.rms_after:.2f}% (condition number {result.condition:.3g})")
    if result.condition > ILL_CONDITIONED:
        lines.append(f"warning: the measurements barely separate {', '.join(result.fitted)} "
                     f"(condition number {result.condition:.3g}): the fit is a valley, not a "
                     "point; measure more batch sizes or models to pin each parameter down")
    lines.append("| measurement | measured us | before us | before/meas | after us | after/meas |")
    lines.append("|---|---|---|---|---|---|")
    for r in result.rows:
        lines.append(f"| {r.measurement.describe()} | {r.measurement.step_s * 1e6:.1f} | "
                     f"{r.before_s * 1e6:.1f} | {r.before_ratio:.3f} | {r.after_s * 1e6:.1f} | "
                     f"{r.after_ratio:.3f} |")
    return lines
