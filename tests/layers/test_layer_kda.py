"""megakernel/layers/kda.py: Kimi delta attention (Kimi Linear `linear_attention`).

Checkpoint shapes against the transformers module (its split q/k/v convs and forget-gate tensors
as save_pretrained writes them), init roles, the config's refusals, packing (proj = [q | k | v |
f_a | b | g_a] zero-padded to 16 rows; conv = the q, k, v taps, then f_b, then g_b, flat), the
fp32 parameter row [A_log | dt_bias], the buffers, the conv window / state / ReplaySSM ring, the
stages and records, the bytes, and one executor run per mode.
"""

from __future__ import annotations

import pytest
import torch

from megakernel.layers import kind
from megakernel.layers.kda import KDAConfig
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

KDA = kind("kda")
BLOCKS = blocks_of("kda")
IDS = block_ids("kda")
NAME = "kimi-linear-tiny"


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_shapes_match_transformers(cfg: ModelConfig, blk: Block) -> None:
    """transformers keeps dt_bias in fp32: it is one of the kind's fp32 parameters."""
    hf = hf_block_tensors(cfg, blk)
    assert KDA.shapes(blk, cfg) == {n: s for n, (s, _) in hf.items()}
    hf32 = {n for n, (_, dt) in hf.items() if dt == torch.float32}
    assert "dt_bias" in hf32 and hf32 <= set(KDA.fp32_params)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_init_roles(cfg: ModelConfig, blk: Block) -> None:
    check_roles(cfg, blk, {
        **{f"{n}_proj.weight": "proj" for n in ("q", "k", "v", "f_a", "f_b", "b", "g_a", "g_b")},
        **{f"{n}_conv1d.weight": "conv" for n in "qkv"},
        "dt_bias": "dt_bias", "A_log": "A_log", "o_norm.weight": "norm_plain",
        "o_proj.weight": "out"})


def test_config_refuses_unsupported_shapes() -> None:
    with pytest.raises(ConfigError, match="conv kernel"):
        KDAConfig(2, 16, conv_kernel=1)
    with pytest.raises(ConfigError, match="head_dim"):
        KDAConfig(2, 0)
    assert (KDAConfig(2, 16).qkv_dim, KDAConfig(2, 16).conv_dim) == (32, 96)


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_pack(cfg: ModelConfig, blk: Block) -> None:
    """proj rows [q | k | v | f_a | b | g_a] then zeros; conv element by element: q taps
    [H d, K], k taps, v taps, then f_b [H d, d], then g_b [H d, d], row-major."""
    check_pack_keys(blk, cfg)
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


def test_tables_are_fp32_a_log_then_dt_bias() -> None:
    """A_log [1, 1, H, 1] flattened to [H], then dt_bias [H d]."""
    check_recurrent_tables(NAME, "kda", ["A_log", "dt_bias"])


@pytest.mark.parametrize(("cfg", "blk"), BLOCKS, ids=IDS)
def test_buffers(cfg: ModelConfig, blk: Block) -> None:
    c = blk.cfg
    h, d = c.num_heads, c.head_dim
    check_recurrent_needs(blk, cfg, 3 * h * d + 2 * d + h, h * d, h + h * d, h)
    check_recurrent_state(blk, cfg, 3 * h * d, (h, d, d),
                          [("k", (h, d)), ("u", (h, d)), ("g", (h, d))])


def test_flow() -> None:
    check_flow("kda", {"PROJ": None, "KDA_CORE": "PROJ", "KDA_REPLAY": "PROJ",
                       "OPROJ": ("KDA_CORE", "KDA_REPLAY")}, "OPROJ")


@pytest.mark.parametrize("window", [None, 4], ids=["recurrent", "replay4"])
def test_stages(window: int | None) -> None:
    """The last kda layer: its rows of the per-layer tables are not the first."""
    cfg = preset(NAME)
    blk = [b for b in cfg.blocks if b.kind == "kda"][-1]
    check_recurrent_stages(cfg, blk, window, "KDA")


@pytest.mark.parametrize("window", [None, 4], ids=["recurrent", "replay4"])
def test_program(window: int | None) -> None:
    check_recurrent_program(NAME, "kda", window, "KDA")


def test_replay_writes_the_state_once_per_window() -> None:
    check_replay_writes_the_state_once_per_window(NAME, "kda", 1)


@pytest.mark.parametrize("window", [None, 2], ids=["recurrent", "replay2"])
def test_executor_matches_the_reference(window: int | None) -> None:
    cfg = preset(NAME).replace(layer_types=("kda",))
    assert [b.kind for b in cfg.blocks] == ["kda", "swiglu"]
    assert executor_vs_reference(cfg, window=window) <= LOGIT_TOL
