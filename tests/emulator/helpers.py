"""The emulated matrix's one entry point (tests/lanes.py puts its users in the slow lane)."""

from __future__ import annotations

from megakernel.gpu_check.emulated import Case, run_case


def emulated_run(case: Case) -> None:
    """Emulate `case` (JIT build included) and fail with its summary unless every step, the KV
    cache and the recurrent state match the CPU executor's."""
    result = run_case(case)
    assert result.ok, result.summary()
    assert result.steps and all(s.stats.warp_instructions for s in result.steps)
