"""`generate` for every model family: the reference and the CPU executor agree token for token
(recurrent update and ReplaySSM), --replay-window only where there are recurrent layers, and the
kernel backend refuses, by name, what it has no device handlers for."""

from __future__ import annotations

import json

import pytest

import megakernel.reference.model
from megakernel.cli import main as cli
from megakernel.models import FAMILIES, preset
from tests.registries import HYBRID_TINY, TINY

RECURRENT = HYBRID_TINY  # the tiny preset of every family, with recurrent layers or without
DENSE = tuple(m for m in TINY if m not in RECURRENT)
PROMPTS = "5,17,3,101;7,1"  # a ragged batch of two


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_every_family_has_a_tiny_preset_here():
    assert {preset(m).family for m in DENSE + RECURRENT} == set(FAMILIES), (
        "a family without a tiny preset of all its layer kinds (tests/registries.py TINY)")
    assert all(preset(m).recurrent_layers() for m in RECURRENT)
    assert not any(preset(m).recurrent_layers() for m in DENSE)


@pytest.mark.parametrize("model", RECURRENT)
def test_replay_window_matches_recurrent(capsys, model):
    args = ("generate", "--model", model, "--prompt-ids", PROMPTS, "--steps", "6",
            "--dtype", "fp32", "--json")
    rc, out, _ = _run(capsys, *args)
    assert rc == 0
    recurrent = _json(out)
    rc, out, _ = _run(capsys, *args, "--replay-window", "4")
    assert rc == 0
    replay = _json(out)
    assert replay["replay_window"] == 4 and recurrent["replay_window"] == 0
    assert [len(t) for t in replay["tokens"]] == [6, 6]
    assert replay["tokens"] == recurrent["tokens"]


@pytest.mark.parametrize("model, window", [(m, None) for m in DENSE + RECURRENT]
                         + [("qwen3.5-tiny", "3"), ("nemotron-h-tiny", "2"),
                            ("kimi-linear-tiny", "2")])
def test_cpu_executor_matches_reference(capsys, model, window):
    args = ("generate", "--model", model, "--prompt-ids", PROMPTS, "--steps", "5", "--json")
    extra = () if window is None else ("--replay-window", window)
    rc, out, err = _run(capsys, *args, *extra, "--backend", "reference")
    assert rc == 0, err
    ref = _json(out)
    rc, out, err = _run(capsys, *args, *extra, "--backend", "cpu-executor")
    assert rc == 0, err
    ex = _json(out)
    assert ref["backend"] == "reference" and ex["backend"] == "cpu-executor"
    assert ex["replay_window"] == ref["replay_window"] == int(window or 0)
    assert [len(t) for t in ex["tokens"]] == [5, 5]
    assert ex["tokens"] == ref["tokens"]


def test_reference_backend_gets_the_replay_window(capsys, monkeypatch):
    """--replay-window reaches the reference model (its ReplaySSM and recurrent tokens agree,
    so the tokens alone would not show a window that was dropped)."""

    seen = []

    class Spy(megakernel.reference.model.ReferenceModel):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            seen.append(kwargs.get("replay_window"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(megakernel.reference.model, "ReferenceModel", Spy)
    for extra, want in (((), None), (("--replay-window", "3"), 3), (("--replay-window", "0"),
                                                                       None)):
        rc, _, err = _run(capsys, "generate", "--model", "qwen3.5-tiny", "--steps", "2", *extra)
        assert rc == 0, err
        assert seen.pop() == want and not seen


def test_cpu_executor_backend_compiles_the_replay_window(capsys, monkeypatch):
    """--replay-window reaches the executor's program (a dropped window would still give the
    reference's tokens: ReplaySSM and the recurrent update agree)."""
    import megakernel.program.compiler as compiler

    seen = []
    real = compiler.compile_program

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        prog = real(*args, **kwargs)
        seen.append((prog.replay_window, prog.buffers.ring_cap))
        return prog

    monkeypatch.setattr(compiler, "compile_program", spy)
    for extra, want in (((), (None, 0)), (("--replay-window", "3"), (3, 3))):
        rc, _, err = _run(capsys, "generate", "--model", "nemotron-h-tiny", "--steps", "2",
                          "--backend", "cpu-executor", *extra)
        assert rc == 0, err
        # every program (the prefill's chunk and the T = 1 program) runs the window
        assert {w for w, _ in seen} == {want[0]} and want in seen
        seen.clear()


@pytest.mark.parametrize("model", DENSE)
@pytest.mark.parametrize("backend", ["reference", "cpu-executor"])
def test_replay_window_on_dense_model_is_refused(capsys, model, backend):
    rc, _, err = _run(capsys, "generate", "--model", model, "--backend", backend,
                      "--replay-window", "4")
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("error: --replay-window applies to models with recurrent layers; "
                          f"'{model}' has none")
    # 0 is the recurrent update, which every model runs
    rc, _, err = _run(capsys, "generate", "--model", model, "--backend", backend, "--steps", "2",
                      "--replay-window", "0")
    assert rc == 0, err


@pytest.mark.parametrize("replay, core", [(False, "KDA_CORE"), (True, "KDA_REPLAY")])
def test_kernel_backend_names_the_missing_device_handlers(capsys, monkeypatch, replay, core):
    """Refused before any GPU is looked for (the same answer on a CPU and a GPU machine): the
    opcodes of the program it would run (the recurrent core op or, with --replay-window, the
    ReplaySSM one) that the kernel has no handler for (planted: Kimi's KDA core and MLA ops
    unregistered from the device)."""
    import dataclasses

    from megakernel import isa
    from megakernel.isa import registry

    for name in (core, "MLA"):
        op = isa.spec(getattr(isa.Op, name))
        monkeypatch.setitem(registry._SPECS, int(op.code),
                            dataclasses.replace(op, device=False, handler=None))
    extra = ("--replay-window", "3") if replay else ()
    rc, _, err = _run(capsys, "generate", "--model", "kimi-linear-tiny", "--backend", "kernel",
                      *extra)
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: the kernel has no device handlers for {core}, MLA yet")
    assert "the CPU executor runs its program" in err


@pytest.mark.parametrize("model, extra", [
    ("qwen3.5-tiny", ()), ("nemotron-h-tiny", ()),
    ("nemotron-h-tiny", ("--replay-window", "3")),  # MAMBA_REPLAY (kernel/device/mamba_replay.py)
    ("qwen3.5-tiny", ("--replay-window", "3")),  # GDN_REPLAY (kernel/device/gdn.py)
    ("kimi-linear-tiny", ()), ("kimi-linear-tiny", ("--replay-window", "3")),  # KDA, MLA, MoE
])
def test_kernel_backend_takes_recurrent_models_to_the_gpu(capsys, model, extra):
    """Qwen3.5 (GDN + gated attention), Nemotron-H (Mamba2 + attention + relu^2) and Kimi Linear
    (KDA + MLA + MoE), recurrent and by ReplaySSM, run on the kernel: without a GPU the refusal
    is the GPU's, not a missing handler's."""
    rc, _, err = _run(capsys, "generate", "--model", model, "--backend", "kernel", *extra)
    assert rc == 2 and "Traceback" not in err
    assert "no device handlers" not in err and "CUDA GPU" in err


def test_unknown_model_lists_both_kinds_of_preset(capsys):
    rc, _, err = _run(capsys, "generate", "--model", "no-such-model")
    assert rc == 2 and "llama-tiny" in err and "qwen3.5-tiny" in err
