"""Bad input on the command line ends in one `error: ...` naming the flag or the step, exit 2:
run-time overflow in every backend, flag values, build and bench-script names; and progress
lines on stderr (quiet under --json)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megakernel.cli import main as cli
from megakernel.common.finite import NonFiniteError, check_logits
from megakernel.common.progress import set_quiet, stage
from megakernel.models import preset
from megakernel.models.weights import random_weights, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def overflowing_checkpoint(tmp_path: Path, tensor: str | None = None, value: float = 3e38,
                           seed: int | None = None, name: str = "llama-tiny") -> Path:
    """Finite weights (they pass the load check) whose activations overflow at run time:
    `tensor` (default the final norm) filled with `value`. The final norm at 3e38 overflows the
    logits to Inf."""
    cfg = preset(name)
    w = random_weights(cfg, seed=int(torch.randint(1000, ())) if seed is None else seed)
    tensor = tensor or cfg.final_norm_name
    w[tensor] = torch.full_like(w[tensor], value)
    return save_checkpoint(cfg, w, tmp_path / "overflow")


# ---- run-time non-finite logits --------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "cpu-executor"])
def test_non_finite_logits_stop_generation(capsys, tmp_path: Path, backend: str) -> None:
    d = overflowing_checkpoint(tmp_path)
    rc, out, err = run_cli(capsys, "generate", "--model", str(d), "--prompt-ids", "1,2;3",
                           "--steps", "3", "--backend", backend)
    assert rc == 2 and "new tokens" not in out, out  # not token 0 forever
    assert err.startswith(f"error: {backend}: non-finite") and "step" in err, err


def overflowing_projection(tmp_path: Path) -> Path:
    """An o_proj of 1e30s: the residual reaches ~1e32, the next RMSNorm's sum of squares
    overflows fp32 and normalises the row to exactly 0, so no Inf reaches the logits: every
    logit is 0 and greedy decoding says token 0."""
    return overflowing_checkpoint(tmp_path, "model.layers.0.self_attn.o_proj.weight", 1e30, 3)


@pytest.mark.parametrize("backend", ["reference", "cpu-executor"])
def test_overflow_to_zero_logits_stops_generation(capsys, tmp_path: Path, backend: str) -> None:
    """Every backend: an error naming the step and rows, exit 2, not token 0 forever."""
    d = overflowing_projection(tmp_path)
    rc, out, err = run_cli(capsys, "generate", "--model", str(d), "--prompt-ids", "1,2;3",
                           "--steps", "3", "--backend", backend)
    assert rc == 2 and "new tokens" not in out, out
    assert err.startswith(f"error: {backend}: degenerate logits at step 0 (rows [0, "), err
    assert "every logit equals 0" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("backend", ["reference", "cpu-executor"])
def test_overflow_to_zero_logits_raises_in_the_api(tmp_path: Path, backend: str) -> None:
    import megakernel as mk

    llm = mk.load(str(overflowing_projection(tmp_path)), backend=backend, max_seq_len=32)
    with pytest.raises(NonFiniteError, match=f"{backend}: degenerate logits at step 0"):
        llm.generate([[1, 2, 3], [4]], max_new_tokens=3)


def test_kernel_path_checks_the_logits_the_op_returns(tmp_path: Path) -> None:
    """The op's logits are checked per step (a GPU build has no executor check behind it)."""
    from megakernel.serve.kernel_backend import Megakernel

    cfg = preset("llama-tiny")
    mk = Megakernel(cfg, random_weights(cfg, seed=5), batch=2, tokens=1, max_seq_len=8,
                    device="cpu")
    real_step, calls = mk.step, []

    def poisoned_step(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = real_step(*a, **k)
        calls.append(1)
        if len(calls) == 3:
            mk.logits[1, 7] = math.nan  # what an overflowing GPU step returns
        return out

    mk.step = poisoned_step
    with pytest.raises(NonFiniteError, match="kernel: non-finite logits at step 2"):
        mk.generate([[1, 2], [3]], 4)

    calls.clear()

    def zeroed_step(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = real_step(*a, **k)
        calls.append(1)
        if len(calls) == 2:
            mk.logits[0].zero_()  # what a step whose final norm overflowed returns
        return out

    mk.step = zeroed_step
    with pytest.raises(NonFiniteError, match=r"kernel: degenerate logits at step 1 \(rows \[0\]"):
        mk.generate([[1, 2], [3]], 4)


def test_check_logits_names_rows() -> None:
    x = torch.randn(3, 11)
    check_logits(x, 0, "t")
    x[2, 4] = -math.inf
    with pytest.raises(NonFiniteError, match=r"step 5 \(rows \[2\]\)"):
        check_logits(x, 5, "t")
    y = torch.randn(2, 3, 11)  # [B, T, V] as a multi-token step returns them
    y[1, 2] = 0.25
    with pytest.raises(NonFiniteError, match=r"degenerate logits at step 1 \(rows \[5\]: every "
                       r"logit equals 0.25\)"):
        check_logits(y, 1, "t")
    y[1, 2, 0] = 0.5  # one logit differs: a real (if odd) row
    check_logits(y, 1, "t")


# ---- flags named as passed -------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "want", "absent"), [
    (["generate", "--steps", "5000"], "--steps 5000", "--max-seq-len"),
    (["generate", "--steps", "50", "--max-seq-len", "9"], "--max-seq-len 9 is too small", None),
    (["generate", "--device", "cuda:7" if torch.cuda.is_available() else "cuda"], "--device",
     None),
    (["generate", "--device", "nonsense"], "--device 'nonsense'", None),
    (["plan", "--model", "llama-tiny", "--context", "-5"], "--context must be >= 0, got -5", None),
    (["plan", "--model", "llama-tiny", "--context", "5000"],
     "--context 5000 + --tokens 1 do not fit the default --max-seq-len of 1024", None),
    (["plan", "--model", "llama-tiny", "--context", "50", "--max-seq-len", "40"],
     "do not fit --max-seq-len 40", None),
    (["plan", "--model", "llama-tiny", "--copy-bw", "-1"], "--copy-bw must be a positive", None),
    (["plan", "--model", "llama-tiny", "--copy-bw", "nan"], "--copy-bw", None),
    (["plan", "--model", "llama-tiny", "--batch", "0"], "--batch must be >= 1", None),
    (["plan", "--model", "llama-tiny", "--timeline", "/nonexistent-dir/t.png"], "--timeline",
     None),
    (["build", "--model", "llama-tiny", "--arch", "sm_80", "--out", "x"], "--arch 'sm_80'", None),
    (["build", "--model", "llama-tiny", "--arch", "sm_90a", "--out", "x", "--replay-window", "4"],
     "replay_window applies to models with recurrent layers", None),
])
def test_flag_errors_name_the_flag(capsys, argv: list[str], want: str, absent: str | None
                                   ) -> None:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and err.startswith("error: ") and want in err, err
    assert absent is None or absent not in err, err


def test_plan_replay_window_zero_is_the_recurrent_update(capsys) -> None:
    """--replay-window 0 means the recurrent update in plan as in generate (not an error)."""
    rc, out, err = run_cli(capsys, "plan", "--model", "qwen3.5-tiny", "--replay-window", "0",
                           "--json")
    assert rc == 0, err
    assert '"replay_window": 0' in out.splitlines()[-1]


@pytest.mark.parametrize("under", ["file", "file/sub"])
def test_build_out_under_a_file(capsys, tmp_path: Path, under: str) -> None:
    (tmp_path / "file").write_text("x")
    rc, _, err = run_cli(capsys, "build", "--model", "llama-tiny", "--arch", "sm_90a", "--out",
                         str(tmp_path / under))
    assert rc == 2 and err.startswith("error: --out"), err


# ---- bench scripts ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["bench/plan.py", "--models", "llama-tiny,nope"],
    ["bench/plan.py", "--models", "llama-tiny", "--gpus", "a100"],
    ["bench/replay.py", "--gpu", "a100"],
    ["bench/build.py", "--models", "nope"],
    ["bench/build.py", "--models", "llama-tiny", "--arch", "sm_80"],
    ["bench/decode.py", "--model", "nope"],
])
def test_bench_scripts_refuse_unknown_names(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and "unknown name" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---- progress --------------------------------------------------------------------------------
def test_stage_prints_elapsed_on_stderr_unless_quiet(capsys) -> None:
    with stage("packing"):
        pass
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[0] == "packing ..."
    assert err.splitlines()[1].startswith("packing ... ") and err.endswith(" s\n")
    set_quiet(True)
    try:
        with stage("packing"):
            pass
    finally:
        set_quiet(False)
    assert capsys.readouterr().err == ""


def test_plan_shows_progress_unless_json(capsys) -> None:
    rc, _, err = run_cli(capsys, "plan", "--model", "llama-tiny")
    assert rc == 0 and "compiling the llama-tiny program ... " in err and " s\n" in err
    rc, _, err = run_cli(capsys, "plan", "--model", "llama-tiny", "--json")
    assert rc == 0 and err == ""


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3.5-tiny", "kimi-linear-tiny",
                                   "nemotron-h-tiny"])
def test_max_seq_len_is_honoured_for_every_family(capsys, monkeypatch, model: str) -> None:
    """`--max-seq-len 40` sizes the reference's cache and every program the executor compiles."""
    import megakernel.program.compiler as compiler
    import megakernel.reference.model as refmodel

    seen: list[tuple[str, int]] = []
    compile_program, new_cache = compiler.compile_program, refmodel.ReferenceModel.new_cache

    def spy_compile(*a, **k):  # noqa: ANN002, ANN003, ANN202
        seen.append(("program", k["max_seq_len"]))
        return compile_program(*a, **k)

    def spy_cache(self, batch, max_seq_len, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(("cache", max_seq_len))
        return new_cache(self, batch, max_seq_len, *a, **k)

    monkeypatch.setattr(compiler, "compile_program", spy_compile)
    monkeypatch.setattr(refmodel.ReferenceModel, "new_cache", spy_cache)
    for backend in ("reference", "cpu-executor"):
        rc, _, err = run_cli(capsys, "generate", "--model", model, "--backend", backend,
                             "--steps", "2", "--max-seq-len", "40")
        assert rc == 0, err
    assert {k for k, _ in seen} == {"program", "cache"}
    assert {n for _, n in seen} == {40}, seen


def test_build_out_unwritable(capsys, monkeypatch, tmp_path: Path) -> None:
    """An unwritable --out (simulated: this machine's tests may run as root, which writes
    anywhere) ends in error: naming the flag, before anything compiles."""
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == tmp_path
                        else real(p, mode))
    rc, _, err = run_cli(capsys, "build", "--model", "llama-tiny", "--arch", "sm_90a",
                         "--out", str(tmp_path / "b"))
    assert rc == 2 and f"--out {tmp_path / 'b'}: {tmp_path} is not writable" in err, err
    assert "Traceback" not in err
