"""megakernel/layers/mamba2.py: the Mamba2 SSD mixer (Nemotron-H `M` blocks).

What only Mamba2 does: the config's derived sizes, the optional conv bias, and packing (proj =
in_proj [z | xBC | dt] zero-padded to 16 rows; conv = the taps [C, K] then the conv bias [C],
zeros without one). What every kind and every recurrent kind answers for (refusals, its fp32
parameter row [A_log | D | dt_bias], state, ReplaySSM ring, stages, bytes, both modes on the
executor): test_layers_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.layers import kind
from megakernel.layers.mamba2 import Mamba2Config
from megakernel.models import Block, ModelConfig
from tests.layers.helpers import cases, pack_tagged, without_conv_bias


def test_config_sizes() -> None:
    m = Mamba2Config(8, 8, 16, 2)
    assert (m.d_inner, m.conv_dim, m.in_proj_size) == (64, 128, 200)


def test_conv_bias_is_optional() -> None:
    cfg, blk = without_conv_bias()
    assert "conv1d.bias" not in kind("mamba2").shapes(blk, cfg)


@pytest.mark.parametrize(("cfg", "blk"), cases("mamba2"))
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    """proj = in_proj then zero rows; conv[c K + k] = tap k of channel c, conv[C K + c] = the
    bias of channel c (0 without a conv bias)."""
    m, (w, packed) = blk.cfg, pack_tagged(blk, cfg)
    pad = -(-m.in_proj_size // 16) * 16 - m.in_proj_size
    assert pad > 0  # 200 rows -> 208
    assert torch.equal(packed["proj"], torch.cat(
        (w["in_proj.weight"], torch.zeros(pad, cfg.hidden_size, dtype=torch.float64))))
    conv, taps, k = packed["conv"], w["conv1d.weight"], m.conv_kernel
    for ch in (0, 1, m.conv_dim - 1):
        for t in range(k):
            assert conv[ch * k + t] == taps[ch, 0, t]
        bias = w["conv1d.bias"][ch] if m.use_conv_bias else 0.0
        assert conv[m.conv_dim * k + ch] == bias
    want = torch.cat((taps[:, 0].reshape(-1), w["conv1d.bias"] if m.use_conv_bias
                      else torch.zeros(m.conv_dim, dtype=torch.float64)))
    assert torch.equal(conv, want)
    assert torch.equal(packed["out_norm"], w["norm.weight"])
    assert torch.equal(packed["o"], w["out_proj.weight"])
