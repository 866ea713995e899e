"""MLA decode with weight absorption (reference/layers/mla.py, `absorb=True`) equals the expanded
path (kv_b over the whole latent cache) in fp32, on random weights, caches and lengths.

Tolerance: the two paths differ only by fp32 reassociation (q_nope . (W_UK c) against
(W_UK^T q_nope) . c; W_UV (P c) against P (W_UV c)), so each is within a few fp32 ulps times the
reduction lengths of a float64 truth; asserted: |absorbed - expanded| <= 2e-6 x max |truth|
(fp32 eps 1.2e-7 times sums of up to r = 64 terms and the softmax), and both within that of
the float64 truth.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.layers.mla import MLAConfig
from megakernel.reference.layers.mla import MLA, MLACache

HIDDEN = 48
CFG = MLAConfig(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=24)
REL = 2e-6  # measured: <= 3.5e-7


def _weights(g: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    m = CFG

    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    return {
        "q_proj.weight": rnd(m.num_heads * m.qk_head_dim, HIDDEN, scale=HIDDEN**-0.5),
        "kv_a_proj_with_mqa.weight": rnd(m.latent, HIDDEN, scale=HIDDEN**-0.5),
        "kv_a_layernorm.weight": 1.0 + rnd(m.kv_lora_rank, scale=0.1),
        "kv_b_proj.weight": rnd(m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                m.kv_lora_rank, scale=m.kv_lora_rank**-0.5),
        "o_proj.weight": rnd(HIDDEN, m.num_heads * m.v_head_dim, scale=0.2),
    }


def _run(absorb: bool, w: dict[str, torch.Tensor], xn: torch.Tensor, cache: MLACache,
         lengths: torch.Tensor) -> tuple[torch.Tensor, MLACache]:
    cache = MLACache(cache.c.clone(), cache.k_rope.clone())
    layer = MLA(CFG, w, "", "fp32", absorb=absorb)
    return layer.forward(xn, cache, lengths), cache


def _truth(w: dict[str, torch.Tensor], xn: torch.Tensor, cache: MLACache,
           lengths: torch.Tensor) -> torch.Tensor:
    """The expanded path in float64 (the module's math, written out)."""
    m, w = CFG, {k: v.double() for k, v in w.items()}
    b, t, _ = xn.shape
    x = xn.double()
    q = (x @ w["q_proj.weight"].T).view(b, t, m.num_heads, m.qk_head_dim)
    lat, kr_new = (x @ w["kv_a_proj_with_mqa.weight"].T).split(
        [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * w["kv_a_layernorm.weight"]
    outs = []
    for i in range(b):
        s0 = int(lengths[i])
        c = torch.cat((cache.c[i, :s0].double(), lat[i]))  # [S, r]
        kr = torch.cat((cache.k_rope[i, :s0].double(), kr_new[i]))
        kv = (c @ w["kv_b_proj.weight"].T).view(-1, m.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        k = torch.cat((kv[..., : m.qk_nope_head_dim], kr[:, None].expand(-1, m.num_heads, -1)), -1)
        scores = torch.einsum("thd,shd->hts", q[i], k) * m.qk_head_dim**-0.5
        pos = s0 + torch.arange(t)
        scores = scores.masked_fill(torch.arange(s0 + t)[None, :] > pos[:, None], float("-inf"))
        o = torch.einsum("hts,shv->thv", scores.softmax(-1), kv[..., m.qk_nope_head_dim:])
        outs.append(o.reshape(t, -1))
    return torch.stack(outs) @ w["o_proj.weight"].T


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_absorbed_equals_expanded_in_fp32(tokens: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = _weights(g, torch.float32)
    batch, s_max = 3, 20
    lengths = torch.tensor([7, 0, 13])  # ragged, one sequence with an empty cache
    cache = MLACache(torch.randn(batch, s_max, CFG.kv_lora_rank, generator=g),
                     torch.randn(batch, s_max, CFG.qk_rope_head_dim, generator=g))
    xn = torch.randn(batch, tokens, HIDDEN, generator=g)
    out_e, cache_e = _run(False, w, xn, cache, lengths)
    out_a, cache_a = _run(True, w, xn, cache, lengths)
    truth = _truth(w, xn, cache, lengths)
    scale = float(truth.abs().max())
    assert scale > 0.1  # not a test on zeros
    assert float((out_a - out_e).abs().max()) <= REL * scale
    for out in (out_a, out_e):
        assert float((out.double() - truth).abs().max()) <= REL * scale
    assert torch.equal(cache_a.c, cache_e.c) and torch.equal(cache_a.k_rope, cache_e.k_rope)
