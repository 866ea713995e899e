"""Fixtures of the API tests."""

from __future__ import annotations

import pytest

from megakernel.executor import Executor


@pytest.fixture
def executor_steps(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Counts Executor.step calls by T (tokens per sequence of the program), every path's
    programs included (the op's CPU executor too)."""
    counts: dict[int, int] = {}
    step = Executor.step

    def counted(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        counts[self.prog.tokens] = counts.get(self.prog.tokens, 0) + 1
        return step(self, *a, **k)
    monkeypatch.setattr(Executor, "step", counted)
    return counts
