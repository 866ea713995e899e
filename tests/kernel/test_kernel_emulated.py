"""The fast lane's rung of the PTX emulator: the lane's own build (llama-tiny, B = 1) executed on
the emulator for one step against the CPU executor, and every instruction form of the lane's builds
for both archs decoded. The matrix over families and variants is tests/emulator/ (slow lane)."""

from __future__ import annotations

import pytest

from megakernel.emulator import Emulator
from megakernel.emulator.check import Case, run_case
from megakernel.emulator.errors import UnsupportedForm
from megakernel.emulator.ptx import forms


def test_lane_build_runs_on_the_emulator_like_the_executor(lane_build) -> None:  # noqa: ANN001
    out, _ = lane_build("sm_90a")
    result = run_case(Case("llama-tiny", steps=1), build_dir=str(out.parent))
    assert result.ok, result.summary()
    step = result.steps[0]
    assert step.tokens == step.executor_tokens and min(step.tokens) >= 0
    assert step.stats.warp_instructions > 100_000  # the whole step ran, not a stub
    assert len(step.stats.executed) > 1000


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_form_of_the_lane_builds_decodes(lane_build, arch: str) -> None:  # noqa: ANN001
    out, manifest = lane_build(arch)
    ptx = (out / manifest["ptx"]).read_text()
    assert len(forms(ptx)) > 80
    Emulator(ptx, manifest["dynamic_smem_bytes"], tuple(manifest["block"]))


def test_an_unsupported_form_names_its_line(lane_build) -> None:  # noqa: ANN001
    out, manifest = lane_build("sm_90a")
    lines = (out / manifest["ptx"]).read_text().splitlines()
    at = next(i for i, s in enumerate(lines) if s.strip().startswith("add.s32"))
    reg = lines[at].split()[1].rstrip(",")
    lines.insert(at + 1, f"\tbrev.b32 \t{reg}, {reg};")
    with pytest.raises(UnsupportedForm, match=rf"PTX line {at + 2}: .*'brev\.b32'"):
        Emulator("\n".join(lines), manifest["dynamic_smem_bytes"], tuple(manifest["block"]))
