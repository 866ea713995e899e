"""Planted bugs in the device code, each caught by the emulator (slow lane: one JIT build and an
emulated case per mutant, in a subprocess on a scratch copy of the package; tests/emulator/
planted.py). docs/TESTING.md keeps the table, with the proof that no test from before the
emulator fails on any of them (`python -m tests.emulator.planted --prior`)."""

from __future__ import annotations

import pytest

from tests.emulator.planted import BY_NAME, MISSED, MUTANTS, Mutant, run_mutant


def test_the_harness_passes_the_unchanged_code() -> None:
    """The control: the scratch copy, its imports and its JIT cache run the real kernel clean,
    so a mutant's failure is the mutant's."""
    out = run_mutant(None, case=BY_NAME["signal-before-stores"].case)
    assert out.verdict == "ok", out.detail


@pytest.mark.parametrize("mutant", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=MISSED[m.name]))
    if m.name in MISSED else m for m in MUTANTS], ids=lambda m: m.name)
def test_the_emulator_catches_the_planted_bug(mutant: Mutant) -> None:
    out = run_mutant(mutant)
    assert out.verdict != "broken", f"the mutant is not a valid one (it must build):\n{out.detail}"
    assert out.caught, f"{mutant.name} ({mutant.what}) went unnoticed:\n{out.detail}"


def test_every_mutant_changes_one_line_of_device_code() -> None:
    from pathlib import Path

    kernel = Path(__file__).resolve().parents[2] / "megakernel" / "kernel" / "device"
    assert len(MUTANTS) >= 8
    for m in MUTANTS:
        assert not m.file.endswith("_index.py"), m.name  # the helpers the index tests execute
        text = (kernel / m.file).read_text()
        assert m.apply(text) != text
