"""megakernel/layers/kda.py: Kimi delta attention (Kimi Linear `linear_attention`).

What only KDA does: the config's derived sizes and packing (proj = [q | k | v | f_a | b | g_a]
zero-padded to 16 rows; conv = the q, k, v taps, then f_b, then g_b, flat). What every kind and
every recurrent kind answers for (refusals, shapes against transformers' split convs and fp32
dt_bias, the fp32 parameter row [A_log | dt_bias], state, ReplaySSM ring, stages, bytes, both
modes on the executor): test_layers_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.layers.kda import KDAConfig
from megakernel.models import Block, ModelConfig
from tests.layers.helpers import cases, pack_tagged


def test_config_sizes() -> None:
    assert (KDAConfig(2, 16).qkv_dim, KDAConfig(2, 16).conv_dim) == (32, 96)


@pytest.mark.parametrize(("cfg", "blk"), cases("kda"))
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    """proj rows [q | k | v | f_a | b | g_a] then zeros; conv element by element: q taps
    [H d, K], k taps, v taps, then f_b [H d, d], then g_b [H d, d], row-major."""
    c, (w, packed) = blk.cfg, pack_tagged(blk, cfg)
    rows = 3 * c.qkv_dim + 2 * c.head_dim + c.num_heads
    pad = -(-rows // 16) * 16 - rows
    assert pad > 0  # 130 rows -> 144
    want = torch.cat([w[f"{n}_proj.weight"] for n in ("q", "k", "v", "f_a", "b", "g_a")]
                     + [torch.zeros(pad, cfg.hidden_size, dtype=torch.float64)])
    assert torch.equal(packed["proj"], want)
    k, hd, d = c.conv_kernel, c.qkv_dim, c.head_dim
    conv = []
    for n in "qkv":
        taps = w[f"{n}_conv1d.weight"]
        conv += [taps[ch, 0, t] for ch in range(hd) for t in range(k)]
    for n in ("f_b", "g_b"):
        m = w[f"{n}_proj.weight"]
        conv += [m[r, j] for r in range(hd) for j in range(d)]
    assert torch.equal(packed["conv"], torch.stack(conv))
    assert torch.equal(packed["out_norm"], w["o_norm.weight"])
    assert torch.equal(packed["o"], w["o_proj.weight"])
