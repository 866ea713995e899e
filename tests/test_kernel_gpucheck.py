"""The greedy-token rules of gpu-check on CPU tensors (no GPU): near ties of the reference may
flip, a clear margin may not; free-running generations are compared up to the first near tie."""

from __future__ import annotations

import torch

from megakernel.gpu_check import MIN_PREFIX, common_prefix, greedy_check, top2_margin


def _logits(seed: int, rows: int = 6, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_top2_margin():
    x = torch.tensor([[1.0, 5.0, 4.5, -2.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(top2_margin(x), torch.tensor([0.5, 0.0]))


def test_clear_margin_mismatch_is_a_failure():
    ref = _logits(1)
    kern = ref + 1e-3 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    tok = torch.argmax(ref, dim=-1)
    r = greedy_check(kern, tok, ref)
    assert r == {**r, "clear": 0, "near_ties": 0, "mismatch": False}
    wrong = tok.clone()
    wrong[3] = (wrong[3] + 1) % ref.shape[-1]  # e.g. a broken argmax: logits fine, token wrong
    r = greedy_check(kern, wrong, ref)
    assert r["clear"] == 1 and r["near_ties"] == 0 and r["mismatch"]


def test_near_tie_flip_is_only_counted():
    ref = _logits(3)
    tok = torch.argmax(ref, dim=-1)
    second = torch.topk(ref[0], 2).indices[1]
    kern = ref.clone()
    gap = float(ref[0, tok[0]] - ref[0, second])
    kern[0, second] += gap * 0.6  # an error of 0.6 gap on each of the two: the order flips
    kern[0, tok[0]] -= gap * 0.6
    ktok = torch.argmax(kern, dim=-1)
    assert ktok[0] != tok[0]
    r = greedy_check(kern, ktok, ref)
    assert r["clear"] == 0 and r["near_ties"] == 1
    # the same flip with a tiny measured error elsewhere is a clear mismatch
    r = greedy_check(ref, ktok, ref)
    assert r["clear"] == 1


def test_common_prefix_stops_at_the_first_near_tie():
    ref = list(range(40))
    margins = [1.0] * 40
    assert common_prefix(ref, ref, margins, 0.1)["ok"]
    k = ref.copy()
    k[20] = -1  # diverges at a clear margin
    r = common_prefix(k, ref, margins, 0.1)
    assert not r["ok"] and r["first_difference"] == 20 and r["compared"] == 40
    margins[20] = 0.05  # ... but step 20 was a near tie: comparison ends there
    r = common_prefix(k, ref, margins, 0.1)
    assert r["ok"] and r["compared"] == 20 and r["near_tie_stop"]
    k[5] = -1  # a difference before the near tie still fails
    assert not common_prefix(k, ref, margins, 0.1)["ok"]
    short = list(range(MIN_PREFIX - 1))
    assert not common_prefix(short, ref, margins, 0.1)["ok"]  # lengths differ
