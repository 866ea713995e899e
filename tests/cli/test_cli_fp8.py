"""FP8 weights through what a user calls: `generate --weights fp8` (reference and CPU executor
agree token for token, and differ from the bf16 model), `plan --weights fp8` (half the block
bytes), an FP8 checkpoint directory loading as FP8 without the flag, the API's
`load(weights="fp8")`, and the flags' misuse named."""

from __future__ import annotations

import json

import pytest

import megakernel as mk
from megakernel.cli import main as cli
from megakernel.common.errors import ConfigError
from megakernel.models import fp8, preset
from megakernel.models.weights import random_weights, save_checkpoint

PROMPTS = "5,17,3,101;7,1"


def _run(capsys, *argv: str) -> tuple[int, dict, str]:  # noqa: ANN001
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, (json.loads(out.strip().splitlines()[-1]) if rc == 0 else {}), err


@pytest.mark.parametrize("model, extra", [("llama-tiny", ()), ("qwen3.5-tiny", ("--fp8-granularity",
                                                                               "block"))])
def test_generate_fp8_executor_matches_reference(capsys, model, extra):
    base = ("generate", "--model", model, "--prompt-ids", PROMPTS, "--steps", "5", "--json")
    rc, ref8, err = _run(capsys, *base, "--weights", "fp8", *extra)
    assert rc == 0, err
    rc, ex8, err = _run(capsys, *base, "--weights", "fp8", *extra, "--backend", "cpu-executor")
    assert rc == 0, err
    assert ex8["tokens"] == ref8["tokens"]
    assert ref8["weights"].startswith("fp8 e4m3")
    rc, bf, _ = _run(capsys, *base)
    assert bf["weights"] == "bf16"


def test_plan_fp8_streams_about_half_the_block_bytes(capsys):
    """The weights' bytes; whether the step is faster is the benchmark's (bench/plan.py --weights)
    question, not a test's."""
    base = ("plan", "--model", "llama-mid", "--json")
    rc, r16, err = _run(capsys, *base)
    assert rc == 0, err
    rc, r8, err = _run(capsys, *base, "--weights", "fp8")
    assert rc == 0, err
    head = 2 * preset("llama-mid").vocab_size * preset("llama-mid").hidden_size  # tied: bf16
    blocks16, blocks8 = r16["weight_bytes"] - head, r8["weight_bytes"] - head
    assert 0.5 < blocks8 / blocks16 < 0.51, (blocks8, blocks16)
    assert "per output channel" in r8["weights"] and r16["weights"] == "bf16"


@pytest.mark.parametrize("model, granularity, says", [
    ("llama-tiny", "block", "128x128 block"),  # transformers' "fp8" form (weight_scale_inv)
    ("qwen3.5-tiny", "channel", "per output channel"),  # compressed-tensors (weight_scale)
])
def test_fp8_checkpoint_loads_as_fp8_without_the_flag(capsys, tmp_path, model, granularity,
                                                      says):
    cfg = preset(model).replace(quant=fp8.Fp8Format(granularity))
    save_checkpoint(cfg, fp8.QuantizedWeights(cfg, random_weights(preset(model), seed=2)),
                    tmp_path / "ck")
    base = ("generate", "--model", str(tmp_path / "ck"), "--prompt-ids", PROMPTS, "--steps", "4",
            "--json")
    rc, ref, err = _run(capsys, *base)
    assert rc == 0, err
    assert says in ref["weights"]
    rc, ex, err = _run(capsys, *base, "--backend", "cpu-executor")
    assert rc == 0, err
    assert ex["tokens"] == ref["tokens"]


@pytest.mark.parametrize("argv, match", [
    (("--fp8-granularity", "block"), "apply with --weights fp8"),
    (("--fp8-lm-head",), "apply with --weights fp8"),
    (("--weights", "fp4"), "invalid choice"),
])
def test_flag_misuse_is_named(capsys, argv, match):
    try:
        rc = cli.main(["generate", "--model", "llama-tiny", "--prompt-ids", "1,2", *argv])
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and match in err, err


def test_api_load_fp8_matches_the_fp8_reference():
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as ref_generate

    llm = mk.load("qwen3-tiny", backend="cpu-executor", weights="fp8", max_batch=2,
                  max_seq_len=32)
    assert llm.cfg.quant == fp8.Fp8Format()
    prompts = [[5, 17, 3], [7, 1, 30, 4]]
    got = llm.generate(prompts, max_new_tokens=4).tokens
    want = ref_generate(ReferenceModel(llm.cfg, llm.weights, mode="bf16"), prompts, 4)
    assert got == want
    with pytest.raises(ConfigError, match="apply with weights='fp8'"):
        mk.load("qwen3-tiny", fp8_granularity="block")


@pytest.mark.parametrize("model, granularity", [("llama-tiny", "channel"),
                                                ("qwen3.5-tiny", "block")])
def test_the_op_runs_an_fp8_model(model, granularity):
    """The kernel path on CPU tensors (torch.ops.megakernel.decode_step served by the CPU
    executor): the FP8 program's tokens are the FP8 reference's, and the launch checks accept
    the FP8 records against the FP8 build's spec."""
    from megakernel.models.sources import load_model
    from megakernel.reference.model import ReferenceModel
    from megakernel.reference.model import generate as ref_generate
    from megakernel.serve.kernel_backend import Megakernel

    cfg, w = load_model(model, seed=0, weights="fp8", granularity=granularity)
    prompts = [[5, 17, 3], [7]]
    want = ref_generate(ReferenceModel(cfg, w, mode="bf16"), prompts, 3)
    k = Megakernel(cfg, w, batch=2, max_seq_len=8, device="cpu", gpu="h100")
    assert k.generate(prompts, 3) == want
