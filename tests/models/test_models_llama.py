"""Llama (megakernel/models/llama.py): llama3 RoPE scaling as transformers 5 writes it, head_dim
from hidden / heads. The published configs, parameter counts and refusals:
test_models_families.py."""

from __future__ import annotations

import json
from pathlib import Path

from megakernel.models import config_from_hf_dict, preset

LLAMA_1B = json.loads((Path(__file__).parent / "published/llama-3.2-1b/config.json").read_text())


def test_transformers_5_rope_parameters_are_read() -> None:
    d = {k: v for k, v in LLAMA_1B.items() if k not in ("rope_scaling", "rope_theta")}
    d["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}
    assert config_from_hf_dict(d, name="llama-3.2-1b") == preset("llama-3.2-1b")


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    d = json.loads((Path(__file__).parent / "published/llama-3.1-8b/config.json").read_text())
    assert "head_dim" not in d
    assert config_from_hf_dict(d).head_dim == 128
