"""mk.load(..., speculative=): the same tokens as plain decoding on every backend, the accepted
drafts in `out.speculative`, the speculative program really stepped, and bad input refused by
name."""

from __future__ import annotations

import pytest
import torch

import megakernel as mk
from megakernel.common.errors import UserError
from megakernel.serve.speculative import SpeculativeError

PROMPTS = [[5, 5, 5, 5, 5, 5], [1, 2, 3, 1, 2, 3, 1], [7, 8, 9]]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = mk.load("llama-tiny", backend="reference", max_batch=4, max_seq_len=64)
    return llm.generate(PROMPTS, max_new_tokens=8).tokens


@pytest.mark.parametrize("backend", ["cpu-executor", "reference"])
def test_ngram_gives_plain_tokens_and_stats(plain, backend, executor_steps):
    llm = mk.load("llama-tiny", backend=backend, max_batch=4, max_seq_len=64,
                  speculative="ngram:3")
    assert llm.speculative.k == 3
    out = llm.generate(PROMPTS, max_new_tokens=8)
    assert out.tokens == plain
    s = out.speculative
    assert s["method"] == "ngram" and s["k"] == 3 and s["steps"] > 0
    assert s["tokens_per_step"] == pytest.approx(s["accepted_per_step"] + 1)
    assert s["accepted_per_step"] > 0  # the repetitive prompts' drafts are accepted
    if backend == "cpu-executor":  # the 1 + 3 program ran as many steps as the stats say
        assert executor_steps[4] == s["steps"]


def test_plain_load_has_no_speculative_stats(plain, executor_steps):
    out = mk.load("llama-tiny", backend="cpu-executor", max_batch=4,
                  max_seq_len=64).generate(PROMPTS, max_new_tokens=8)
    assert out.tokens == plain and out.speculative is None
    assert 4 not in executor_steps  # only the T = 1 program and the prefill's T = 4 chunk...
    assert executor_steps[1] > 0


def test_eos_stops_a_speculative_row(plain):
    eos = plain[1][3]
    out = mk.load("llama-tiny", backend="cpu-executor", max_batch=4, max_seq_len=64,
                  speculative="ngram:2").generate(PROMPTS, max_new_tokens=8, eos_token_id=eos)
    for got, want in zip(out.tokens, plain, strict=True):
        cut = want.index(eos) + 1 if eos in want else len(want)
        assert got == want[:cut]


def test_draft_model_through_the_api(plain):
    out = mk.load("llama-tiny", backend="cpu-executor", max_batch=4, max_seq_len=64,
                  speculative="draft:llama-tiny:2").generate(PROMPTS, max_new_tokens=8)
    assert out.tokens == plain
    assert out.speculative["draft_model"] == "llama-tiny"
    assert out.speculative["accepted_per_step"] > 1.5  # itself as the draft: nearly all


def test_recurrent_model_with_replay_window():
    kw = dict(backend="cpu-executor", max_batch=2, max_seq_len=32, replay_window=8)
    ids = [[5, 5, 5, 5, 5], [7, 8, 9]]
    plain = mk.load("qwen3.5-tiny", **kw).generate(ids, max_new_tokens=5).tokens
    out = mk.load("qwen3.5-tiny", speculative="ngram:2", **kw).generate(ids, max_new_tokens=5)
    assert out.tokens == plain and out.speculative["k"] == 2


def test_the_op_path_on_cpu_speculates_with_plain_tokens(plain):
    """Megakernel on device="cpu": the speculative program steps through
    torch.ops.megakernel.speculative_step (the op's CPU executor)."""
    from megakernel.models import preset
    from megakernel.models.weights import random_weights
    from megakernel.serve.kernel_backend import Megakernel
    from megakernel.serve.speculative import parse

    cfg = preset("llama-tiny")
    k = Megakernel(cfg, random_weights(cfg, seed=0, dtype=torch.bfloat16), batch=1,
                   max_seq_len=20, device="cpu", gpu="h100")
    g = k.generate_program(PROMPTS[:1], 6, speculative=parse("ngram:3"))
    assert g.tokens == [plain[0][:6]] and g.steps[4] == len(g.accepted) > 0
    assert sum(a for step in g.accepted for a in step) > 0


@pytest.mark.parametrize("kw,err,needle", [
    (dict(speculative="ngram:8"), SpeculativeError, "K must be in [1, 7]"),
    (dict(speculative="lookahead:2"), SpeculativeError, "unknown speculative method"),
    (dict(speculative=3), SpeculativeError, "must be a string"),
    (dict(backend="kernel", speculative="draft:llama-tiny:2"), SpeculativeError,
     "drafts on the host"),
])
def test_bad_speculative_load_is_a_user_error(kw, err, needle):
    with pytest.raises(err, match=needle.replace("[", r"\[").replace("]", r"\]")):
        mk.load("llama-tiny", **{"backend": "cpu-executor", "max_seq_len": 64, **kw})
    assert issubclass(err, UserError)


def test_recurrent_without_replay_window_names_the_keyword():
    with pytest.raises(SpeculativeError, match="pass replay_window=L"):
        mk.load("qwen3.5-tiny", backend="cpu-executor", speculative="ngram:3", max_seq_len=64)


def test_max_seq_len_counts_the_last_steps_drafts():
    llm = mk.load("llama-tiny", backend="cpu-executor", max_seq_len=16, speculative="ngram:3")
    with pytest.raises(mk.GenerationError, match="and speculative ngram:3 needs 17 positions"):
        llm.generate([[1, 2, 3, 4, 5, 6]], max_new_tokens=8)


def test_auto_takes_the_executor_for_host_drafts(capsys):
    llm = mk.load("llama-tiny", backend="auto", speculative="draft:llama-tiny:2",
                  max_seq_len=64)
    assert llm.backend == "cpu-executor"
