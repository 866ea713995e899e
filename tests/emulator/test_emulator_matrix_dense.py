"""The emulated kernel against the CPU executor: dense presets, one-row and tensor-core (mma.sync)
matvecs, on two scheduler seeds (slow lane: a JIT build and two steps per case)."""

from __future__ import annotations

import pytest

from megakernel.gpu_check.emulated import Case
from tests.emulator.helpers import emulated_run

CASES = [Case(m, seed=s) for m in ("llama-tiny", "qwen3-tiny", "qwen2-tiny") for s in (0, 101)]
CASES += [Case("llama-tiny", batch=16, seed=7), Case("qwen3-tiny", batch=4, seed=3)]
# cached keys: the tensor-core partial (attention_mma.py) over several chunks a warp share
# (1 / 8 of a split a warp; one split: ~38 keys a warp at 300), over splits and their merge; the
# B = 8 build (the mma GEMV beside it), D = 128 (qwen3-tiny, B = 1 and 4) and T = 8's 16 query
# rows (rows g + 8 of the tile too) with their causal limits
CASES += [Case("llama-tiny", context=300, max_seq_len=320, n_splits=1, seed=5),
          Case("llama-tiny", context=200, max_seq_len=256, seed=9),
          Case("qwen3-tiny", context=150, max_seq_len=192, n_splits=1, seed=2),
          Case("llama-tiny", batch=8, context=100, max_seq_len=128, n_splits=1),
          Case("qwen3-tiny", batch=4, context=70, max_seq_len=96),
          Case("llama-tiny", tokens=8, context=100, max_seq_len=128, n_splits=1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_emulated_dense_matches_executor(case: Case) -> None:
    emulated_run(case)
