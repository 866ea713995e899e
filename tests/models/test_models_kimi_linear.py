"""Kimi Linear (megakernel/models/kimi_linear.py): the active parameters, transformers reads the
MoE routing as we do, dense-MLP checkpoint names. The published config.json, the size and
refusals: test_models_families.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megakernel.models import preset
from megakernel.models.kimi_linear import KimiLinearConfig
from megakernel.models.weights import (
    expected_shapes,
    load_checkpoint,
    random_weights,
    save_checkpoint,
)


def test_about_3b_parameters_are_active() -> None:
    """Parameter counts from the shapes: about 3B active ("A3B") of the 48B."""
    shapes = expected_shapes(preset("kimi-linear-48b-a3b"))
    total = sum(math.prod(s) for s in shapes.values()) / 1e9
    experts = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n) / 1e9
    assert 3.0 < total - experts + experts * 8 / 256 < 4.0


@pytest.mark.parametrize("name", ["kimi-linear-tiny", "kimi-linear-48b-a3b"])
def test_transformers_reads_moe_routing_alike(name: str, hf_config: Callable[..., Any]) -> None:
    cfg = preset(name)
    hf = hf_config(cfg)
    ffn = [b.kind for b in cfg.blocks if b.name == "ffn"]
    assert hf.mlp_layer_types == ["dense" if k == "swiglu" else "sparse" for k in ffn]
    assert hf.mlp_layer_types == ["dense" if cfg.ffn_type(i) == "swiglu" else "sparse"
                                  for i in range(cfg.num_layers)]
    e = cfg.moe
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group) == (
        e.num_experts, e.top_k, e.n_group, e.topk_group)
    assert hf.moe_intermediate_size == e.intermediate_size
    assert hf.routed_scaling_factor == e.routed_scaling_factor


def test_dense_mlp_under_both_names(tmp_path: Path) -> None:
    """Kimi's dense MLP layers load under `mlp.` (ours) and `block_sparse_moe.` (what
    save_pretrained writes)."""
    kimi = preset("kimi-linear-tiny")
    kw = random_weights(kimi, seed=4, dtype=torch.float32)
    assert "model.layers.0.mlp.gate_proj.weight" in kw
    _, loaded = load_checkpoint(save_checkpoint(kimi, kw, tmp_path / "kimi"))
    assert all(torch.equal(loaded[n], kw[n]) for n in kw)
    moe_named = {n.replace(".0.mlp.", ".0.block_sparse_moe."): t for n, t in kw.items()}
    assert "model.layers.0.block_sparse_moe.up_proj.weight" in moe_named
    _, loaded = load_checkpoint(save_checkpoint(kimi, moe_named, tmp_path / "moe"))
    assert all(torch.equal(loaded[n], kw[n]) for n in kw)
    c = KimiLinearConfig.canonical_name
    assert c("model.layers.1.block_sparse_moe.shared_experts.up_proj.weight") == (
        "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight")
