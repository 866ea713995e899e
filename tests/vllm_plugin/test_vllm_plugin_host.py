"""The plugin's host side without vLLM (the fast lane; make test-vllm serves a model through
stock vLLM): the weights read back from vLLM-style fused parameters, the batch buckets, the
architectures it registers."""

from __future__ import annotations

import pytest
import torch

from megakernel.models import preset
from megakernel.models.registry import load_all
from megakernel.models.weights import random_weights
from megakernel.vllm_plugin import ARCHITECTURES
from megakernel.vllm_plugin.decode import bucket_of
from megakernel.vllm_plugin.weights import hf_weights

VOCAB_PAD = 64  # vLLM pads its embedding and LM head rows


def vllm_style(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are named and fused as vLLM's Llama: qkv_proj = [q | k | v],
    gate_up_proj = [gate | up], the embedding padded with rows of garbage."""
    params: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if ".q_proj." in name:
            fused = torch.cat([t, weights[name.replace("q_proj", "k_proj")],
                               weights[name.replace("q_proj", "v_proj")]])
            params[name.replace("q_proj", "qkv_proj")] = fused
        elif ".gate_proj." in name:
            params[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [t, weights[name.replace("gate_proj", "up_proj")]])
        elif ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        elif name.endswith("embed_tokens.weight"):
            params[name] = torch.cat([t, torch.full((VOCAB_PAD, t.shape[1]), 7.0,
                                                    dtype=t.dtype)])
        else:
            params[name] = t
    return module_of(params)


def module_of(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose named_parameters are `params` (dotted names become submodules)."""
    m = torch.nn.Module()
    for name, t in params.items():
        parent = m
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return m


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny"])
def test_weights_come_back_from_vllms_fused_parameters(name: str) -> None:
    cfg = preset(name)
    want = random_weights(cfg, seed=3)
    got = hf_weights(cfg, vllm_style(want))
    assert got.keys() == want.keys()
    for n, t in want.items():
        assert torch.equal(got[n], t), n


def test_a_missing_tensor_is_named() -> None:
    cfg = preset("llama-tiny")
    want = random_weights(cfg, seed=3)
    del want["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        hf_weights(cfg, vllm_style(want))


def test_buckets_are_the_powers_of_two_that_hold_the_batch() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_every_architecture_serves_a_registered_family() -> None:
    archs = {a for f in load_all().values() for a in f.architectures}
    assert set(ARCHITECTURES.values()) <= archs
    assert all(ours == f"Megakernel{stock}" for ours, stock in ARCHITECTURES.items())
