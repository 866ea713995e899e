"""megakernel/layers/mamba2.py: the Mamba2 SSD mixer (Nemotron-H `M` blocks).

Checkpoint shapes against the transformers module, init roles, the config's refusals, packing
(proj = in_proj [z | xBC | dt] zero-padded to 16 rows; conv = the taps [C, K] then the conv bias
[C], zeros without one), the fp32 parameter row [A_log | D | dt_bias], the buffers, the conv
window / state / ReplaySSM ring, the stages and records, the bytes, and one executor run of a
model whose only block is a Mamba2 mixer, per mode.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.layers import kind
from megakernel.layers.mamba2 import Mamba2Config
from megakernel.models import Block, ConfigError, ModelConfig, preset
from tests.layers.helpers import (
    LOGIT_TOL,
    block_ids,
    blocks_of,
    check_flow,
    check_pack_keys,
    check_recurrent_needs,
    check_recurrent_program,
    check_recurrent_stages,
    check_recurrent_state,
    check_recurrent_tables,
    check_replay_writes_the_state_once_per_window,
    check_roles,
    executor_vs_reference,
    hf_block_tensors,
    pack_tagged,
)

MAMBA = kind("mamba2")
BLOCKS = blocks_of("mamba2")
IDS = block_ids("mamba2")
NAME = "nemotron-h-tiny"


def without_conv_bias() -> tuple[ModelConfig, Block]:
    cfg, blk = BLOCKS[0]
    m = blk.cfg
    c = Mamba2Config(m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel, False)
    return cfg, Block(blk.layer, blk.name, "mamba2", c, blk.prefix, blk.norm)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    hf = hf_block_tensors(cfg, blk)
    assert MAMBA.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}
    assert {n for n, (_, dt) in hf.items() if dt == torch.float32} <= set(MAMBA.fp32_params)
    cfg, blk = without_conv_bias()
    assert "conv1d.bias" not in MAMBA.shapes(blk, cfg)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    check_roles(cfg, blk, {
        "in_proj.weight": "proj", "conv1d.weight": "conv", "conv1d.bias": "bias",
        "dt_bias": "dt_bias", "A_log": "A_log", "D": "D", "norm.weight": "norm_plain",
        "out_proj.weight": "out"})


def test_config_refuses_unsupported_shapes() -> None:
    with pytest.raises(ConfigError, match="multiple of n_groups"):
        Mamba2Config(6, 8, 16, 4)
    with pytest.raises(ConfigError, match="conv kernel"):
        Mamba2Config(8, 8, 16, 2, conv_kernel=1)
    m = Mamba2Config(8, 8, 16, 2)
    assert (m.d_inner, m.conv_dim, m.in_proj_size) == (64, 128, 200)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS + [without_conv_bias()],
                         ids=IDS + ["no-conv-bias"])
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    """proj = in_proj then zero rows; conv[c K + k] = tap k of channel c, conv[C K + c] = the
    bias of channel c (0 without a conv bias)."""
    check_pack_keys(blk, cfg)
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


def test_tables_are_fp32_a_log_d_dt_bias() -> None:
    check_recurrent_tables(NAME, "mamba2", ["A_log", "D", "dt_bias"])


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_buffers(cfg: ModelConfig, blk: Block) -> None:
    m = blk.cfg
    check_recurrent_needs(blk, cfg, m.in_proj_size, m.d_inner, 3 * m.num_heads, m.n_groups)
    check_recurrent_state(blk, cfg, m.conv_dim, (m.num_heads, m.head_dim, m.state_size), [
        ("x", (m.num_heads, m.head_dim)), ("B", (m.n_groups, m.state_size)),
        ("dt", (m.num_heads,))])


def test_flow() -> None:
    check_flow("mamba2", {"PROJ": None, "MAMBA_CORE": "PROJ", "MAMBA_REPLAY": "PROJ",
                          "OPROJ": ("MAMBA_CORE", "MAMBA_REPLAY")}, "OPROJ")


@pytest.mark.parametrize("window", [None, 4], ids=["recurrent", "replay4"])
def test_stages(window: int | None) -> None:
    """The last mamba2 layer: its rows of the per-layer tables are not the first."""
    cfg = preset(NAME)
    blk = [b for b in cfg.blocks if b.kind == "mamba2"][-1]
    check_recurrent_stages(cfg, blk, window, "MAMBA")


@pytest.mark.parametrize("window", [None, 4], ids=["recurrent", "replay4"])
def test_program(window: int | None) -> None:
    check_recurrent_program(NAME, "mamba2", window, "MAMBA")


def test_replay_writes_the_state_once_per_window() -> None:
    check_replay_writes_the_state_once_per_window(NAME, "mamba2", 1)


@pytest.mark.parametrize("window", [None, 2], ids=["recurrent", "replay2"])
def test_executor_matches_the_reference(window: int | None) -> None:
    cfg = preset(NAME).replace(layer_types=("mamba2",))
    assert [b.kind for b in cfg.blocks] == ["mamba2"]
    assert executor_vs_reference(cfg, window=window) <= LOGIT_TOL
