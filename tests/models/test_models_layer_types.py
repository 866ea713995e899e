"""What the hybrid families share (megakernel/models/layer_types.py): `layer_types` checked against
the family's mixers, and transformers reading our `to_hf_dict` the way we do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from megakernel.models import ConfigError, config_from_hf_dict, preset, presets
from megakernel.models.layer_types import LayerTypesConfig

HYBRID = sorted(n for n, c in presets().items() if isinstance(c, LayerTypesConfig))


def test_the_recurrent_presets() -> None:
    assert set(HYBRID) >= {"qwen3.5-tiny", "kimi-linear-tiny", "nemotron-h-tiny", "qwen3.5-0.8b",
                           "qwen3.5-9b", "kimi-linear-48b-a3b", "nemotron-h-8b"}


@pytest.mark.parametrize("name", HYBRID)
def test_transformers_reads_our_config_alike(name: str, hf_config: Callable[..., Any]) -> None:
    """to_hf_dict -> transformers config -> its to_dict -> our parser gives the same config, and
    transformers' own reading of the layer types agrees with ours."""
    cfg = preset(name)
    hf = hf_config(cfg)
    assert config_from_hf_dict(hf.to_dict()).replace(name=name) == cfg
    hf_types = list(getattr(hf, "layers_block_type", None) or hf.layer_types)
    ours = {"gdn": "linear_attention", "kda": "linear_attention", "mamba2": "linear_attention",
            "attention": "full_attention", "mla": "full_attention", "mlp": "mlp"}
    assert hf_types == [ours[t] for t in cfg.layer_types]
    assert cfg.num_layers == len(cfg.layer_types)


def test_layer_type_outside_family_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"layer 1: unsupported layer type 'mamba2' for qwen3_5"):
        preset("qwen3.5-tiny").replace(layer_types=("gdn", "mamba2", "attention", "gdn"))
    with pytest.raises(ConfigError, match=r"layer 0: unsupported layer type 'gdn' for kimi_linear"):
        preset("kimi-linear-tiny").replace(layer_types=("gdn",))
    with pytest.raises(ConfigError, match="at least one layer"):
        preset("nemotron-h-tiny").replace(layer_types=())
