"""Two-rank tensor parallelism on the CPU executor (executor/tp.py, program/tp.py) against the
single-rank executor (TP = 1) and the reference.

The ranks' sums reassociate the o_proj/down reductions (h + (p0 + p1) for h + p): mostly the same
bits as TP = 1, now and then an fp32 difference that flips a bf16 rounding of an activation
(measured up to 0.011 in the logits). So tokens must be equal, and logits within LOGIT_TOL of
TP = 1's and within the bf16 band of the reference as in test_executor_dense.py.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.executor import DeadlockError, Executor, executor_gpu
from megakernel.executor.tp import PeerBuffers, TPGroup
from megakernel.models import preset
from megakernel.models.weights import random_weights
from megakernel.program.compiler import compile_program
from megakernel.program.pack import pack_weights
from megakernel.program.tp import shard_config
from megakernel.reference.model import ReferenceModel, greedy
from tests.executor.helpers import check_logits

LOGIT_TOL = 0.04  # test_executor_dense.py
TP1_TOL = LOGIT_TOL  # |TP = 2 - TP = 1 logits|: reassociation, now and then a bf16 flip
STEPS = 4


def _setup(name: str, batch: int, tokens: int, seed: int, weights=None):  # noqa: ANN001, ANN202
    cfg = preset(name)
    w = random_weights(cfg, seed=seed) if weights is None else weights
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 8, (batch,), generator=g).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    s_max = max(lens) + STEPS * tokens
    refs = [ReferenceModel(cfg, w, mode=m) for m in ("bf16", "fp32")]
    caches = [r.new_cache(batch, s_max) for r in refs]
    first = greedy(refs[0].prefill(caches[0], prompts))
    refs[1].prefill(caches[1], prompts)
    one = Executor(compile_program(cfg, batch, executor_gpu(), tokens=tokens, max_seq_len=s_max),
                   pack_weights(cfg, w))
    prog = compile_program(shard_config(cfg, 2), batch, executor_gpu(), tokens=tokens,
                           max_seq_len=s_max)
    two = TPGroup(cfg, w, 2, prog)
    one.load_cache(caches[0])
    two.load_cache(caches[0])
    return cfg, g, refs, caches, one, two, first


def _tokens(cfg, g, tokens: int, first: torch.Tensor, batch: int) -> torch.Tensor:  # noqa: ANN001
    return first[:, None] if tokens == 1 else torch.randint(0, cfg.vocab_size, (batch, tokens),
                                                            generator=g)


@pytest.mark.parametrize("name, batch, tokens", [("llama-tiny", b, t) for b in (1, 3)
                                                 for t in (1, 2)] + [("qwen3-tiny", 3, 2)])
def test_two_ranks_match_one(name: str, batch: int, tokens: int) -> None:
    """Over several steps (T = 1: fed back by the program), the two ranks' tokens equal TP = 1's,
    their logits (gathered) TP = 1's up to fp32 reassociation and the reference's within the bf16
    band; both ranks' lengths advance. qwen3-tiny has one kv head: both ranks replicate it."""
    seed = 10 * batch + tokens
    cfg, g, (r16, r32), (c16, c32), one, two, first = _setup(name, batch, tokens, seed)
    tok = _tokens(cfg, g, tokens, first, batch)
    for step in range(STEPS):
        feed = step == 0 or tokens > 1
        want = one.step(tok if feed else None, seed=step)
        got = two.step(tok if feed else None, seed=step)
        assert torch.equal(got, want), f"step {step}: TP = 2 {got.tolist()}, TP = 1 {want.tolist()}"
        assert (two.logits - one.logits).abs().max().item() <= TP1_TOL
        l16, l32 = r16.decode(c16, tok), r32.decode(c32, tok)
        check_logits(step, two.logits.view(batch, tokens, -1), l16, l32, LOGIT_TOL)
        assert torch.equal(want, greedy(l16)), "the reference disagrees: pick another seed"
        tok = want[:, -1:] if tokens == 1 else torch.randint(0, cfg.vocab_size, (batch, tokens),
                                                             generator=g)
    for ex in two.ranks:
        assert torch.equal(ex.lengths.long(), c16.lengths)


def test_argmax_ties_across_ranks_go_to_the_lowest_index() -> None:
    """Every logit ties exactly with one in the other rank's vocabulary slice (the second half of
    the tied embedding repeats the first): the merged argmax picks the lower index, as TP = 1."""
    cfg = preset("llama-tiny")
    w = random_weights(cfg, seed=7)
    emb, half = w[cfg.embed_name].clone(), cfg.vocab_size // 2
    emb[half:] = emb[:half]
    w[cfg.embed_name] = emb
    cfg, g, _, _, one, two, first = _setup("llama-tiny", 3, 1, 7, weights=w)
    tok = first[:, None]
    for step in range(STEPS):
        want, got = one.step(tok, seed=step), two.step(tok, seed=step)
        assert bool((want < half).all())
        assert torch.equal(got, want), f"step {step}: TP = 2 {got.tolist()}, TP = 1 {want.tolist()}"
        tok = want


def test_a_missing_partial_is_a_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that never publishes its partial leaves its peer spinning: a DeadlockError naming
    both ranks, not a wrong answer or a hang."""
    cfg, g, _, _, _, two, first = _setup("llama-tiny", 1, 1, 3)
    publish = PeerBuffers.publish

    def rank0_only(self, rank: int, key: tuple, epoch: int, t: torch.Tensor) -> None:  # noqa: ANN001
        if rank == 0:
            publish(self, rank, key, epoch, t)

    monkeypatch.setattr(PeerBuffers, "publish", rank0_only)
    with pytest.raises(DeadlockError, match="rank 0.*\n(.*\n)*rank 1"):
        two.step(first[:, None], seed=0)
