"""Nemotron-H (megakernel/models/nemotron_h.py): legacy layer type names, checkpoints under
`backbone.` or transformers' `model.`. The published config.json, the size, the tiny preset
spelled out and refusals (MoE blocks, tied embeddings): test_models_families.py."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from megakernel.models import config_from_hf_dict, preset
from megakernel.models.nemotron_h import NemotronHConfig
from megakernel.models.weights import load_checkpoint, random_weights, save_checkpoint


def test_legacy_layer_type_names() -> None:
    """Older configs spell the layer types "mamba" and "attention"."""
    d = {k: v for k, v in preset("nemotron-h-tiny").to_hf_dict().items()
         if k != "layers_block_type"}
    d["layers_block_type"] = ["mamba", "mlp", "attention", "mamba", "mlp"]
    assert config_from_hf_dict(d, name="nemotron-h-tiny") == preset("nemotron-h-tiny")


def test_transformers_model_prefix(tmp_path: Path) -> None:
    """Nemotron-H under transformers' `model.` names loads as `backbone.`."""
    cfg = preset("nemotron-h-tiny")
    weights = random_weights(cfg, seed=4, dtype=torch.float32)
    path = save_checkpoint(cfg, weights, tmp_path / "nemo")
    save_file({n.replace("backbone.", "model.", 1): t for n, t in weights.items()},
              str(path / "model.safetensors"))
    _, loaded = load_checkpoint(path)
    assert all(torch.equal(loaded[n], weights[n]) for n in weights)
    c = NemotronHConfig.canonical_name
    assert c("model.layers.0.mixer.A_log") == "backbone.layers.0.mixer.A_log"
    assert c("mtp.layers.0.norm.weight") is None
