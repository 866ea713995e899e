"""Host drafters for speculative decoding (megakernel/serve/drafters.py): a draft model on the CPU
executor and on the reference, the MTP adapter, the method-string factory and the cost view.

The strongest checks: a draft model that IS the target (same weights) has every draft accepted,
and a drafter's drafts after any sequence of histories (growing, diverging, shrinking) are the
draft model's own greedy continuation of the last history, which holds only if its cache is
rewound to exactly the common prefix and caught up on exactly the new tokens. Speculative
generation equal to plain greedy holds for any drafts (the target verifies), so it is checked too
but proves little about the drafter alone.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.cost import CostParams
from megakernel.program.pack import pack_weights
from megakernel.reference import speculative as ref_spec
from megakernel.reference.model import ReferenceModel
from megakernel.reference.model import generate as greedy_generate
from megakernel.reference.mtp import MtpDrafter
from megakernel.serve.drafters import (
    DraftCost,
    ExecutorDrafter,
    MtpDrafts,
    ReferenceDrafter,
    check_draft_model,
    draft_step_cost,
    make,
    reference_hidden,
)
from megakernel.serve.engine import Generated, program_generate, spec_max_seq_len
from megakernel.serve.executor_backend import (
    executor_gpu,
    executor_steppers,
    generate,
    speculative_stepper,
)
from megakernel.serve.speculative import SpeculativeError

PROMPTS = [[5, 9, 200, 3, 77, 1, 42], [31, 8, 8]]  # ragged: chunk and T = 1 catch-up
STEPS, K = 14, 3


@pytest.fixture(scope="module")
def target():  # noqa: ANN201
    cfg = preset("llama-tiny")
    return cfg, random_weights(cfg, seed=0)


@pytest.fixture(scope="module")
def small(target):  # noqa: ANN001, ANN201
    """A smaller llama-style draft model with the target's vocabulary, other weights."""
    cfg = target[0].replace(num_layers=1, intermediate_size=256, name="llama-draft")
    return cfg, random_weights(cfg, seed=7)


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:  # noqa: ANN001
    return generate(*target, PROMPTS, STEPS)


def speculative_run(cfg, weights, drafts_fn, k: int = K, prompts=PROMPTS,  # noqa: ANN001
                    steps: int = STEPS) -> Generated:
    """executor_backend.generate's speculative path, returning the engine's Generated (accepted)."""
    msl = spec_max_seq_len(max(len(p) for p in prompts), steps, k)
    packed = pack_weights(cfg, weights)

    def compile_fn(tokens: int, drafts: int = 0, ngram: int = 0):  # noqa: ANN202
        return compile_program(cfg, len(prompts), executor_gpu(), tokens=tokens,
                               max_seq_len=msl, drafts=drafts, ngram=ngram)

    single, chunk = executor_steppers(cfg, packed, len(prompts), msl, None, 2, True, 0,
                                      compile_fn)
    spec = speculative_stepper(single, packed, compile_fn, k, 0, True, 0)
    return program_generate(single, prompts, steps, chunk=chunk, spec=spec, drafts_fn=drafts_fn)


# ---- draft model on the CPU executor ---------------------------------------------------------
def test_self_draft_accepts_every_draft(target, plain) -> None:  # noqa: ANN001
    cfg, w = target
    msl = spec_max_seq_len(max(len(p) for p in PROMPTS), STEPS, K)
    d = ExecutorDrafter(cfg, w, len(PROMPTS), msl, check=True)
    rewound: list[int] = []  # after each call

    def drafts_fn(hs: list[list[int]], k: int) -> list[list[int]]:
        out = d(hs, k)
        rewound.append(d.rewound)
        return out

    got = speculative_run(cfg, w, drafts_fn)
    assert got.tokens == plain
    n = len(got.accepted)
    assert n >= 3 and len(rewound) >= n
    for step in got.accepted[:-1]:  # the last step may be cut short by the cache's end
        assert step == [K] * len(step), got.accepted
    assert rewound[:n] == [0] * n  # every draft accepted: nothing to rewind until then


def test_small_draft_model_equals_greedy_and_rewinds(target, small, plain) -> None:  # noqa: ANN001
    cfg, w = target
    msl = spec_max_seq_len(max(len(p) for p in PROMPTS), STEPS, K)
    d = ExecutorDrafter(*small, len(PROMPTS), msl, check=True, target_cfg=cfg)
    got = speculative_run(cfg, w, d)
    assert got.tokens == plain
    assert d.rewound > 0  # rejected drafts were rewound
    assert any(a < K for step in got.accepted for a in step)
    # and through executor_backend.generate, as `generate --speculative draft:...` runs it
    assert generate(cfg, w, PROMPTS, STEPS, drafts=K, drafts_fn=d) == plain


def test_drafts_are_the_draft_models_greedy_continuation(target) -> None:  # noqa: ANN001
    """One drafter through histories that grow (a bonus, all drafts), diverge mid-sequence and
    shrink: its drafts must be the model's greedy continuation of each history, which is what
    plain generation from that history as a prompt computes."""
    cfg, w = target
    base = [[5, 9, 200, 3, 77, 1, 42, 17, 300], [31, 8, 8, 64, 2]]
    d = ExecutorDrafter(cfg, w, 2, 40, check=True)
    calls = [
        [base[0][:5], base[1][:3]],
        [base[0][:6], base[1][:5]],  # one and two new tokens
        None,  # the row's own drafts accepted and a bonus (filled in below)
        [base[0][:4] + [11, 12], base[1][:2] + [99, 98, 97, 96, 95]],  # diverged: rewind
        [base[0][:3], base[1][:2] + [99, 98]],  # shrunk
    ]
    prev: list[list[int]] = []
    last: list[list[int]] = []
    for hs in calls:
        if hs is None:
            hs = [h + dr + [dr[0]] for h, dr in zip(prev, last, strict=True)]
        want = generate(cfg, w, hs, K)
        last, prev = d(hs, K), hs
        assert last == want, hs
    assert d.rewound > 0


def test_rows_that_do_not_fit_get_placeholder_drafts(target) -> None:  # noqa: ANN001
    cfg, w = target
    d = ExecutorDrafter(cfg, w, 2, 12, chunk=1)
    hs = [[1, 2, 3], list(range(1, 12))]  # row 1: 11 tokens + 3 drafts > 12 positions
    got = d(hs, 3)
    assert got[0] == generate(cfg, w, hs[:1], 3)[0]
    assert got[1] == [11, 11, 11]


# ---- draft model on the reference --------------------------------------------------------------
def test_reference_drafter_self_and_small(target, small) -> None:  # noqa: ANN001
    cfg, w = target
    model = ReferenceModel(cfg, w, mode="bf16")
    want = greedy_generate(model, PROMPTS, STEPS)
    msl = max(len(p) for p in PROMPTS) + STEPS + K
    d = ReferenceDrafter(cfg, w, len(PROMPTS), msl)
    got, acc = ref_spec.generate(model, PROMPTS, STEPS, K, drafts_fn=d)
    assert got == want
    assert all(a == [K] * len(PROMPTS) for a in acc[:-1]) and d.rewound == 0
    d2 = ReferenceDrafter(*small, len(PROMPTS), msl, target_cfg=cfg)
    got2, acc2 = ref_spec.generate(model, PROMPTS, STEPS, K, drafts_fn=d2)
    assert got2 == want and d2.rewound > 0


# ---- refusals -----------------------------------------------------------------------------------
def test_refuses_other_vocab_and_recurrent_draft_models(target) -> None:  # noqa: ANN001
    cfg, _ = target
    other = cfg.replace(vocab_size=256)
    with pytest.raises(SpeculativeError, match="vocabulary of 256 tokens.*tokenizer"):
        check_draft_model(cfg, other)
    hybrid = preset("qwen3.5-tiny")
    with pytest.raises(SpeculativeError, match=r"recurrent layers \(gdn\).*ReplaySSM"):
        check_draft_model(hybrid, hybrid)
    with pytest.raises(SpeculativeError, match="recurrent layers"):
        make("draft:qwen3.5-tiny:2", hybrid, {}, 1, 32)
    with pytest.raises(SpeculativeError, match="vocabulary"):
        make("draft:qwen3.5-attn-tiny:2", cfg, {}, 1, 32)


def test_drafter_input_errors(target) -> None:  # noqa: ANN001
    cfg, w = target
    d = ExecutorDrafter(cfg, w, 2, 32, chunk=1)
    with pytest.raises(SpeculativeError, match="1 histories for a drafter of batch 2"):
        d([[1, 2]], 2)
    with pytest.raises(SpeculativeError, match="history 1 is empty"):
        d([[1, 2], []], 2)
    with pytest.raises(SpeculativeError, match=r"token id 512 is outside \[0, 512\)"):
        d([[1, 2], [512]], 2)
    with pytest.raises(SpeculativeError, match="k must be >= 1"):
        d([[1, 2], [3]], 0)


# ---- the factory ---------------------------------------------------------------------------------
def test_make(target) -> None:  # noqa: ANN001
    cfg, w = target
    assert make(None, cfg, w, 2, 32) is None
    assert make("ngram:3", cfg, w, 2, 32) is None
    d = make("draft:llama-tiny:3", cfg, w, 2, 32, chunk=1)  # the preset's seed-0 weights: w
    assert isinstance(d, ExecutorDrafter) and d.single.prog.max_seq_len == 32
    hs = [[5, 9, 200], [31, 8]]
    assert d(hs, 3) == generate(cfg, w, hs, 3)
    r = make("draft:llama-tiny:3", cfg, w, 2, 32, backend="reference")
    assert isinstance(r, ReferenceDrafter) and r(hs, 3) == d(hs, 3)
    with pytest.raises(SpeculativeError, match="host drafters run on"):
        make("draft:llama-tiny:3", cfg, w, 2, 32, backend="kernel")
    with pytest.raises(SpeculativeError, match="no MTP modules"):
        make("mtp:2", cfg, w, 2, 32)


# ---- MTP ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_model() -> ReferenceModel:
    cfg = preset("qwen3.5-attn-tiny").replace(mtp_layers=1)
    return ReferenceModel(cfg, random_weights(cfg, seed=3, dtype=torch.float32), mode="fp32")


def _fresh_mtp(model: ReferenceModel, history: list[int], k: int) -> list[int]:
    """MtpDrafter's drafts from scratch: the history's inputs prefilled, its last token the
    bonus."""
    fresh = MtpDrafter(model, 1, 64, k)
    h = reference_hidden(model)(0, history[:-1], 0)
    fresh.prefill([history[:-1]], [h])
    return fresh.propose([[]], [h[:0]], [history[-1]])[0]


def test_mtp_adapter_equals_greedy_and_the_drafter_from_scratch(mtp_model) -> None:  # noqa: ANN001
    prompts, steps, k = [[5, 9, 200, 3, 77], [31, 8]], 10, 2
    want = greedy_generate(mtp_model, prompts, steps)
    seen: list[list[list[int]]] = []
    adapter = make("mtp:2", mtp_model.cfg, {}, 2, 64, backend="reference", model=mtp_model)
    assert isinstance(adapter, MtpDrafts)

    def drafts_fn(hs: list[list[int]], kk: int) -> list[list[int]]:
        out = adapter(hs, kk)
        seen.append([list(h) for h in hs] + out)
        return out

    got, acc = ref_spec.generate(mtp_model, prompts, steps, k, drafts_fn=drafts_fn)
    assert got == want and len(seen) == len(acc)
    for rec in seen:
        for b in range(2):
            assert rec[2 + b] == _fresh_mtp(mtp_model, rec[b], k), rec[b]


def test_mtp_adapter_errors(mtp_model, target) -> None:  # noqa: ANN001
    a = MtpDrafts(mtp_model, 1, 64, 2, reference_hidden(mtp_model))
    with pytest.raises(SpeculativeError, match="chains 2 drafts, asked for 3"):
        a([[1, 2]], 3)
    a([[1, 2, 3]], 2)
    with pytest.raises(SpeculativeError, match="does not extend the previous one"):
        a([[1, 4, 3, 5]], 2)


def test_mtp_on_the_executor_reads_the_programs_hidden_states(mtp_model) -> None:  # noqa: ANN001
    """mtp:K on the CPU executor: the drafter's hidden states are the program's own (the
    engine's HiddenLog of f32 h after every step), equal to the reference's recomputed ones up
    to the bf16 mirror's rounding; the tokens are plain greedy's."""
    from megakernel.serve.backends import executor_speculative_generate
    from megakernel.serve.speculative import parse

    cfg = mtp_model.cfg
    w = {n: t.to(torch.bfloat16) for n, t in mtp_model.w.items()}
    prompts, steps, k = [[5, 9, 200, 3, 77], [31, 8, 31]], 8, 2
    s_max = spec_max_seq_len(5, steps, k)
    plain = generate(cfg, w, prompts, steps)
    d = make("mtp:2", cfg, w, 2, s_max, backend="cpu-executor")
    assert d.hidden_log is not None
    g = executor_speculative_generate(cfg, w, prompts, steps, s_max, 0, speculative=parse("mtp:2"),
                                      drafts_fn=d)
    assert g.tokens == plain and len(g.accepted) >= 1
    ref = reference_hidden(ReferenceModel(cfg, w, mode="bf16"))
    for b, p in enumerate(prompts):
        n = len(p) + 3  # positions every run consumed
        mine = d.hidden_log.hook(b, (p + plain[b])[:n], 0)
        want = ref(b, (p + plain[b])[:n], 0)
        err = float((mine - want).abs().max() / want.abs().max())
        assert err < 2**-6, err


# ---- cost ----------------------------------------------------------------------------------------
def test_draft_step_cost(target, small) -> None:  # noqa: ANN001
    c = draft_step_cost(target[0], small[0], 3, 1, "h200", max_seq_len=256, context=128)
    assert isinstance(c, DraftCost) and c.launch_s == CostParams().launch
    from megakernel.program.gpus import gpu

    def pred(cfg, **kw) -> float:  # noqa: ANN001, ANN003
        return compile_program(cfg, 1, gpu("h200"), max_seq_len=256, context=128,
                               **kw).cost.predicted_s

    assert c.draft_step_s == pytest.approx(pred(small[0]))
    assert c.verify_s == pytest.approx(pred(target[0], drafts=3))
    assert c.plain_s == pytest.approx(pred(target[0]))
    assert c.total_s == pytest.approx(3 * c.draft_step_s + c.verify_s)
    assert c.fused_s == pytest.approx(c.total_s - 3 * c.launch_s)
    assert c.tokens_per_step(1.0) == 4 and c.tokens_per_step(0.0) == 1
    assert c.speedup(0.0) == pytest.approx(c.plain_s / c.total_s)
    b = c.breakeven()
    assert b is None or c.speedup(b) == pytest.approx(1.0, abs=1e-6)
