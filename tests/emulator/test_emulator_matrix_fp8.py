"""The emulated kernel against the CPU executor: FP8 (e4m3) weights, channel and block scales, on
the one-row and the multi-row matvec (slow lane)."""

from __future__ import annotations

import pytest

from megakernel.gpu_check.emulated import Case
from tests.emulator.helpers import emulated_run

CASES = [Case("llama-tiny", fp8="channel"), Case("llama-tiny", fp8="channel", batch=16, seed=9),
         Case("llama-tiny", fp8="block", batch=4, seed=2), Case("qwen3.5-tiny", fp8="channel")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_emulated_fp8_matches_executor(case: Case) -> None:
    emulated_run(case)
