"""The MTP drafter (reference/mtp.py) and its config and checkpoint support: presets keep no MTP,
the tensors round-trip through save/load, one MTP step against a computation by hand from the
weights, incremental drafting against the chained block run from scratch, speculative greedy
decoding that reproduces plain greedy, and an MTP built to be exact whose drafts are all accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megakernel.models import config_from_hf_dict, preset, presets
from megakernel.models.config import expected_shapes, mtp_shapes
from megakernel.models.weights import (
    WeightError,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)
from megakernel.reference.model import ReferenceModel, generate
from megakernel.reference.mtp import MtpBlock, MtpDrafter, target_hidden

PUBLISHED = Path(__file__).parents[1] / "models" / "published"


def tiny(mtp: int = 1):
    return preset("qwen3.5-tiny").replace(mtp_layers=mtp)


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    cfg = tiny()
    return ReferenceModel(cfg, random_weights(cfg, seed=3, dtype=torch.float32), mode="fp32")


# ---- config and checkpoint ---------------------------------------------------------------------
def test_presets_enable_no_mtp() -> None:
    for name in presets():
        cfg = preset(name)
        assert cfg.mtp == () and mtp_shapes(cfg) == {}, name


def test_published_qwen35_declares_one_mtp_layer_but_parses_to_the_preset() -> None:
    d = json.loads((PUBLISHED / "qwen3.5-0.8b" / "config.json").read_text())
    cfg = config_from_hf_dict(d, name="qwen3.5-0.8b")
    assert cfg == preset("qwen3.5-0.8b") and cfg.mtp_layers == 0
    assert type(cfg).declared_mtp_layers(d) == 1
    big = cfg.replace(mtp_layers=1)
    h, v = cfg.hidden_size, cfg.vocab_size
    extra = {n: s for n, s in expected_shapes(big).items() if n not in expected_shapes(cfg)}
    assert extra == mtp_shapes(big)
    assert extra["mtp.fc.weight"] == (h, 2 * h)
    assert extra["mtp.layers.0.self_attn.q_proj.weight"] == (2 * 8 * 256, h)  # + output gate
    assert extra["mtp.layers.0.mlp.down_proj.weight"] == (h, cfg.intermediate_size)
    assert not any("embed" in n and "norm" not in n or "lm_head" in n for n in extra)
    assert v == 248320  # the shared embedding / LM head are the target's


def test_mtp_config_refuses_bad_depth() -> None:
    from megakernel.models import ConfigError

    with pytest.raises(ConfigError, match="mtp_layers"):
        tiny(-1)


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    cfg = tiny()
    w = random_weights(cfg, seed=5)
    assert set(w) == set(expected_shapes(cfg)) and "mtp.fc.weight" in w
    save_checkpoint(cfg, w, tmp_path)
    got_cfg, got = load_checkpoint(tmp_path, mtp=True)
    assert got_cfg == cfg.replace(name=tmp_path.name) and set(got) == set(w)
    assert all(torch.equal(got[n], w[n]) for n in w)
    # without mtp=True the MTP tensors are skipped, as for every published checkpoint
    plain_cfg, plain = load_checkpoint(tmp_path)
    assert plain_cfg == preset("qwen3.5-tiny").replace(name=tmp_path.name)
    assert set(plain) == set(expected_shapes(plain_cfg))
    assert not any(n.startswith("mtp.") for n in plain)


def test_checkpoint_missing_mtp_tensor(tmp_path: Path) -> None:
    cfg = tiny()
    w = random_weights(cfg, seed=5)
    del w["mtp.layers.0.self_attn.o_proj.weight"]
    save_checkpoint(cfg, w, tmp_path)
    with pytest.raises(WeightError, match="missing tensor 'mtp.layers.0.self_attn.o_proj"):
        load_checkpoint(tmp_path, mtp=True)
    plain = preset("qwen3.5-tiny")
    save_checkpoint(plain, random_weights(plain), tmp_path / "plain")
    with pytest.raises(WeightError, match="declares no MTP layers"):
        load_checkpoint(tmp_path / "plain", mtp=True)


def test_drafter_needs_mtp() -> None:
    from megakernel.reference.layers.common import ReferenceError

    cfg = preset("qwen3.5-tiny")
    m = ReferenceModel(cfg, random_weights(cfg), mode="fp32")
    with pytest.raises(ReferenceError, match="no MTP modules"):
        MtpDrafter(m, 1, 16, 2)


# ---- the block's math --------------------------------------------------------------------------
def _rms1p(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + w)


def _by_hand(w: dict[str, torch.Tensor], h0: torch.Tensor, token: int, hidden_first: bool = False
             ) -> torch.Tensor:
    """Logits of the MTP step (target hidden h0 at position 0, next token `token`), written out
    from the weights: at position 0 the attention sees one key, so its output is v (the q/k
    path and RoPE drop out) times the output gate."""
    g0 = _rms1p(h0, w["model.norm.weight"])  # the target's LM head input
    en = _rms1p(w["model.embed_tokens.weight"][token], w["mtp.pre_fc_norm_embedding.weight"])
    hn = _rms1p(g0, w["mtp.pre_fc_norm_hidden.weight"])
    x = w["mtp.fc.weight"] @ (torch.cat((hn, en)) if hidden_first else torch.cat((en, hn)))
    p = "mtp.layers.0."
    xn = _rms1p(x, w[p + "input_layernorm.weight"])
    heads, kv, d = 4, 2, 64  # qwen3.5-tiny's attention
    gate = (w[p + "self_attn.q_proj.weight"] @ xn).reshape(heads, 2 * d)[:, d:]
    v = (w[p + "self_attn.v_proj.weight"] @ xn).reshape(kv, d)
    o = torch.stack([v[i // (heads // kv)] for i in range(heads)]) * torch.sigmoid(gate)
    x = x + w[p + "self_attn.o_proj.weight"] @ o.reshape(-1)
    xn = _rms1p(x, w[p + "post_attention_layernorm.weight"])
    a = torch.nn.functional.silu(w[p + "mlp.gate_proj.weight"] @ xn) * (
        w[p + "mlp.up_proj.weight"] @ xn)
    x = x + w[p + "mlp.down_proj.weight"] @ a
    return w["lm_head.weight"] @ _rms1p(x, w["mtp.norm.weight"])


def test_one_step_by_hand(model: ReferenceModel) -> None:
    """prefill([t0]) leaves no pair; propose([], [], bonus) runs (g_0, bonus) at position 0."""
    w = {n: t.double() for n, t in model.w.items()}
    h0, _ = target_hidden(model, [17])
    block = MtpBlock(model, model.cfg.mtp[0], 1, 8)
    g, logits = block.forward(0, 0, block.target_output(h0), torch.tensor([42]))
    want = _by_hand(w, h0[0].double(), 42)
    torch.testing.assert_close(logits[0].double(), want, rtol=1e-5, atol=1e-5)
    # the test sees the concatenation order: [hidden ; embedding] gives other logits
    swapped = _by_hand(w, h0[0].double(), 42, hidden_first=True)
    assert (swapped - want).abs().max() > 1e-2
    drafter = MtpDrafter(model, 1, 8, 1)
    drafter.prefill([[17]], [h0])
    assert drafter.propose([[]], [h0[:0]], [42]) == [[int(want.argmax())]]


def _hand_layer(w: dict[str, torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The MTP decoder layer over positions 0 .. len(xs)-1 written out (causal gated attention,
    (1 + w) q/k norms, RoPE on the first 16 dims with theta 1e6, then the SwiGLU)."""
    p, heads, kv, d, r = "mtp.layers.0.", 4, 2, 64, 16
    inv = 1.0 / (1e6 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))

    def rope(x: torch.Tensor, pos: int) -> torch.Tensor:  # x [n, d]
        c, s = torch.cos(pos * inv).repeat(2), torch.sin(pos * inv).repeat(2)
        rot = torch.cat((-x[:, r // 2:r], x[:, :r // 2]), dim=1)
        return torch.cat((x[:, :r] * c + rot * s, x[:, r:]), dim=1)

    qs, gates, ks, vs = [], [], [], []
    for t, x in enumerate(xs):
        xn = _rms1p(x, w[p + "input_layernorm.weight"])
        qg = (w[p + "self_attn.q_proj.weight"] @ xn).reshape(heads, 2 * d)
        qs.append(rope(_rms1p(qg[:, :d], w[p + "self_attn.q_norm.weight"]), t))
        gates.append(qg[:, d:])
        k = (w[p + "self_attn.k_proj.weight"] @ xn).reshape(kv, d)
        ks.append(rope(_rms1p(k, w[p + "self_attn.k_norm.weight"]), t))
        vs.append((w[p + "self_attn.v_proj.weight"] @ xn).reshape(kv, d))
    out = []
    for t, x in enumerate(xs):
        o = []
        for i in range(heads):
            j = i // (heads // kv)
            sc = torch.stack([qs[t][i] @ ks[u][j] for u in range(t + 1)]) / d**0.5
            o.append(sum(pr * vs[u][j] for u, pr in enumerate(torch.softmax(sc, 0))))
        o = torch.stack(o) * torch.sigmoid(gates[t])
        x = x + w[p + "self_attn.o_proj.weight"] @ o.reshape(-1)
        xn = _rms1p(x, w[p + "post_attention_layernorm.weight"])
        a = torch.nn.functional.silu(w[p + "mlp.gate_proj.weight"] @ xn) * (
            w[p + "mlp.up_proj.weight"] @ xn)
        out.append(x + w[p + "mlp.down_proj.weight"] @ a)
    return out


def test_two_chained_drafts_by_hand(model: ReferenceModel) -> None:
    """Draft 2 comes from (g' of draft 1, draft 1) at position 1: the chained hidden is the MTP's
    output after its own norm, and the pair at position 0 is in the cache."""
    w = {n: t.double() for n, t in model.w.items()}

    def fuse(g: torch.Tensor, token: int) -> torch.Tensor:
        en = _rms1p(w["model.embed_tokens.weight"][token], w["mtp.pre_fc_norm_embedding.weight"])
        return w["mtp.fc.weight"] @ torch.cat((en, _rms1p(g, w["mtp.pre_fc_norm_hidden.weight"])))

    h0, _ = target_hidden(model, [17])
    x0 = fuse(_rms1p(h0[0].double(), w["model.norm.weight"]), 42)
    g1 = _rms1p(_hand_layer(w, [x0])[0], w["mtp.norm.weight"])
    d1 = int((w["lm_head.weight"] @ g1).argmax())
    y = _hand_layer(w, [x0, fuse(g1, d1)])[1]
    want = w["lm_head.weight"] @ _rms1p(y, w["mtp.norm.weight"])
    d2 = int(want.argmax())
    block = MtpBlock(model, model.cfg.mtp[0], 1, 8)
    g, _ = block.forward(0, 0, block.target_output(h0), torch.tensor([42]))
    _, logits = block.forward(0, 1, g, torch.tensor([d1]))
    torch.testing.assert_close(logits[0].double(), want, rtol=1e-5, atol=1e-5)
    drafter = MtpDrafter(model, 1, 8, 2)
    drafter.prefill([[17]], [h0])
    assert drafter.propose([[]], [h0[:0]], [42]) == [[d1, d2]]


# ---- drafting ----------------------------------------------------------------------------------
def _fresh_drafts(model: ReferenceModel, tokens: list[int], h: torch.Tensor, k: int) -> list[int]:
    """k chained greedy drafts after `tokens` (the last one the bonus) from a fresh cache: every
    pair (g_p, t_{p+1}) in one forward, then the chain, with no incremental bookkeeping."""
    block = MtpBlock(model, model.cfg.mtp[0], 1, len(tokens) + k)
    n = len(tokens) - 1  # pairs p = 0 .. n-1
    g, logits = block.forward(0, 0, block.target_output(h[:n]), torch.tensor(tokens[1:]))
    g, tok = g[-1:], int(logits[-1].argmax())
    out = [tok]
    for d in range(1, k):
        g, logits = block.forward(0, n - 1 + d, g, torch.tensor([tok]))
        tok = int(logits[-1].argmax())
        out.append(tok)
    return out


def speculate(model: ReferenceModel, prompts: list[list[int]], steps: int, k: int,
              check: bool = True) -> tuple[list[list[int]], int, int]:
    """Greedy speculative decoding with the MTP drafter, the target's verdicts taken from plain
    greedy generation (a greedy target accepts a draft exactly when it equals its own next
    token) -> (tokens generated per sequence, drafts accepted, drafts proposed). `check`: each
    step's drafts against `_fresh_drafts`."""
    gen = generate(model, prompts, steps + k + 2)
    hid = [target_hidden(model, p + g)[0] for p, g in zip(prompts, gen, strict=True)]
    drafter = MtpDrafter(model, len(prompts), max(len(p) for p in prompts) + steps + 2 * k + 2, k)
    drafter.prefill(prompts, [h[:len(p)] for h, p in zip(hid, prompts, strict=True)])
    out: list[list[int]] = [[] for _ in prompts]
    accepted: list[list[int]] = [[] for _ in prompts]
    hidden = [h[:0] for h in hid]
    bonus = [g[0] for g in gen]
    n_acc = n_prop = 0
    while min(len(o) for o in out) < steps:
        drafts = drafter.propose(accepted, hidden, bonus)
        for b, (p, g) in enumerate(zip(prompts, gen, strict=True)):
            i = len(out[b])  # g[i] is the bonus: the target's input this step
            if check:
                assert drafts[b] == _fresh_drafts(model, p + g[:i + 1], hid[b], k)
            j = 0
            while j < k and drafts[b][j] == g[i + 1 + j]:
                j += 1
            n_acc, n_prop = n_acc + j, n_prop + k
            accepted[b] = [g[i], *drafts[b][:j]]
            hidden[b] = hid[b][len(p) + i:len(p) + i + 1 + j]
            out[b] += accepted[b]
            bonus[b] = g[i + 1 + j]
    return [o[:steps] for o in out], n_acc, n_prop


def test_drafts_equal_the_chained_block_from_scratch(model: ReferenceModel) -> None:
    prompts = [[5, 9, 200, 3, 77, 1], [31], [8, 8]]  # ragged
    got, _, _ = speculate(model, prompts, steps=8, k=3)
    assert got == generate(model, prompts, 8)


def _exact(cfg):  # noqa: ANN001, ANN202
    """Weights where the target is a bigram model (every block's output projection zero: h is
    the token's embedding) and the MTP computes the target's own prediction for its input token
    (fc = [I, 0] keeps the normed embedding, its layer adds nothing, its norm is the target's), so
    every draft equals the target's next token."""
    w = random_weights(cfg, seed=11, dtype=torch.float32)
    for n in w:
        if n.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            w[n] = torch.zeros_like(w[n])
    h = cfg.hidden_size
    w["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    w["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)  # (1 + w) form: the plain norm
    w["mtp.norm.weight"] = w["model.norm.weight"].clone()
    return ReferenceModel(cfg, w, mode="fp32")


def test_exact_mtp_drafts_are_all_accepted() -> None:
    exact = _exact(tiny())
    prompts = [[3, 1, 4, 1, 5], [9], [2, 6]]
    got, n_acc, n_prop = speculate(exact, prompts, steps=9, k=3)
    assert got == generate(exact, prompts, 9)
    assert n_acc == n_prop > 0


def test_random_mtp_still_decodes_greedy(model: ReferenceModel) -> None:
    """Drafts of an untrained MTP are mostly rejected, and the output is greedy's anyway."""
    prompts = [[1, 2, 3], [250, 0, 7, 7]]
    got, n_acc, n_prop = speculate(model, prompts, steps=6, k=2, check=False)
    assert got == generate(model, prompts, 6)
    assert n_acc < n_prop


def test_bf16_mode_runs(model: ReferenceModel) -> None:
    cfg = tiny()
    m = ReferenceModel(cfg, random_weights(cfg, seed=3), mode="bf16")
    got, _, _ = speculate(m, [[4, 5, 6], [7]], steps=4, k=2)
    assert got == generate(m, [[4, 5, 6], [7]], 4)


def test_protocol_checks(model: ReferenceModel) -> None:
    from megakernel.reference.layers.common import ReferenceError

    h, _ = target_hidden(model, [1, 2, 3])
    d = MtpDrafter(model, 1, 32, 2)
    d.prefill([[1, 2, 3]], [h])
    with pytest.raises(ReferenceError, match="first propose after prefill"):
        d.propose([[4]], [h[:1]], [5])
    d.propose([[]], [h[:0]], [4])
    with pytest.raises(ReferenceError, match="must start with the last bonus token 4"):
        d.propose([[5]], [h[:1]], [6])
    with pytest.raises(ReferenceError, match="hidden states must be"):
        d.propose([[4, 9]], [h[:1]], [6])
