"""The fast lane's rung of the PTX emulator: the lane's own build (llama-tiny, B = 1) executed on
the emulator for one step against the CPU executor, and every instruction form of the lane's builds
for both archs decoded. The matrix over families and variants is tests/emulator/ (slow lane)."""

from __future__ import annotations

import pytest

from megakernel.emulator import Emulator
from megakernel.emulator.errors import UnsupportedForm
from megakernel.emulator.ptx import forms
from megakernel.gpu_check.emulated import Case, run_case


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


def test_the_op_launches_an_emulated_build_like_the_executor(lane_build) -> None:  # noqa: ANN001
    """Megakernel(emulate=True): the runtime's emulator driver behind the op, on CPU tensors,
    stepping from a reference prefill; tokens and logits as the CPU executor's program."""
    import torch

    from megakernel.gpu_check.compare import same_program
    from megakernel.launch import torch_op
    from megakernel.launch.emulated import EMULATED_SMS, EmulatedKernel
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.serve.kernel_backend import Megakernel

    out, _ = lane_build("sm_90a")
    cfg = preset("llama-tiny")
    w = random_weights(cfg, seed=3)
    emu = Megakernel(cfg, w, batch=1, max_seq_len=16, build_dir=out.parent, device="cpu",
                     emulate=True)
    ex = Megakernel(cfg, w, batch=1, max_seq_len=16, device="cpu")
    assert emu.prog.num_sms == EMULATED_SMS and emu.manifest is not None
    tok = [m.prefill([[5, 17, 3, 9]]) for m in (emu, ex)]
    assert torch.equal(tok[0], tok[1])
    for _ in range(2):
        got, want = (m.step(t[:, None], return_logits=True) for m, t in zip((emu, ex), tok,
                                                                           strict=True))
        assert torch.equal(got[0], want[0])
        assert same_program(got[1], want[1])["ok"]
        tok = [got[0].long(), want[0].long()]
    driver = torch_op._entry(emu.kernel_id).loaded
    assert isinstance(driver, EmulatedKernel) and driver.launches == 2
    assert driver.last.warp_instructions > 100_000


def test_an_emulated_build_refuses_cuda_and_names_why(lane_build) -> None:  # noqa: ANN001
    from megakernel.launch.checks import ArgumentError
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.serve.kernel_backend import Megakernel

    out, _ = lane_build("sm_90a")
    cfg = preset("llama-tiny")
    with pytest.raises(ArgumentError, match="emulator runs on CPU tensors"):
        Megakernel(cfg, random_weights(cfg), batch=1, max_seq_len=16, build_dir=out.parent,
                   device="cuda", emulate=True)


def test_the_emulator_is_a_backend_auto_never_picks() -> None:
    from megakernel.serve import api, backends

    assert "emulator" in backends.BACKENDS and "emulator" in backends.SPECULATIVE
    assert "emulator" in api.BACKENDS and "emulator" in backends.BF16_ONLY
    llm = api.load("llama-tiny", backend="auto", max_batch=1, max_seq_len=16)
    assert llm.backend in ("kernel", "cpu-executor")
