"""megakernel/layers/gdn.py: the gated delta rule (Qwen3.5 `linear_attention`).

What only GDN does: the config's derived sizes and packing (proj = [in_proj_qkv | z | b | a]
zero-padded to 16 rows, conv [C, K], out_norm, o). What every kind and every recurrent kind
answers for (refusals, its fp32 parameter row [A_log | dt_bias], state, ReplaySSM ring, stages,
bytes, both modes on the executor): test_layers_contract.py.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.layers.gdn import GDNConfig
from megakernel.models import Block, ModelConfig
from tests.layers.helpers import cases, pack_tagged


def test_config_sizes() -> None:
    c = GDNConfig(2, 4, 16, 8)
    assert (c.key_dim, c.value_dim, c.conv_dim) == (32, 32, 96)


@pytest.mark.parametrize(("cfg", "blk"), cases("gdn"))
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    """proj = [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a], then zero rows up to a multiple
    of 16; conv = the taps [C, K]."""
    c, (w, packed) = blk.cfg, pack_tagged(blk, cfg)
    rows = c.conv_dim + c.value_dim + 2 * c.num_v_heads
    pad = -(-rows // 16) * 16 - rows
    assert pad > 0  # the tiny preset does exercise the padding (136 rows -> 144)
    want = torch.cat([w[f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")]
                     + [torch.zeros(pad, cfg.hidden_size, dtype=torch.float64)])
    assert torch.equal(packed["proj"], want)
    conv = w["conv1d.weight"]
    assert torch.equal(packed["conv"], torch.stack([conv[ch, 0] for ch in range(c.conv_dim)]))
    assert torch.equal(packed["out_norm"], w["norm.weight"])
    assert torch.equal(packed["o"], w["out_proj.weight"])
