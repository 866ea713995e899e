"""The emulated kernel against the CPU executor: dense presets, one-row and tensor-core (mma.sync)
matvecs, on two scheduler seeds (slow lane: a JIT build and two steps per case)."""

from __future__ import annotations

import pytest

from megakernel.gpu_check.emulated import Case
from tests.emulator.helpers import emulated_run

CASES = [Case(m, seed=s) for m in ("llama-tiny", "qwen3-tiny", "qwen2-tiny") for s in (0, 101)]
CASES += [Case("llama-tiny", batch=16, seed=7), Case("qwen3-tiny", batch=4, seed=3)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_emulated_dense_matches_executor(case: Case) -> None:
    emulated_run(case)
