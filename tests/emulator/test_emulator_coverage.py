"""The coverage report: `.loc` lines of a line-info build mapped to the kernel's functions, what
ran and what did not (a synthetic PTX for the mapping; slow lane: a real line-info build)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megakernel.emulator import coverage as cv

SYNC = cv.KERNEL_PKG / "sync.py"


def line_of(path: Path, text: str) -> int:
    return next(i for i, s in enumerate(path.read_text().splitlines(), 1) if text in s)


def fake_ptx(lines: list[int]) -> str:
    """One instruction under a `.loc` of sync.py per line; the `.file` table last, as the DSL
    writes it."""
    body = []
    for n in lines:
        body += [f"\t.loc\t1 {n} 0", "\tadd.s32 \t%r1, %r1, 1;"]
    return "\n".join([".visible .entry k()", "{", *body, "}",
                      f'\t.file\t1 "/elsewhere/megakernel/kernel/{SYNC.name}"'])


def test_the_report_names_what_never_ran(tmp_path: Path) -> None:
    spin = line_of(SYNC, "v = cute.arch.load(flag, Int32")
    trap = line_of(SYNC, 'inline_ptx("trap;")  # deadlock')
    signal = line_of(SYNC, "cute.arch.red(counters")
    ptx = tmp_path / "k.ptx"
    ptx.write_text(fake_ptx([spin, trap, signal]))
    m = cv.loc_map(ptx.read_text())
    assert sorted(m.values()) == sorted(("sync.py", n) for n in (spin, trap, signal))
    executed = [n for n, loc in m.items() if loc[1] == spin]  # only the spin ran
    cov = cv.Coverage()
    cov.add(str(ptx), executed)
    fns = {f[0]: f for f in cov.by_function()["sync.py"]}
    assert fns["spin_counter"][1:3] == (2, 1) and fns["spin_counter"][3] == [trap]
    assert fns["signal_counter"][2] == 0
    text = cov.report()
    assert "unreached functions: `signal_counter`" in text
    assert f"`spin_counter`: lines {trap}" in text
    assert "1 of 3 device-code lines" in text


def test_a_build_without_line_info_counts_as_unmapped(tmp_path: Path) -> None:
    ptx = tmp_path / "k.ptx"
    ptx.write_text(".visible .entry k()\n{\n\tadd.s32 \t%r1, %r1, 1;\n}\n")
    cov = cv.Coverage()
    cov.add(str(ptx), [3])
    assert cov.unmapped == 1 and not cov.emitted


def test_launch_records_go_to_the_named_file(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    dest = tmp_path / "rec.jsonl"
    monkeypatch.delenv(cv.ENV_COVERAGE, raising=False)
    cv.record(Path("a.ptx"), {5: 2})  # unset: nothing written anywhere
    monkeypatch.setenv(cv.ENV_COVERAGE, str(dest))
    cv.record(Path("a.ptx"), {7: 1, 5: 3})
    cv.record(Path("b.ptx"), {1: 1})
    rows = [json.loads(s) for s in dest.read_text().splitlines()]
    assert rows == [{"ptx": "a.ptx", "hits": [5, 7]}, {"ptx": "b.ptx", "hits": [1]}]


def test_spans() -> None:
    assert cv.spans([9, 3, 4, 5, 11]) == "3-5, 9, 11"


@pytest.mark.parametrize("model", ["llama-tiny"])
def test_a_line_info_build_maps_its_step_to_the_kernels_lines(tmp_path: Path, monkeypatch,  # noqa: ANN001
                                                              model: str) -> None:
    """A real line-info build (its own cache key) emulated for a step: nearly every line that
    emits PTX ran, and the watchdog's trap (no correct step reaches it) is named unreached."""
    from megakernel.gpu_check.emulated import Case
    from megakernel.kernel.toolchain.fingerprint import ENV_LINE_INFO
    from tests.emulator.helpers import emulated_run

    records = tmp_path / "rec.jsonl"
    monkeypatch.setenv(ENV_LINE_INFO, "1")
    monkeypatch.setenv(cv.ENV_COVERAGE, str(records))
    emulated_run(Case(model, steps=1))
    cov = cv.Coverage()
    cov.add_records(records)
    assert cov.launches == 1 and cov.unmapped == 0
    assert len(cov.emitted) > 200 and len(cov.reached) > 0.8 * len(cov.emitted)
    trap = line_of(SYNC, 'inline_ptx("trap;")  # deadlock')
    assert ("sync.py", trap) in cov.emitted - cov.reached
    assert ("sync.py", line_of(SYNC, "cute.arch.red(counters")) in cov.reached
