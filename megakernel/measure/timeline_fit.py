"""Per-instruction cost parameters fitted to one measured step's timeline
(megakernel/measure/timeline.py): the busy intervals and finish times of the timeline build's
records against the replay of the program the step ran, by refit.py's search (`plan --refit
--timeline-records`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megakernel.program.cost import CostParams
from megakernel.program.measurements import RefitError
from megakernel.program.refit import DEFAULT_FIT, least_squares, validate_fit


@dataclass
class TimelineFit:
    """Cost parameters fitted to one step's per-instruction wait and busy intervals."""

    start: CostParams
    params: CostParams
    fitted: tuple[str, ...]
    loss_before: float
    loss_after: float
    evaluations: int
    condition: float
    instructions: int


def timeline_residuals(prog, rows: np.ndarray, params: CostParams) -> np.ndarray:  # noqa: ANN001
    """Per measured instruction (timeline rows, megakernel/measure/timeline.py), the replayed minus
    the measured busy interval (finish - wait_end) and finish time (from the step's first stamp),
    over the mean measured busy interval: [2n]. A busy interval costs about fixed + 2 latencies (a
    valley on its own); the finish times add up the waits along each SM's queue and pin the latency
    (a wait interval alone jumps with every change of the critical producer)."""
    from megakernel.measure.timeline import COL, predicted

    pred = predicted(prog, params, exact=True)
    first = np.concatenate(([0], np.cumsum([len(q) for q in prog.queues])))
    p = pred[first[rows[:, COL["sm"]]] + rows[:, COL["pos"]].astype(np.int64)]

    def intervals(r: np.ndarray) -> np.ndarray:
        we, fin = (r[:, COL[k]].astype(float) for k in ("wait_end", "finish"))
        return np.concatenate([fin - we, fin])

    meas = intervals(rows)
    scale = max(float(np.mean(rows[:, COL["finish"]] - rows[:, COL["wait_end"]])), 1.0)
    return (intervals(p) - meas) / scale


def fit_timeline(prog, rows: np.ndarray, fit: tuple[str, ...] = DEFAULT_FIT,  # noqa: ANN001
                 start: CostParams | None = None, grid: int = 5, tol: float = 1e-3,
                 max_evals: int = 200) -> TimelineFit:
    """Fit the per-instruction fixed cost and latency parameters (any of BOUNDS) to the busy
    intervals and finish times of a measured step (`rows`: timeline.decode of the timeline
    build's records, checked against `prog`, the program the step ran). Same search as
    `refit`."""
    from megakernel.measure.timeline import check_matches

    fit = tuple(fit)
    validate_fit(fit)  # one step holds many intervals
    if not len(rows):
        raise RefitError("the timeline holds no instruction records")
    try:
        check_matches(rows, prog)
    except ValueError as e:
        raise RefitError(str(e)) from None
    start = start or CostParams()
    params, loss0, fbest, evals, cond = least_squares(
        lambda p: timeline_residuals(prog, rows, p), fit, start, grid, tol, max_evals)
    return TimelineFit(start, params, fit, loss0, fbest, evals, cond, len(rows))


def describe_timeline(result: TimelineFit) -> list[str]:
    """The fitted parameters (printed by `plan --refit --timeline-records`)."""
    lines = [f"refit of {', '.join(result.fitted)} to the busy intervals and finish times of "
             f"{result.instructions} instruction(s) ({result.evaluations} loss evaluations):"]
    for k in result.fitted:
        s, u = (1e9, "ns") if k in ("mem_latency", "l2_latency") else (1e6, "us")
        lines.append(f"  {k}: {getattr(result.start, k) * s:.3g} {u} -> "
                     f"{getattr(result.params, k) * s:.4g} {u}")
    lines.append(f"rms error (of the mean busy interval): "
                 f"{100 * math.sqrt(result.loss_before):.2f}% -> "
                 f"{100 * math.sqrt(result.loss_after):.2f}% (condition number "
                 f"{result.condition:.3g})")
    return lines
