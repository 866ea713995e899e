"""`generate --speculative` and `plan --speculative`: the tokens are plain greedy decoding's on
every backend, the --json "speculative" object is the engine's count of accepted drafts, and bad
input is one `error:` line with exit status 2."""

from __future__ import annotations

import pytest

from megakernel.cli import main as cli
from megakernel.cli.plan import expected_tokens
from tests.cli.test_cli import last_json, run_cli

PROMPTS = "5,5,5,5,5,5;1,2,3,1,2,3,1"  # repetitive prompts: the n-gram drafter has matches
STEPS = "8"


def generate(capsys, *extra: str) -> dict:
    rc, out, err = run_cli(capsys, "generate", "--model", "llama-tiny", "--prompt-ids", PROMPTS,
                           "--steps", STEPS, "--json", *extra)
    assert rc == 0, err
    return last_json(out) | {"_text": out}


@pytest.fixture(scope="module")
def plain_tokens() -> list[list[int]]:
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.serve.executor_backend import generate as ex_generate

    cfg = preset("llama-tiny")
    return ex_generate(cfg, random_weights(cfg, seed=0, dtype=__import__("torch").bfloat16),
                       [[5] * 6, [1, 2, 3, 1, 2, 3, 1]], int(STEPS))


def test_ngram_on_the_executor_gives_plain_tokens_and_the_engines_stats(capsys, plain_tokens):
    """The speculative run's tokens are the plain run's; its "speculative" object is what the
    engine counted on the same programs (Generated.speculative_stats), and drafts were accepted
    (the prompts repeat), so speculation really ran."""
    import torch

    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.serve.backends import executor_speculative_generate
    from megakernel.serve.speculative import parse

    r = generate(capsys, "--backend", "cpu-executor", "--speculative", "ngram:3")
    assert r["tokens"] == plain_tokens
    s = r["speculative"]
    cfg = preset("llama-tiny")
    g = executor_speculative_generate(
        cfg, random_weights(cfg, seed=0, dtype=torch.bfloat16),
        [[5] * 6, [1, 2, 3, 1, 2, 3, 1]], int(STEPS), r["max_seq_len"], 0,
        speculative=parse("ngram:3"))
    assert s == g.speculative_stats("ngram", 3)
    acc = [a for step in g.accepted for a in step]
    assert s["steps"] == len(g.accepted) > 0 and s["k"] == 3 and s["method"] == "ngram"
    assert s["accepted_per_step"] == pytest.approx(sum(acc) / len(acc), abs=1e-4)
    assert s["accepted_per_step"] > 0
    assert s["tokens_per_step"] == pytest.approx(s["accepted_per_step"] + 1, abs=1e-4)
    assert r["max_seq_len"] == 7 + int(STEPS) + 3  # spec_max_seq_len: the last step's 1 + k
    assert "tokens per step and sequence" in r["_text"]


def test_plain_run_has_no_speculative_object(capsys, plain_tokens):
    r = generate(capsys, "--backend", "cpu-executor")
    assert r["tokens"] == plain_tokens and "speculative" not in r
    assert "tokens per step" not in r["_text"]


def test_reference_backend_speculates_with_the_same_tokens(capsys, plain_tokens):
    r = generate(capsys, "--backend", "reference", "--speculative", "ngram:2")
    assert r["tokens"] == plain_tokens
    assert r["speculative"]["k"] == 2 and r["speculative"]["steps"] > 0


def test_a_draft_model_equal_to_the_target_accepts_every_draft(capsys, plain_tokens):
    """draft:MODEL:K with the target itself as the draft model: every draft is the target's own
    greedy token, so each step accepts all K and emits K + 1 tokens (the stats are exact)."""
    r = generate(capsys, "--backend", "reference", "--speculative", "draft:llama-tiny:2")
    assert r["tokens"] == plain_tokens
    assert r["speculative"]["accepted_per_step"] == 2.0
    assert r["speculative"]["tokens_per_step"] == 3.0
    assert r["speculative"]["draft_model"] == "llama-tiny"


def test_recurrent_model_speculates_with_replay_window(capsys):
    base = ["generate", "--model", "qwen3.5-tiny", "--prompt-ids", "5,5,5,5,5;7,8,9",
            "--steps", "5", "--replay-window", "8", "--json"]
    rc, out, err = run_cli(capsys, *base, "--backend", "reference")  # plain, bf16
    assert rc == 0, err
    plain = last_json(out)["tokens"]
    rc, out, err = run_cli(capsys, *base, "--backend", "cpu-executor", "--speculative", "ngram:2")
    assert rc == 0, err
    assert last_json(out)["tokens"] == plain and last_json(out)["speculative"]["k"] == 2


@pytest.mark.parametrize("argv,needle", [
    (["--speculative", "eagle:3"], "unknown speculative method 'eagle'"),
    (["--speculative", "ngram:8"], "K must be in [1, 7]"),
    (["--speculative", "ngram:0"], "K must be in [1, 7]"),
    (["--speculative", "ngram"], "expected ngram:K"),
    (["--speculative", "draft:3"], "expected draft:MODEL:K"),
    (["--model", "qwen3.5-tiny", "--speculative", "ngram:3"], "pass --replay-window L"),
    (["--speculative", "ngram:3", "--max-seq-len", "10"],
     "plus --steps 4 and --speculative ngram:3 needs 12"),
    (["--speculative", "mtp:2"], "no MTP modules"),
    (["--speculative", "draft:qwen3.5-tiny:2"], "must share the target's tokenizer"),
    (["--backend", "kernel", "--speculative", "ngram:2"], "the kernel backend needs"),
])
def test_bad_speculative_input_is_one_error_line(capsys, argv, needle):
    rc, out, err = run_cli(capsys, "generate", "--steps", "4", "--prompt-ids", "5,17,3,101,42",
                           *argv)
    assert rc == 2
    assert err.startswith("error: ") and needle in err and "Traceback" not in err, err


# ---- plan --speculative --------------------------------------------------------------------------
def plan(capsys, *extra: str) -> dict:
    rc, out, err = run_cli(capsys, "plan", "--model", "llama-tiny", "--gpu", "h100", "--json",
                           *extra)
    assert rc == 0, err
    return last_json(out) | {"_text": out}


def test_plan_speculative_compares_the_1_plus_k_step_with_the_plain_one(capsys):
    plain = plan(capsys)
    r = plan(capsys, "--speculative", "ngram:3", "--acceptance", "0.5")
    s = r["speculative"]
    assert r["tokens"] == 4 and r["drafts"] == 3 and r["ngram"] == 3
    assert r["ops"].get("ACCEPT") == 1 and "ARGMAX" not in r["ops"] and "NGRAM" in r["ops"]
    assert s["plain_step_us"] == plain["predicted_step_us"]
    assert s["spec_step_us"] == r["predicted_step_us"] > s["plain_step_us"]
    assert s["step_ratio"] == pytest.approx(s["spec_step_us"] / s["plain_step_us"], rel=1e-3)
    assert s["tokens_per_step"] == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert s["tokens_per_s_per_user"] == pytest.approx(1.875e6 / s["spec_step_us"], rel=1e-3)
    assert s["plain_tokens_per_s_per_user"] == pytest.approx(1e6 / s["plain_step_us"], rel=1e-3)
    assert s["speedup"] == pytest.approx(1.875 / s["step_ratio"], rel=1e-3)
    assert not s["acceptance_assumed"]
    assert "speculative ngram:3: the 1 + 3 step" in r["_text"]
    assert "tokens/s per user" in r["_text"]


def test_plan_draft_model_adds_k_draft_steps(capsys):
    r = plan(capsys, "--speculative", "draft:qwen3-tiny:2", "--acceptance", "1")
    s = r["speculative"]
    draft = plan(capsys, "--model", "qwen3-tiny")  # the later --model wins
    assert s["draft_step_us"] == draft["predicted_step_us"]
    assert s["total_step_us"] == pytest.approx(s["spec_step_us"] + 2 * s["draft_step_us"],
                                               abs=0.02)
    assert s["tokens_per_step"] == 3.0
    assert s["tokens_per_s_per_user"] == pytest.approx(3e6 / s["total_step_us"], rel=1e-3)
    # the ratio is the target's own 1 + k step's; the speed-up counts the draft steps too
    assert s["step_ratio"] == pytest.approx(s["spec_step_us"] / s["plain_step_us"], rel=1e-3)
    assert s["speedup"] == pytest.approx(3 * s["plain_step_us"] / s["total_step_us"], rel=1e-3)
    assert r["ngram"] == 0  # host drafts


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(3, 0.0) == 1.0
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


@pytest.mark.parametrize("argv,needle", [
    (["--speculative", "ngram:3", "--acceptance", "1.5"], "a probability in [0, 1], got 1.5"),
    (["--speculative", "ngram:3", "--acceptance", "nan"], "a probability in [0, 1]"),
    (["--acceptance", "0.5"], "--acceptance needs --speculative"),
    (["--speculative", "ngram:3", "--tokens", "2"], "leave --tokens out"),
    (["--speculative", "ngram:9"], "K must be in [1, 7]"),
    (["--model", "qwen3.5-tiny", "--speculative", "ngram:3"], "pass --replay-window L"),
])
def test_plan_speculative_errors(capsys, argv, needle):
    rc = cli.main(["plan", "--model", "llama-tiny", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and needle in err, err


def test_mtp_checkpoint_drafts_on_the_reference_backend(capsys, tmp_path) -> None:
    """A checkpoint that carries an MTP module: `--speculative mtp:2` loads the module with the
    model and the reference backend decodes the plain greedy tokens (random weights: the drafts
    are seldom right, so acceptance is not the point)."""
    from megakernel.models.weights import random_weights, save_checkpoint
    from tests.reference.test_mtp import tiny

    cfg = tiny(1)
    save_checkpoint(cfg, random_weights(cfg, seed=0), tmp_path)
    args = ["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3,1,2", "--steps", "6",
            "--backend", "reference", "--replay-window", "4", "--json"]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0, err
    plain = last_json(out)["tokens"]
    rc, out, err = run_cli(capsys, *args, "--speculative", "mtp:2")
    assert rc == 0, err
    got = last_json(out)
    assert got["tokens"] == plain
    assert got["speculative"]["method"] == "mtp" and got["speculative"]["steps"] >= 1
