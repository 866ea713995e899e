"""Speculative steps on the CPU executor (layers/speculative.py): greedy speculative decoding emits
the plain greedy tokens, for every family (ReplaySSM for the recurrent ones), ragged batches,
scripted drafts that hit every accepted count and the device n-gram drafter; the KV cache and the
recurrent state after a speculative run equal a plain run's over the same tokens; planted bugs
in the accept/commit path are caught.

Where the two runs may differ: a speculative step replays 1 + k tokens from the committed state
and ring (and folds at other points) where the plain step replays one, so recurrent outputs and
states differ by fp32 summation order, which reaches the bf16 activations as at most a rounding
flip; the bands below are those of that rounding (measured: 0 on the dense model).
"""

from __future__ import annotations

import pytest
import torch

from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import PlanError, compile_program
from megakernel.program.pack import pack_weights
from megakernel.reference import ReferenceModel, SSMLayerCache
from megakernel.reference.layers.replay import effective_state
from megakernel.reference.speculative import accepted_count, ngram_propose
from megakernel.serve import engine
from megakernel.serve.executor_backend import (
    executor_gpu,
    executor_steppers,
    generate,
    speculative_stepper,
)

# (preset, ReplaySSM window): L = 4 folds every few steps
FAMILIES = [("llama-tiny", None), ("qwen3.5-tiny", 4), ("kimi-linear-tiny", 4),
            ("nemotron-h-tiny", 4)]
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1], [8, 2, 8, 2, 8, 2, 8], [5, 5, 5, 5, 5],
           [1, 4, 1, 4], [9, 9, 8, 7], [6, 5, 4, 3, 2, 1], [7, 7, 7]]
STEPS = 14


@pytest.fixture(scope="module")
def models() -> dict:
    return {name: (preset(name), random_weights(preset(name), seed=3)) for name, _ in FAMILIES}


class Script:
    """Host drafts from the plain run's tokens: sequence i at its g-th new token proposes the
    true continuation with the first wrong draft at a scheduled position, so that the step's
    accepted count is the schedule's (every count 0 .. k occurs)."""

    def __init__(self, prompts: list[list[int]], plain: list[list[int]], k: int, vocab: int
                 ) -> None:
        self.prompts, self.plain, self.k, self.vocab = prompts, plain, k, vocab
        self.schedule = [0, k, 1, k - 1, *range(k + 1)]
        self.calls = 0
        self.planned: list[list[int | None]] = []  # per call: per row, the count it aims at

    def __call__(self, hist: list[list[int]], k: int) -> list[list[int]]:
        out, plan = [], []
        for i, h in enumerate(hist):
            g = len(h) - len(self.prompts[i])  # new tokens so far; the next input is plain[g-1]
            truth = self.plain[i][g: g + k]
            a = self.schedule[(self.calls + i) % len(self.schedule)]
            plan.append(a if len(truth) == k else None)
            truth = truth + [0] * (k - len(truth))
            out.append([t if j < a else (t + 1) % self.vocab for j, t in enumerate(truth)])
        self.calls += 1
        self.planned.append(plan)
        return out


def spec_run(cfg, w, prompts, steps, window, k, drafts_fn=None, ngram=0,  # noqa: ANN001, ANN201
             check: bool = True, seed: int = 0):
    """(Generated, the speculative stepper) of one speculative generation on the executor
    (`check`: its race and write-count checks; `seed`: its SM interleavings)."""
    b = len(prompts)
    s_max = engine.spec_max_seq_len(max(map(len, prompts)), steps, k)

    def compile_fn(tokens: int, drafts: int = 0, ngram: int = 0):  # noqa: ANN202
        return compile_program(cfg, b, executor_gpu(), tokens=tokens, max_seq_len=s_max,
                               replay_window=window, drafts=drafts, ngram=ngram)

    packed = pack_weights(cfg, w)
    single, chunk = executor_steppers(cfg, packed, b, s_max, window, 2, check, seed, compile_fn)
    spec = speculative_stepper(single, packed, compile_fn, k, ngram, check=check, seed=seed + 7)
    g = engine.program_generate(single, prompts, steps, chunk=chunk, spec=spec,
                                drafts_fn=drafts_fn)
    return g, spec


def plain_tokens(cfg, w, prompts, steps, window) -> list[list[int]]:  # noqa: ANN001
    return generate(cfg, w, prompts, steps, replay_window=window, chunk_tokens=2)


def state_of(spec, cfg, w, window, row: int) -> tuple[torch.Tensor | None, dict]:  # noqa: ANN001
    """Sequence `row` of a stepper: (K/V cache up to its length, effective recurrent state per
    layer: the committed state with its committed ring entries folded in)."""
    ex, buf = spec.ex, spec.prog.buffers
    n = int(ex.lengths[row])
    kv = torch.cat((ex.k[:, row, :, :n].flatten(), ex.v[:, row, :, :n].flatten())) \
        if buf.kv_slot else None
    ref = ReferenceModel(cfg, w, replay_window=window)
    states = {}
    for layer, regs in buf.state.items():
        t = {name: ex.state_region(layer, name)[row: row + 1] for name in regs}
        ring = {name: v for name, v in t.items() if name not in ("conv", "state", "pending")}
        count = None
        if window:
            count = ex.region("i32", "ring_count")[buf.row("rec", layer), row: row + 1, 0].long()
        cache = SSMLayerCache(t["conv"], t["state"], ring, count)
        states[layer] = (t["conv"].clone(), effective_state(ref.cached[layer], cache)[0])
    return kv, states


def check_state_parity(cfg, w, window, spec, rows: list[int]) -> None:  # noqa: ANN001
    """Each row's cache and effective state after the speculative run equal a plain batch-1 run's
    over the same committed tokens (the device history)."""
    hist = spec.ex.region("i32", "history")
    for i in rows:
        n = int(spec.ex.lengths[i])
        tokens = hist[i, :n].tolist()
        _, plain = spec_run_plain(cfg, w, tokens, window)
        kv_s, st_s = state_of(spec, cfg, w, window, i)
        kv_p, st_p = state_of(plain, cfg, w, window, 0)
        if kv_s is not None:
            scale = kv_p.abs().max()
            assert (kv_s.float() - kv_p.float()).abs().max() <= 2**-7 * scale, f"KV of row {i}"
        for layer in st_p:
            for what, a, b in zip(("conv window", "state"), st_s[layer], st_p[layer],
                                  strict=True):
                err = (a - b).abs().max() / b.abs().max().clamp(min=1e-30)
                assert err <= 2**-7, f"row {i} layer {layer} {what}: rel err {float(err):.2e}"


def spec_run_plain(cfg, w, tokens: list[int], window):  # noqa: ANN001, ANN202
    """A batch-1 plain run (T = 1 program) that consumes `tokens` and stops: (Generated,
    stepper)."""
    def compile_fn(t: int, drafts: int = 0, ngram: int = 0):  # noqa: ANN202
        return compile_program(cfg, 1, executor_gpu(), tokens=t, max_seq_len=len(tokens) + 1,
                               replay_window=window)

    single, _ = executor_steppers(cfg, pack_weights(cfg, w), 1, len(tokens) + 1, window, 1,
                                  False, 0, compile_fn)
    return engine.program_generate(single, [tokens], 1), single


# ---- the accept arithmetic ------------------------------------------------------------------
def test_accepted_count_stops_at_the_first_wrong_draft() -> None:
    greedy = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [4, 6, 7], [5, 6, 7]])
    assert accepted_count(drafts, greedy).tolist() == [3, 1, 0, 0]


@pytest.mark.parametrize("hist,k,want", [
    ([1, 2, 3, 1, 2], 3, [3, 1, 2]),  # "1 2" seen at 0: continues 3, then repeats the period
    ([7], 2, [7, 7]),  # no earlier token: the last one
    ([4, 5, 6, 9], 2, [9, 9]),  # no match
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, [8, 1]),  # the most recent of two matches
    ([5, 1, 2, 3, 6, 2, 3, 7, 1, 2, 3], 1, [6]),  # the longest suffix wins over a later shorter
])
def test_ngram_proposals(hist: list[int], k: int, want: list[int]) -> None:
    assert ngram_propose(hist, k) == want


# ---- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,window", FAMILIES[:2])
def test_scripted_drafts_emit_the_plain_tokens(models: dict, name: str, window: int | None
                                               ) -> None:
    """B = 3 ragged, k = 3 (dense and Qwen3.5; every family and B, k in the slow lane)."""
    scripted_run(models, name, window, 3, 3)


@pytest.mark.parametrize("batch,k", [(1, 7), (3, 3), (8, 1)])
@pytest.mark.parametrize("name,window", FAMILIES)
def test_scripted_drafts_every_family(models: dict, name: str, window: int | None, batch: int,
                                      k: int) -> None:
    """Every family, B in {1, 3, 8} (ragged), k in {1, 3, 7}, other SM interleavings."""
    long_speculative_run(models, name, window, batch, k)


def long_speculative_run(models: dict, name: str, window: int | None, batch: int, k: int
                         ) -> None:
    scripted_run(models, name, window, batch, k, seed=batch * 10 + k, parity_rows=1)


def scripted_run(models: dict, name: str, window: int | None, batch: int, k: int,
                 seed: int = 0, parity_rows: int = 2) -> None:
    """Scripted drafts: every accepted count 0..k occurs; tokens equal the plain run's; each
    sequence's device history is its prompt and tokens; its cache and state equal a plain run's."""
    cfg, w = models[name]
    prompts = PROMPTS[:batch]
    script = Script(prompts, [], k, cfg.vocab_size)
    steps = sum(a + 1 for a in script.schedule) + 2  # sequence 0 runs the whole schedule
    script.plain = plain = plain_tokens(cfg, w, prompts, steps + k + 1, window)
    g, spec = spec_run(cfg, w, prompts, steps, window, k, drafts_fn=script, seed=seed)
    assert g.tokens == [p[:steps] for p in plain]
    seen = {a for step in g.accepted for a in step}
    assert seen == set(range(k + 1)), seen
    # the accepted counts are the script's wherever it knew the continuation
    live_plans = [[a for a in plan] for plan in script.planned]
    for step, (acc, plan) in enumerate(zip(g.accepted, live_plans, strict=False)):
        if len(acc) == len(plan) and None not in plan:
            assert acc == plan, (step, acc, plan)
    hist = spec.ex.region("i32", "history")
    for i, p in enumerate(prompts):
        known = min(int(spec.ex.lengths[i]) + 1, len(p) + len(plain[i]))
        assert hist[i, :known].tolist() == (p + plain[i])[:known]
    check_state_parity(cfg, w, window, spec, rows=list(range(min(batch, parity_rows))))


def test_ngram_drafter_emits_the_plain_tokens(models: dict) -> None:
    """The device n-gram drafter on the dense model, B = 3, k = 3."""
    ngram_run(models, "llama-tiny", None, 3)


@pytest.mark.parametrize("k", [7])  # k = 1: the scripted runs at B = 8
@pytest.mark.parametrize("name,window", FAMILIES)
def test_ngram_drafter_every_family(models: dict, name: str, window: int | None, k: int) -> None:
    long_speculative_ngram(models, name, window, k)


def long_speculative_ngram(models: dict, name: str, window: int | None, k: int) -> None:
    ngram_run(models, name, window, k)


def ngram_run(models: dict, name: str, window: int | None, k: int) -> None:
    """Plain greedy tokens with the device drafter, whose last drafts are the n-gram
    proposals of each sequence's history."""
    cfg, w = models[name]
    prompts = PROMPTS[2:5]
    plain = plain_tokens(cfg, w, prompts, STEPS, window)
    g, spec = spec_run(cfg, w, prompts, STEPS, window, k, ngram=3)
    assert g.tokens == plain
    toks, hist = spec.ex.region("i32", "tokens_in").view(3, 1 + k), spec.ex.region("i32",
                                                                                   "history")
    for i in range(3):
        n = int(spec.ex.lengths[i])
        assert toks[i, 1:].tolist() == ngram_propose(hist[i, : n + 1].tolist(), k)
        assert int(toks[i, 0]) == int(hist[i, n])  # the bonus is the next input


def test_speculation_on_the_recurrent_update_is_refused(models: dict) -> None:
    cfg, _ = models["qwen3.5-tiny"]
    with pytest.raises(PlanError, match="--replay-window"):
        compile_program(cfg, 1, executor_gpu(), drafts=3, max_seq_len=64)


@pytest.mark.parametrize("bad,why", [(dict(drafts=8), "1 to 7 drafts"),
                                     (dict(drafts=2, tokens=2), "runs 3 tokens"),
                                     (dict(ngram=3), "n-gram drafter needs")])
def test_bad_speculative_programs_are_refused(models: dict, bad: dict, why: str) -> None:
    cfg, _ = models["llama-tiny"]
    with pytest.raises(PlanError, match=why):
        compile_program(cfg, 1, executor_gpu(), max_seq_len=64, **bad)


# ---- planted bugs ------------------------------------------------------------------------------
def _plant(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    from megakernel.executor import core
    from megakernel.executor.ops import frame as frame_ops

    ops = core._load_ops()
    accept, orig_count = ops["ACCEPT"], frame_ops.accepted_count

    def accept_then(fix):  # noqa: ANN001, ANN202
        def run(ex, d, epoch):  # noqa: ANN001, ANN202
            before = ex.region("i32", "tokens_in").clone()
            accept(ex, d, epoch)
            fix(ex, before)
        return run

    if bug == "off-by-one accept":
        monkeypatch.setattr(frame_ops, "accepted_count", lambda dr, g: (
            orig_count(dr, g) + 1).clamp(max=dr.shape[1]))
    elif bug == "bonus dropped":
        def keep_old_input(ex, before) -> None:  # noqa: ANN001
            t = ex.prog.tokens
            ex.region("i32", "tokens_in")[::t] = before[::t]
        monkeypatch.setitem(ops, "ACCEPT", accept_then(keep_old_input))
    elif bug == "lengths += k + 1":
        def advance_all(ex, before) -> None:  # noqa: ANN001
            e = ex.region("i32", "emitted")
            ex.lengths[:] += torch.where(e > 0, ex.prog.tokens - e, 0).to(torch.int32)
        monkeypatch.setitem(ops, "ACCEPT", accept_then(advance_all))
    elif bug == "ring committed past the accepted entries":
        for name in ("GDN_COMMIT", "KDA_COMMIT", "MAMBA_COMMIT"):
            commit = ops[name]

            def past(ex, d, epoch, commit=commit) -> None:  # noqa: ANN001
                e = ex.region("i32", "emitted")
                old = e.clone()
                e.copy_(torch.clamp(old + 1, max=ex.prog.tokens))
                commit(ex, d, epoch)
                e.copy_(old)
            monkeypatch.setitem(ops, name, past)


@pytest.mark.parametrize("bug", ["off-by-one accept", "bonus dropped", "lengths += k + 1",
                                 "ring committed past the accepted entries"])
def test_planted_bugs_are_caught(models: dict, monkeypatch: pytest.MonkeyPatch, bug: str
                                 ) -> None:
    """Each planted bug breaks the tokens or the state parity (the executor's own write-count
    checks off: these tests must see it themselves)."""
    long_speculative_bug(models, monkeypatch, bug)


def long_speculative_bug(models: dict, monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    name, window = ("qwen3.5-tiny", 4)
    cfg, w = models[name]
    prompts, k = PROMPTS[2:5], 3
    plain = plain_tokens(cfg, w, prompts, STEPS, window)
    _plant(monkeypatch, bug)
    try:
        g, spec = spec_run(cfg, w, prompts, STEPS, window, k, ngram=3, check=False)
        assert g.tokens == plain
        check_state_parity(cfg, w, window, spec, rows=[0, 1, 2])
    except (AssertionError, ValueError, RuntimeError) as e:  # caught: the bug shows
        print(f"{bug}: caught ({type(e).__name__}: {str(e)[:80]})")
        return
    pytest.fail(f"planted bug {bug!r} went unnoticed")
