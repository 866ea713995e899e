"""The emulated kernel against the CPU executor: hybrid presets (GDN, Mamba2, KDA + MLA + MoE),
with the recurrent update and with ReplaySSM, on two scheduler seeds (slow lane)."""

from __future__ import annotations

import pytest

from megakernel.gpu_check.emulated import Case
from tests.emulator.helpers import emulated_run

MODELS = ("qwen3.5-tiny", "nemotron-h-tiny", "kimi-linear-tiny")
CASES = [Case(m, seed=s) for m in MODELS for s in (0, 101)]
CASES += [Case(m, replay_window=16, seed=5) for m in MODELS]
CASES += [Case("qwen3.5-attn-tiny"), Case("nemotron-h-attn-tiny")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_emulated_hybrid_matches_executor(case: Case) -> None:
    emulated_run(case)
