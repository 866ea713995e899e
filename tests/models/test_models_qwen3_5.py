"""Qwen3.5 (megakernel/models/qwen3_5.py): the text config alone, partial RoPE as transformers
reads it, and the published checkpoint layout (`model.language_model.` prefix, vision tower and
MTP head skipped, sharded). The published multimodal config.json, the sizes, the tiny preset
spelled out and refusals: test_models_families.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from megakernel.models import config_from_hf_dict, family, preset
from megakernel.models.qwen3_5 import Qwen35Config
from megakernel.models.weights import load_checkpoint, random_weights


def test_the_text_config_alone_parses_to_the_preset() -> None:
    """The text model alone (qwen3_5_text), as Qwen3_5ForCausalLM checkpoints write it."""
    path = Path(__file__).parent / "published/qwen3.5-0.8b/config.json"
    text = {**json.loads(path.read_text())["text_config"], "architectures": ["Qwen3_5ForCausalLM"]}
    assert config_from_hf_dict(text, name="qwen3.5-0.8b") == preset("qwen3.5-0.8b")


@pytest.mark.parametrize("name", sorted(family("qwen3_5").presets()))
def test_transformers_reads_partial_rope_alike(name: str, hf_config: Callable[..., Any]) -> None:
    cfg = preset(name)
    hf = hf_config(cfg)
    a = cfg.attention
    assert int(a.head_dim * hf.rope_parameters["partial_rotary_factor"]) == a.rotary_dim
    assert hf.rope_parameters["rope_theta"] == a.rope.theta


def test_multimodal_checkpoint_layout(tmp_path: Path) -> None:
    """Published Qwen3.5 checkpoints: nested text_config, `model.language_model.` prefix, vision
    tower and MTP head present (skipped), two shards with an index."""
    cfg = preset("qwen3.5-tiny")
    weights = random_weights(cfg, seed=3, dtype=torch.bfloat16)
    renamed = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n:
               t for n, t in weights.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for fname, part in shards.items():
        save_file({n: renamed[n] for n in part}, str(tmp_path / fname))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    text = cfg.to_hf_dict()
    top = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": False, "text_config": {**text, "architectures": None},
           "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(top))
    loaded_cfg, loaded = load_checkpoint(tmp_path)
    assert loaded_cfg.replace(name="qwen3.5-tiny") == cfg
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[n], weights[n]) for n in weights)
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())


def test_canonical_names() -> None:
    c = Qwen35Config.canonical_name
    assert c("model.language_model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight")
    assert c("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert c("lm_head.weight") == "lm_head.weight"
    for skipped in ("model.visual.merger.weight", "mtp.fc.weight", "model.mtp.norm.weight",
                    "model.rotary_emb.inv_freq"):
        assert c(skipped) is None
