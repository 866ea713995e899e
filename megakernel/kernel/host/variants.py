"""The kernel's build variants: name -> the `make_spec` overrides of each. gpu-check builds and
runs every one of them (gpu_check/cases.py) and the cost-model refit reads their measurements
(program/measurements.py); a leaf module, so that neither imports the other for the table."""

from __future__ import annotations

from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},  # the deepest shared-memory weight ring that fits, L2 lookahead on
    "global": {"smem_stages": 0},  # no loader warp: weights read from global memory
    "timeline": {"timeline": True},  # stamps per-instruction times (benchmark stage only)
    "nolookahead": {"l2_window": 0},  # the default without the L2 lookahead (its A/B)
}


def variants() -> tuple[tuple[str, int | None], ...]:
    """(name, smem_stages) of every build variant (None: the deepest ring that fits)."""
    return tuple((n, o.get("smem_stages")) for n, o in VARIANTS.items())
