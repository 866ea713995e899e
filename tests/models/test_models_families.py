"""What every model family answers for (every registered family, tests/registries.py): its real
presets, written out below; each published config.json in published/ parses to its preset (from
the dict and from the directory, as `resolve` reads it); the published parameter counts or sizes;
the fields of some presets spelled out. What only one family does (its refusals, its config.json
quirks, its checkpoint names) is in tests/models/test_models_<family>.py.

published/<preset>/config.json holds the fields of the published config.json files, written out
by hand so that a typo in a preset shows up as a mismatch here: meta-llama/Llama-3.2-1B and
Llama-3.1-8B, Qwen/Qwen3-0.6B, -1.7B and -8B, Qwen/Qwen2.5-0.5B and -1.5B, Qwen/Qwen3.5-0.8B
(trimmed to what the models read), moonshotai/Kimi-Linear-48B-A3B-Instruct and
nvidia/Nemotron-H-8B-Base-8K on the Hugging Face hub.
"""

from __future__ import annotations

import functools
import json
import math
import operator
from pathlib import Path
from typing import Any

import pytest

from megakernel.layers.attention import AttentionConfig
from megakernel.models import (
    ConfigError,
    ModelConfig,
    RopeConfig,
    config_from_hf_dict,
    config_from_hf_dir,
    family,
    preset,
    presets,
    resolve,
)
from megakernel.models.dense import DenseConfig
from megakernel.models.weights import expected_shapes
from tests.registries import FAMILIES

PUBLISHED = Path(__file__).with_name("published")
# family -> its real presets, written out (the expected values: the registry's are checked
# against them, so a real preset dropped or misspelt in a family module shows up here)
REAL_PRESETS: dict[str, tuple[str, ...]] = {
    "llama": ("llama-3.2-1b", "llama-3.1-8b"),
    "qwen3": ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"),
    "qwen2": ("qwen2.5-0.5b", "qwen2.5-1.5b"),
    "qwen3_5": ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b"),
    "kimi_linear": ("kimi-linear-48b-a3b",),
    "nemotron_h": ("nemotron-h-8b",),
}
OWNER = {name: fam for fam in FAMILIES for name in family(fam).real_presets}  # real -> family
# Published parameter counts (model cards / safetensors metadata; tied embeddings counted once)
PUBLISHED_PARAMS = {
    "llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248,
    "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "qwen3-8b": 8_190_735_360,
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,  # model cards: 0.49B, 1.54B
}
# Parameters from the shapes, in billions (the hybrids' names and model cards: 0.8B text decoder
# without the vision tower, 9B, 48B, 8B)
SIZES = {"qwen3.5-0.8b": (0.70, 0.80), "qwen3.5-9b": (8.8, 9.1),
         "kimi-linear-48b-a3b": (48.5, 49.5), "nemotron-h-8b": (8.0, 8.2)}
SPELLED_OUT: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        family="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
        rope=RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192), group_size=4, q_size=2048,
        kv_size=512, qk_norm=False, qkv_bias=False, **{"attention.rotary_dim": 64}),
    # head_dim * heads != hidden: q_size is 2048 for a 1024-wide model
    "qwen3-0.6b": dict(
        family="qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope=RopeConfig(1e6), rms_norm_eps=1e-6, q_size=2048, kv_size=1024, qk_norm=True,
        qkv_bias=False),
    "qwen2.5-0.5b": dict(
        family="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
        rope=RopeConfig(1e6), rms_norm_eps=1e-6, max_position_embeddings=32768, group_size=7,
        q_size=896, kv_size=128, qkv_bias=True, qk_norm=False),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
        intermediate_size=8960, tie_word_embeddings=True, max_position_embeddings=131072),
    # attention at head_dim 64 (a supported one) with 16 rotary dims
    "qwen3.5-tiny": {
        "layer_types": ("gdn", "gdn", "attention", "gdn"),
        "attention": AttentionConfig(4, 2, 64, 16, RopeConfig(1e6), True, True),
        "norm_kind": "rms_1p", "ffn_type(0)": "swiglu",
        "block kinds": ["gdn", "swiglu"] * 2 + ["attention", "swiglu", "gdn", "swiglu"]},
    # one block per layer, attention without RoPE at head_dim 64
    "nemotron-h-tiny": {
        "layer_types": ("mamba2", "mlp", "attention", "mamba2", "mlp"),
        "block kinds": ["mamba2", "relu2", "attention", "mamba2", "relu2"],
        "attention": AttentionConfig(4, 2, 64), "embed_name": "backbone.embeddings.weight",
        "final_norm_name": "backbone.norm_f.weight"},
}


# published config (" text": its text_config alone) -> [(changes, the message it is refused
# with)]; a change "a.b" sets field b of a, `...` drops the field
REFUSALS: dict[str, list[tuple[dict[str, Any], str]]] = {
    "llama-3.2-1b": [  # Llama has no biases
        ({"attention_bias": True}, "unsupported config field attention_bias=True"),
        ({"mlp_bias": True}, "unsupported config field mlp_bias=True"),
        ({"use_sliding_window": True}, "unsupported config field use_sliding_window=True"),
        ({"pretraining_tp": 2}, "unsupported pretraining_tp=2")],
    "qwen3-0.6b": [  # transformers 5 writes `layer_types`: no sliding-window layer
        ({"layer_types": ["full_attention"] * 27 + ["sliding_attention"]},
         "layer 27: unsupported layer type 'sliding_attention'"),
        ({"use_sliding_window": True}, "use_sliding_window")],
    "qwen2.5-0.5b": [
        ({"use_sliding_window": True}, "unsupported use_sliding_window=true"),
        ({"mlp_bias": True}, "unsupported config field mlp_bias=True"),
        ({"use_sliding_window": "false"}, "'use_sliding_window' must be true or false")],
    "qwen3.5-0.8b text": [
        ({"num_experts": 256}, r"Qwen3.5 MoE text models are not supported"),
        ({"attn_output_gate": False}, r"unsupported attn_output_gate=false"),
        ({"linear_num_value_heads": 24},
         r"linear_num_value_heads \(24\) must be a multiple of linear_num_key_heads \(16\)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         r"unsupported rope type 'yarn' for Qwen3.5"),
        ({"hidden_size": ...}, r"config is missing required field 'hidden_size'"),
        ({"layer_types": ["linear_attention"] * 23 + ["sliding_attention"]},
         r"layer 23: unsupported layer type 'sliding_attention'")],
    "qwen3.5-0.8b": [
        ({"text_config.model_type": "qwen3_5_moe_text"},
         r"unsupported Qwen3.5 text model_type 'qwen3_5_moe_text'"),
        ({"text_config": None}, r"qwen3_5 config has no text_config")],
    "kimi-linear-48b-a3b": [
        ({"mla_use_nope": False}, r"unsupported mla_use_nope=false"),
        ({"moe_router_activation_func": "softmax"},
         r"unsupported moe_router_activation_func 'softmax'"),
        ({"hidden_act": "gelu"}, r"unsupported config field hidden_act='gelu'"),
        ({"num_key_value_heads": 8}, r"MLA needs num_key_value_heads == num_attention_heads"),
        ({"linear_attn_config.gate_lower_bound": -5.0},
         r"unsupported linear_attn_config fields: gate_lower_bound"),
        ({"linear_attn_config.full_attn_layers": [4, 28]},
         r"full_attn_layers entry 28 is not a layer in 1..27"),
        ({"num_expert_group": 3}, r"num_experts \(256\) must be a multiple of n_group \(3\)"),
        ({"layer_types": ["sliding_attention"] * 27},
         r"layer 0: unsupported layer type 'sliding_attention'; supported: linear_attention, "
         r"full_attention"),
        ({"moe_layer_freq": 2}, r"unsupported moe_layer_freq=2"),
        ({"num_nextn_predict_layers": 1}, r"num_nextn_predict_layers > 0"),
        ({"first_k_dense_replace": None, "mlp_layer_types": ["dense", "sparse", "dense"]},
         r"unsupported mlp_layer_types"),
        ({"num_hidden_layers": ...}, r"config is missing required field 'num_hidden_layers'")],
    "nemotron-h-8b": [
        ({"hybrid_override_pattern": "MEM*E"},
         r"layer 1: unsupported layer type 'moe' \(Nemotron-H MoE blocks are not implemented\)"),
        ({"hybrid_override_pattern": "M-X*"}, r"unknown hybrid_override_pattern symbols \['X'\]"),
        ({"mlp_hidden_act": "silu"}, r"unsupported mlp_hidden_act 'silu'"),
        ({"mlp_bias": True}, r"unsupported config field mlp_bias=True"),
        ({"tie_word_embeddings": True}, r"tie_word_embeddings=true"),
        ({"mamba_hidden_act": "gelu"}, r"unsupported mamba_hidden_act 'gelu'"),
        ({"sliding_window": 4096}, r"unsupported sliding_window=4096"),
        ({"num_hidden_layers": 50}, r"num_hidden_layers = 50 but the layer pattern has 52 layers"),
        ({"hybrid_override_pattern": ...},
         r"neither layers_block_type nor hybrid_override_pattern")],
}


def published(name: str) -> dict[str, Any]:
    """The published config.json of real preset `name`."""
    return json.loads((PUBLISHED / name / "config.json").read_text())


def test_the_real_presets_table_has_every_family() -> None:
    assert sorted(REAL_PRESETS) == sorted(FAMILIES), "REAL_PRESETS: one entry per family"


@pytest.mark.parametrize("fam", FAMILIES)
def test_real_presets(fam: str) -> None:
    """The family's real presets, in order; each family has a published config.json, a dense
    family one for every real preset and a published parameter count for each."""
    assert fam in REAL_PRESETS, f"family {fam!r} has no entry in REAL_PRESETS"
    cls, real = family(fam).cls, REAL_PRESETS[fam]
    assert family(fam).real_presets == real and cls.family == fam
    assert set(real) <= set(presets())
    with_config = {d.name for d in PUBLISHED.iterdir() if d.name in real}
    assert with_config
    if issubclass(cls, DenseConfig):
        assert with_config == set(real) == set(real) & set(PUBLISHED_PARAMS)


def test_every_published_config_is_a_real_preset() -> None:
    assert {d.name for d in PUBLISHED.iterdir()} <= set(OWNER)
    assert set(PUBLISHED_PARAMS) | set(SIZES) <= set(OWNER)


@pytest.mark.parametrize("name", sorted(d.name for d in PUBLISHED.iterdir()))
def test_published_config_parses_to_the_preset(name: str) -> None:
    """config.json -> config_from_hf_dir (and `resolve` of the directory) gives the preset, of
    the family's class; so does config_from_hf_dict of its dict."""
    path = PUBLISHED / name
    cfg = config_from_hf_dir(path)
    assert type(cfg) is family(OWNER[name]).cls
    assert cfg.replace(name=name) == preset(name)
    assert resolve(str(path)) == cfg
    assert config_from_hf_dict(published(name), name=name) == preset(name)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_published(name: str) -> None:
    assert preset(name).num_parameters() == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(SIZES))
def test_real_preset_sizes(name: str) -> None:
    """Parameter counts from the shapes: catches a wrong field in a preset."""
    lo, hi = SIZES[name]
    assert lo < sum(math.prod(s) for s in expected_shapes(preset(name)).values()) / 1e9 < hi


def spelled(cfg: ModelConfig, key: str) -> Any:
    """The field `key` of `cfg` ("a.b": an attribute's attribute); "block kinds" and
    "ffn_type(0)" as named."""
    if key == "block kinds":
        return [b.kind for b in cfg.blocks]
    if key == "ffn_type(0)":
        return cfg.ffn_type(0)
    return functools.reduce(getattr, key.split("."), cfg)


@pytest.mark.parametrize("name", sorted(SPELLED_OUT))
def test_preset_spelled_out(name: str) -> None:
    cfg, want = preset(name), SPELLED_OUT[name]
    assert {key: spelled(cfg, key) for key in want} == want


def changed(base: str, changes: dict[str, Any]) -> dict[str, Any]:
    """The published config `base` (" text": its text_config) with REFUSALS-style `changes`."""
    name, _, part = base.partition(" ")
    d = published(name)["text_config"] if part == "text" else published(name)
    for key, value in changes.items():
        *path, field = key.split(".")
        target = functools.reduce(operator.getitem, path, d)
        if value is ...:
            del target[field]
        else:
            target[field] = value
    return d


@pytest.mark.parametrize(("base", "changes", "message"),
                         [(b, c, m) for b, refused in REFUSALS.items() for c, m in refused],
                         ids=[f"{b}-{','.join(c)}" for b, refused in REFUSALS.items()
                              for c, _ in refused])
def test_unsupported_configs_are_refused(base: str, changes: dict[str, Any], message: str
                                         ) -> None:
    """What megakernel does not implement, changed in a published config, is refused by name."""
    assert base.split()[0] in OWNER
    with pytest.raises(ConfigError, match=message):
        config_from_hf_dict(changed(base, changes))
