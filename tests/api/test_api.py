"""The Python API (megakernel.serve.api) and prefill on the program (megakernel.serve.engine): the
README's example runs, every family's program-prefilled tokens equal the reference's, the CLI and
the kernel path (Megakernel on CPU tensors) prefill on the program, buckets/EOS, bad input,
opcheck."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megakernel as mk
from megakernel.launch.checks import ArgumentError
from megakernel.launch.runtime import KernelUnavailable
from megakernel.models.sources import load_model
from megakernel.reference.model import ReferenceModel
from megakernel.reference.model import generate as ref_generate

REPO = Path(__file__).resolve().parents[2]
_PREFILL = ReferenceModel.prefill  # the truth's prefill, before any test patches it
RAGGED = [[5, 17, 3, 101, 42, 9, 8, 7, 6, 1], [7, 1, 30, 4, 11, 12], [2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture
def no_reference_prefill(monkeypatch):  # noqa: ANN001, ANN201
    """The reference's prefill raises: whatever passes ran its prefill on the program."""
    def refuse(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the reference prefill ran")
    monkeypatch.setattr(ReferenceModel, "prefill", refuse)


def test_readme_python_api_example_runs(capsys):  # noqa: ANN001
    text = (REPO / "README.md").read_text()
    section = text.split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert "cpu-executor" in capsys.readouterr().out  # no GPU here: auto took the executor


@pytest.mark.parametrize("model,replay_window", [
    ("llama-tiny", None), ("qwen3-tiny", None), ("qwen3.5-tiny", None), ("qwen3.5-tiny", 4),
    ("nemotron-h-tiny", 4), ("kimi-linear-tiny", None)])
def test_program_prefill_equals_the_reference(model, replay_window, no_reference_prefill,  # noqa: ANN001
                                              executor_steps):
    """Ragged prompts: a T=4 chunk (8 of the shortest prompt's tokens) then T=1 with per-row
    feeding, from empty caches; token for token the reference's bf16 generation."""
    from megakernel.serve.executor_backend import generate

    steps = 3
    want = _reference_unpatched(model, RAGGED, steps, replay_window)
    cfg, w = load_model(model, seed=0)
    got = generate(cfg, w, RAGGED, steps, check=False, replay_window=replay_window)
    assert got == want
    assert executor_steps == {4: 1, 1: 10 + steps - 1 - 4}


def _reference_unpatched(model, prompts, steps, replay_window):  # noqa: ANN001, ANN202
    """The reference's generation with its own prefill (the fixture patches the class)."""
    cfg, w = load_model(model, seed=0)
    ref = ReferenceModel(cfg, w, mode="bf16", replay_window=replay_window)
    ref.prefill = _PREFILL.__get__(ref)
    return ref_generate(ref, prompts, steps)


def test_cli_generate_steps_1_runs_the_program(no_reference_prefill, executor_steps, capsys):  # noqa: ANN001
    from megakernel.cli.main import main

    assert main(["generate", "--steps", "1", "--backend", "cpu-executor", "--prompt-ids",
                 "5,17,3;7,1,30", "--json"]) == 0
    import json

    tokens = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    assert executor_steps == {2: 1, 1: 1}  # 3-token prompts: one T=2 chunk, one T=1 step
    assert tokens == [[t[0]] for t in _reference_unpatched("llama-tiny", [[5, 17, 3], [7, 1, 30]],
                                                          1, None)]


@pytest.mark.parametrize("model,replay_window", [("llama-tiny", None), ("nemotron-h-tiny", 4),
                                                ("nemotron-h-tiny", None), ("qwen3.5-tiny", None)])
def test_megakernel_generates_on_the_program_through_the_op(model, replay_window,  # noqa: ANN001
                                                            no_reference_prefill):
    """The kernel path on CPU tensors (the op's CPU executor): prefill through decode_step, and a
    second call starts again from empty caches and state."""
    from megakernel.serve.kernel_backend import Megakernel

    prompts = [[5, 17, 3], [7]]
    want = _reference_unpatched(model, prompts, 3, replay_window)
    cfg, w = load_model(model, seed=0)
    k = Megakernel(cfg, w, batch=2, max_seq_len=8, device="cpu", gpu="h100",
                   replay_window=replay_window)
    g = k.generate_program(prompts, 3)
    assert g.tokens == want and g.steps == {1: 5}
    assert k.generate(prompts, 3) == want


def test_megakernel_prefills_in_chunks_when_a_t_token_program_exists(no_reference_prefill):
    """The kernel path's chunked prefill: a sibling program for T = 4 runs the common prompt
    prefix (2 steps of 4 tokens for prompts of 9 and 11), the T = 1 program the rest; the tokens
    equal the reference's, and the same call from a second object (a fresh chunk program) too."""
    from megakernel.serve.kernel_backend import Megakernel

    prompts = [[5, 17, 3, 8, 1, 9, 2, 6, 4], [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    want = _reference_unpatched("llama-tiny", prompts, 3, None)
    cfg, w = load_model("llama-tiny", seed=0)
    k = Megakernel(cfg, w, batch=2, max_seq_len=24, device="cpu", gpu="h100")
    g = k.generate_program(prompts, 3, chunk_tokens=4)
    assert g.tokens == want and g.steps[4] == 2 and g.steps[1] == 11 - 8 + 2
    assert k.chunk_program(4) is not None and k.chunk_program(4).tokens == 4
    assert k.generate_program(prompts, 3, chunk_tokens=4).tokens == want  # from empty again


def test_buckets_padding_and_eos():
    """3 prompts run in the batch-4 bucket (the dummy row dropped); each prompt stops at its EOS
    (included), the others go on; a batch of 2 compiles its own bucket."""
    llm = mk.load("llama-tiny", backend="cpu-executor", max_batch=8, max_seq_len=32)
    prompts = [[5, 17, 3], [7, 1], [9, 2, 4, 4]]
    want = _reference_unpatched("llama-tiny", prompts, 6, None)
    eos = want[0][2]
    out = llm.generate(prompts, max_new_tokens=6, eos_token_id=eos)
    cut = [t[: t.index(eos) + 1] if eos in t else t for t in want]
    assert out.tokens == cut and cut[0] == want[0][:3]
    assert llm.generate(prompts[:2], max_new_tokens=6).tokens == want[:2]
    assert sorted(llm._programs) == [(2, 1), (4, 1)]
    assert [mk.serve.api.bucket(n, 6) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


def test_eos_ends_the_loop_early(executor_steps):  # noqa: ANN001
    llm = mk.load("llama-tiny", backend="cpu-executor", max_batch=1, max_seq_len=64)
    first = llm.generate([[5, 17]], max_new_tokens=1).tokens[0][0]
    executor_steps.clear()
    out = llm.generate([[5, 17]], max_new_tokens=40, eos_token_id=first)
    assert out.tokens == [[first]] and executor_steps == {1: 2}


@pytest.mark.parametrize("kwargs,prompts,error,match", [
    ({}, [[1] * 30], mk.GenerationError, "more than max_seq_len 32"),
    ({"max_batch": 2}, [[1], [2], [3]], mk.GenerationError, "exceed max_batch 2"),
    ({}, [[1], []], mk.GenerationError, "prompt 1 is empty"),
    ({}, [], mk.GenerationError, "non-empty list"),
    ({}, [[1, 512]], mk.GenerationError, r"token id 512 in prompt 0 is outside the vocabulary"),
    ({}, [[-1]], mk.GenerationError, r"token id -1 in prompt 0"),
    ({"backend": "tpu"}, None, mk.GenerationError, "unknown backend 'tpu'"),
    ({"backend": "kernel"}, None, KernelUnavailable, "needs an sm_90a"),
    ({}, ["text"], mk.GenerationError, "need a checkpoint with a tokenizer"),
])
def test_bad_input_raises_a_user_error_naming_it(kwargs, prompts, error, match):  # noqa: ANN001
    from megakernel.cli.main import _is_user_error

    with pytest.raises(error, match=match) as e:
        llm = mk.load("llama-tiny", **{"backend": "cpu-executor", "max_seq_len": 32, **kwargs})
        llm.generate(prompts, max_new_tokens=4)
    assert _is_user_error(e.value)
    assert issubclass(mk.GenerationError, ArgumentError)


def test_opcheck_decode_step_on_cpu_tensors():
    from megakernel.serve.kernel_backend import Megakernel

    cfg, w = load_model("llama-tiny", seed=0)
    k = Megakernel(cfg, w, batch=1, max_seq_len=4, device="cpu", gpu="h100")
    k.args.region("i32", "tokens_in").copy_(torch.tensor([5], dtype=torch.int32))
    args = k.op_args(True)
    torch.library.opcheck(torch.ops.megakernel.decode_step.default, args)


def test_import_is_light_registers_the_op_and_exports_the_api():
    from tests.runtime.test_runtime import NO_DSL

    code = (
        NO_DSL +
        "import megakernel as mk, torch\n"
        "torch.ops.megakernel.decode_step\n"
        "assert {'load', 'LLM', 'GenerationOutput', '__version__'} <= set(mk.__all__)\n"
        "assert 'megakernel.reference.model' not in sys.modules\n"
        "print(mk.__version__)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == re.search(r'^version = "([^"]+)"',
                                         (REPO / "pyproject.toml").read_text(), re.M).group(1)


def test_padding_rows_keep_the_chunked_prefill(monkeypatch):
    """3 long prompts in the batch-4 bucket: the padding row copies a real prompt, so the T = 4
    program still runs the common prefix (a one-token dummy row would cut it to nothing)."""
    import megakernel.serve.engine as engine

    runs = []
    real = engine.program_generate

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        g = real(*a, **k)
        runs.append(dict(g.steps))
        return g
    monkeypatch.setattr(engine, "program_generate", spy)
    prompts = [[5, 17, 3, 8, 1, 9, 2, 6, 4], [7, 1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 4, 4, 1, 2, 3,
                                                                          4, 5, 6]]
    llm = mk.load("llama-tiny", backend="cpu-executor", max_batch=4, max_seq_len=32)
    out = llm.generate(prompts, max_new_tokens=3)
    assert out.tokens == _reference_unpatched("llama-tiny", prompts, 3, None)
    assert runs and runs[0].get(4, 0) == 2, runs
