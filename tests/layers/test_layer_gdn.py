"""megakernel/layers/gdn.py: the gated delta rule (Qwen3.5 `linear_attention`).

Checkpoint shapes against the transformers module, init roles, the config's refusals, packing
(proj = [in_proj_qkv | z | b | a] zero-padded to 16 rows, conv [C, K], out_norm, o), the fp32
parameter row [A_log | dt_bias], the buffers, the conv window / state / ReplaySSM ring, the
stages and records (recurrent and ReplaySSM), the bytes (ReplaySSM writes the state once per
window), and one executor run per mode.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.layers import kind
from megakernel.layers.gdn import GDNConfig
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

GDN = kind("gdn")
BLOCKS = blocks_of("gdn")
IDS = block_ids("gdn")
NAME = "qwen3.5-tiny"


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    hf = hf_block_tensors(cfg, blk)
    assert GDN.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}
    assert {n for n, (_, dt) in hf.items() if dt == torch.float32} <= set(GDN.fp32_params)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    check_roles(cfg, blk, {
        "in_proj_qkv.weight": "proj", "in_proj_z.weight": "proj", "in_proj_b.weight": "proj",
        "in_proj_a.weight": "proj", "conv1d.weight": "conv", "dt_bias": "dt_bias",
        "A_log": "A_log", "norm.weight": "norm_plain", "out_proj.weight": "out"})


def test_config_refuses_unsupported_shapes() -> None:
    with pytest.raises(ConfigError, match="multiple of"):
        GDNConfig(3, 4, 16, 16)
    with pytest.raises(ConfigError, match="conv kernel"):
        GDNConfig(2, 4, 16, 16, conv_kernel=1)
    c = GDNConfig(2, 4, 16, 8)
    assert (c.key_dim, c.value_dim, c.conv_dim) == (32, 32, 96)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    """proj = [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a], then zero rows up to a multiple
    of 16; conv = the taps [C, K]."""
    check_pack_keys(blk, cfg)
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


def test_tables_are_fp32_a_log_then_dt_bias() -> None:
    check_recurrent_tables(NAME, "gdn", ["A_log", "dt_bias"])


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_buffers(cfg: ModelConfig, blk: Block) -> None:
    c = blk.cfg
    check_recurrent_needs(blk, cfg, c.conv_dim + c.value_dim + 2 * c.num_v_heads, c.value_dim,
                          2 * c.num_v_heads, c.num_k_heads)
    check_recurrent_state(blk, cfg, c.conv_dim, (c.num_v_heads, c.k_head_dim, c.v_head_dim), [
        ("k", (c.num_k_heads, c.k_head_dim)), ("u", (c.num_v_heads, c.v_head_dim)),
        ("g", (c.num_v_heads,))])


def test_flow() -> None:
    check_flow("gdn", {"PROJ": None, "GDN_CORE": "PROJ", "GDN_REPLAY": "PROJ",
                       "OPROJ": ("GDN_CORE", "GDN_REPLAY")}, "OPROJ")


@pytest.mark.parametrize("window", [None, 4], ids=["recurrent", "replay4"])
def test_stages(window: int | None) -> None:
    """The last gdn layer: its rows of the per-layer tables are not the first."""
    cfg = preset(NAME)
    blk = [b for b in cfg.blocks if b.kind == "gdn"][-1]
    check_recurrent_stages(cfg, blk, window, "GDN")


@pytest.mark.parametrize("window", [None, 4], ids=["recurrent", "replay4"])
def test_program(window: int | None) -> None:
    check_recurrent_program(NAME, "gdn", window, "GDN")


@pytest.mark.parametrize("tokens", [1, 2])
def test_replay_writes_the_state_once_per_window(tokens: int) -> None:
    check_replay_writes_the_state_once_per_window(NAME, "gdn", tokens)


@pytest.mark.parametrize("window", [None, 2], ids=["recurrent", "replay2"])
def test_executor_matches_the_reference(window: int | None) -> None:
    cfg = preset(NAME).replace(layer_types=("gdn",))
    assert executor_vs_reference(cfg, window=window) <= LOGIT_TOL
