"""ReplaySSM against the recurrent update, for GDN (Qwen3.5), KDA (Kimi) and Mamba2 (Nemotron-H).

- window L = 1 reproduces the recurrent model bit for bit (logits, states, conv windows);
- L in {4, 16}: logits within fp32 rounding over >= 3 folds, and the committed state right after
  each fold equals the recurrent state (state parity, not only outputs);
- speculative steps: verify(1 + k) then commit(a) equals a + 1 single steps, in logits and state,
  with random accept counts and commits that cross fold boundaries;
- bad use gets a clear error.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.models import preset
from megakernel.models.sources import load_model
from megakernel.models.weights import random_weights
from megakernel.reference import ReferenceError, ReferenceModel, generate
from megakernel.reference.layers.replay import (
    delta_rule_fold,
    delta_rule_replay,
    ssd_fold,
    ssd_replay,
)
from tests.registries import HYBRID_TINY

FAMILIES = HYBRID_TINY  # the tiny preset of every hybrid family


def setup(name: str, seed: int, steps: int):
    cfg = preset(name)
    weights = random_weights(cfg, seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 4)]
    tokens = torch.randint(0, cfg.vocab_size, (2, steps), generator=g)
    return cfg, weights, prompts, tokens


@torch.no_grad()
def single_steps(model, prompts, tokens):
    """Logits [B, 1 + S, V], and after every step: committed states, effective states, convs."""
    cache = model.new_cache(len(prompts), 128)
    logits = [model.prefill(cache, prompts)]
    trace = []
    layers = model.cfg.recurrent_layers()
    for s in range(tokens.shape[1]):
        logits.append(model.decode(cache, tokens[:, s : s + 1])[:, 0])
        trace.append({i: (cache.layers[i].state.clone(), model.recurrent_state(cache, i),
                          cache.layers[i].conv.clone()) for i in layers})
    return torch.stack(logits, dim=1), trace


@pytest.mark.parametrize("name", FAMILIES)
def test_window_one_is_bitwise_recurrent(name: str) -> None:
    cfg, weights, prompts, tokens = setup(name, seed=31, steps=12)
    ref_logits, ref = single_steps(ReferenceModel(cfg, weights), prompts, tokens)
    logits, rep = single_steps(ReferenceModel(cfg, weights, replay_window=1), prompts, tokens)
    assert torch.equal(logits, ref_logits)
    for s in range(tokens.shape[1]):
        for i, (state, _, conv) in ref[s].items():
            assert torch.equal(rep[s][i][0], state), (s, i)  # folded every token
            assert torch.equal(rep[s][i][2], conv), (s, i)


@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("name", FAMILIES)
def test_window_matches_recurrent_across_folds(name: str, window: int, record_numerics) -> None:
    steps = 3 * 16 + 2  # three folds at L = 16, twelve at L = 4
    cfg, weights, prompts, tokens = setup(name, seed=41, steps=steps)
    ref_logits, ref = single_steps(ReferenceModel(cfg, weights), prompts, tokens)
    model = ReferenceModel(cfg, weights, replay_window=window)
    logits, rep = single_steps(model, prompts, tokens)
    assert not torch.equal(logits, ref_logits)  # replay really ran (different rounding)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    folds, worst = 0, 0.0
    for s in range(steps):
        for i, (state, _, conv) in ref[s].items():
            committed, effective, rep_conv = rep[s][i]
            scale = float(state.abs().max())
            assert scale > 1e-2
            # between folds the effective state (S_c plus the ring) is the recurrent state
            torch.testing.assert_close(effective, state, rtol=1e-4, atol=1e-5 * scale)
            # the conv window holds the same inputs (the earlier layers differ by rounding only)
            torch.testing.assert_close(rep_conv, conv, rtol=1e-4,
                                       atol=1e-5 * float(conv.abs().max()))
            if (s + 1) % window == 0:  # a fold just ran: the committed state itself
                torch.testing.assert_close(committed, state, rtol=1e-4, atol=1e-5 * scale)
                worst = max(worst, float((committed - state).abs().max()) / scale)
                folds += 1
            else:  # S_c is not written between folds
                assert torch.equal(committed, rep[s - 1][i][0]) if s else True
    assert folds >= 3 * len(cfg.recurrent_layers())
    record_numerics(f"replay {name} L={window} vs recurrent",
                    f"logits max abs err {float((logits - ref_logits).abs().max()):.1e}, "
                    f"state after fold max rel err {worst:.1e}")


@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_commit_equals_single_steps(name: str, record_numerics) -> None:
    window = 4
    cfg, weights, prompts, _ = setup(name, seed=51, steps=1)
    spec = ReferenceModel(cfg, weights, replay_window=window)
    single = ReferenceModel(cfg, weights, replay_window=window)
    recurrent = ReferenceModel(cfg, weights)
    caches = [m.new_cache(2, 160, max_step_tokens=6) for m in (spec, single, recurrent)]
    for m, c in zip((spec, single, recurrent), caches, strict=True):
        m.prefill(c, prompts)
    cs, c1, cr = caches
    layer0 = cfg.recurrent_layers()[0]
    g = torch.Generator().manual_seed(52)
    crossed = rejected = 0
    worst_logit = worst_state = 0.0
    for _ in range(14):
        t = int(torch.randint(1, 7, (1,), generator=g))
        tokens = torch.randint(0, cfg.vocab_size, (2, t), generator=g)
        accepted = torch.randint(0, t, (2,), generator=g)
        before = cs.layers[layer0].count.clone()
        logits = spec.verify(cs, tokens)
        spec.commit(cs, accepted)
        crossed += int(((before + accepted + 1) >= window).sum())
        rejected += int((t - 1 - accepted).sum())
        for b in range(2):
            for j in range(int(accepted[b]) + 1):  # the kept tokens, one at a time
                one = single.decode(c1.row(b), tokens[b : b + 1, j : j + 1])[0, 0]
                rec = recurrent.decode(cr.row(b), tokens[b : b + 1, j : j + 1])[0, 0]
                torch.testing.assert_close(logits[b, j], one, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(logits[b, j], rec, rtol=1e-4, atol=1e-4)
                worst_logit = max(worst_logit, float((logits[b, j] - one).abs().max()))
        assert torch.equal(cs.lengths, c1.lengths) and torch.equal(cs.lengths, cr.lengths)
        for i in cfg.recurrent_layers():
            want = cr.layers[i].state
            scale = float(want.abs().max())
            for got in (spec.recurrent_state(cs, i), single.recurrent_state(c1, i)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
            worst_state = max(worst_state,
                              float((spec.recurrent_state(cs, i) - want).abs().max()) / scale)
            conv = cr.layers[i].conv
            torch.testing.assert_close(cs.layers[i].conv, conv, rtol=1e-4,
                                       atol=1e-5 * float(conv.abs().max()))
    assert crossed >= 4 and rejected >= 8  # folds on commit, and real rejections
    record_numerics(f"speculative {name} L={window} vs single steps",
                    f"logits max abs err {worst_logit:.1e}, state max rel err {worst_state:.1e}")


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_with_replay_window(name: str) -> None:
    """Greedy generation (what `--replay-window` runs): same tokens as the recurrent update."""
    prompts = [[5, 17, 3, 99, 4], [250, 1]]

    def run(steps: int, replay_window: int | None, dtype: torch.dtype) -> list[list[int]]:
        cfg, weights = load_model(name, seed=7, dtype=dtype)
        mode = "fp32" if dtype == torch.float32 else "bf16"
        return generate(ReferenceModel(cfg, weights, mode, replay_window=replay_window), prompts,
                        steps)

    recurrent = run(24, None, torch.float32)
    assert run(24, 4, torch.float32) == recurrent
    assert [len(t) for t in recurrent] == [24, 24]
    assert len(set(recurrent[0])) > 4  # not stuck on one token
    bf16 = run(6, 16, torch.bfloat16)
    assert [len(t) for t in bf16] == [6, 6]


# ---- the ReplaySSM equations on raw tensors ------------------------------------------------------
def test_delta_rule_replay_strong_decay_stays_finite() -> None:
    """24 ring entries with log-decays near -30 each (exp of the total underflows to 0): segment
    sums keep every factor finite, and outputs, u and the fold equal the recurrent loop."""
    g = torch.Generator().manual_seed(61)
    h, dk, dv, n, t = 3, 8, 5, 24, 3
    s0 = torch.randn(h, dk, dv, generator=g)
    ks = torch.nn.functional.normalize(torch.randn(n + t, h, dk, generator=g), dim=-1)
    qs = torch.nn.functional.normalize(torch.randn(n + t, h, dk, generator=g), dim=-1) * dk**-0.5
    vs = torch.randn(n + t, h, dv, generator=g)
    betas = torch.rand(n + t, h, generator=g)
    gs = -30.0 * torch.rand(n + t, h, dk, generator=g)  # channel-wise, KDA style
    state, us, outs = s0, [], []
    for i in range(n + t):  # decay, delta update, read: the textbook order
        state = gs[i].exp()[..., None] * state
        u = betas[i][:, None] * (vs[i] - (state * ks[i][..., None]).sum(-2))
        state = state + ks[i][..., None] * u[:, None, :]
        us.append(u)
        outs.append((state * qs[i][..., None]).sum(-2))
    ring = {"k": ks[:n], "u": torch.stack(us[:n]), "g": gs[:n]}
    o, entries = delta_rule_replay(s0, ring, qs[n:], ks[n:], vs[n:], betas[n:], gs[n:])
    assert torch.isfinite(o).all() and torch.isfinite(entries["u"]).all()
    torch.testing.assert_close(o, torch.stack(outs[n:]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(entries["u"], torch.stack(us[n:]), rtol=1e-4, atol=1e-5)
    full = {k: torch.cat((ring[k], entries[k])) for k in ring}
    torch.testing.assert_close(delta_rule_fold(s0, full), state, rtol=1e-4, atol=1e-5)


def test_ssd_replay_verify_and_fold() -> None:
    """Mamba2: drafts after a ring of 5 entries, all outputs in one pass, then the fold."""
    g = torch.Generator().manual_seed(62)
    h, p, n_state, n, t = 4, 6, 5, 5, 4
    a = -torch.rand(h, generator=g) * 8 - 0.5
    d = torch.randn(h, generator=g)
    s0 = torch.randn(h, p, n_state, generator=g)
    xs = torch.randn(n + t, h, p, generator=g)
    bs, cs = torch.randn(2, n + t, h, n_state, generator=g)
    dts = torch.nn.functional.softplus(torch.randn(n + t, h, generator=g))
    state, ys = s0, []
    for i in range(n + t):  # write, then read the new state
        state = (dts[i] * a).exp()[:, None, None] * state + (
            dts[i][:, None, None] * xs[i][:, :, None] * bs[i][:, None, :])
        ys.append((state * cs[i][:, None, :]).sum(-1) + d[:, None] * xs[i])
    ring = {"x": xs[:n], "B": bs[:n], "dt": dts[:n]}
    y, entries = ssd_replay(s0, ring, xs[n:], bs[n:], cs[n:], dts[n:], a, d)
    torch.testing.assert_close(y, torch.stack(ys[n:]), rtol=1e-4, atol=1e-5)
    full = {k: torch.cat((ring[k], entries[k])) for k in ring}
    torch.testing.assert_close(ssd_fold(s0, full, a), state, rtol=1e-4, atol=1e-5)


# ---- errors --------------------------------------------------------------------------------------
def _spec_model(max_step_tokens: int = 3):
    cfg, weights, prompts, tokens = setup("qwen3.5-tiny", seed=71, steps=4)
    model = ReferenceModel(cfg, weights, replay_window=4)
    cache = model.new_cache(2, 64, max_step_tokens=max_step_tokens)
    model.prefill(cache, prompts)
    return model, cache, tokens


def test_commit_more_than_proposed() -> None:
    model, cache, tokens = _spec_model()
    model.verify(cache, tokens[:, :3])
    with pytest.raises(ReferenceError, match=r"cannot accept 3 drafts: the step proposed 3 tokens"):
        model.commit(cache, [3, 0])
    with pytest.raises(ReferenceError, match=r"cannot accept -1 drafts"):
        model.commit(cache, [0, -1])
    with pytest.raises(ReferenceError, match=r"accepted has 1 entries for batch 2"):
        model.commit(cache, [0])
    with pytest.raises(ReferenceError, match=r"not committed yet; call commit first"):
        model.verify(cache, tokens[:, :1])
    model.commit(cache, [2, 1])  # still usable after the refused commits
    assert cache.lengths.tolist() == [7 + 3, 4 + 2]
    with pytest.raises(ReferenceError, match=r"nothing to commit"):
        model.commit(cache, [0, 0])


def test_ring_overflow() -> None:
    model, cache, tokens = _spec_model(max_step_tokens=3)  # ring capacity 4 - 1 + 3 = 6
    assert cache.ring_capacity == 6
    model.decode(cache, tokens[:, :3])  # 3 committed entries, no fold yet
    with pytest.raises(ReferenceError, match=r"ring overflow: 3 committed \+ 4 new entries exceed "
                                          r"the ring capacity 6"):
        model.verify(cache, tokens[:, :4])
    assert cache.pending is None  # nothing was proposed
    model.decode(cache, tokens[:, :3])  # fits: 3 + 3 = 6, then folds


def test_recurrent_model_has_no_verify() -> None:
    cfg, weights, prompts, tokens = setup("nemotron-h-tiny", seed=81, steps=2)
    model = ReferenceModel(cfg, weights)
    cache = model.new_cache(2, 32)
    model.prefill(cache, prompts)
    with pytest.raises(ReferenceError, match=r"verify needs a ReplaySSM model"):
        model.verify(cache, tokens)
    replay = ReferenceModel(cfg, weights, replay_window=4)
    with pytest.raises(ReferenceError, match=r"cache was made for replay_window None"):
        replay.decode(cache, tokens)
    with pytest.raises(ReferenceError, match=r"replay_window must be a positive integer, got 0"):
        ReferenceModel(cfg, weights, replay_window=0)


def test_bad_tokens_and_prompts() -> None:
    cfg, weights, prompts, tokens = setup("kimi-linear-tiny", seed=91, steps=2)
    model = ReferenceModel(cfg, weights)
    cache = model.new_cache(2, 12)
    with pytest.raises(ReferenceError, match=r"empty prompt"):
        model.prefill(cache, [prompts[0], []])
    with pytest.raises(ReferenceError, match=r"2 prompts for a cache of batch 3"):
        model.prefill(model.new_cache(3, 12), prompts)
    model.prefill(cache, prompts)
    with pytest.raises(ReferenceError, match=r"prefill needs an empty cache"):
        model.prefill(cache, prompts)
    with pytest.raises(ReferenceError, match=rf"token id {cfg.vocab_size} at sequence 1, index 0 "
                                             r"is outside the vocabulary"):
        model.decode(cache, torch.tensor([[1], [cfg.vocab_size]]))
    with pytest.raises(ReferenceError, match=r"sequence 0 would exceed the cache's max length: "
                                             r"7 cached \+ 6 new > 12"):
        model.decode(cache, torch.zeros(2, 6, dtype=torch.int64))
    with pytest.raises(ReferenceError, match=r"tokens must be \[B, T\], got shape \(2,\)"):
        model.decode(cache, torch.zeros(2, dtype=torch.int64))
