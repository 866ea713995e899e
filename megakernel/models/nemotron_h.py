"""Nemotron-H (NemotronHForCausalLM): one block per layer (RMSNorm -> mixer -> residual); mixers
are Mamba2 (M), grouped-query attention without RoPE (*) and a relu^2 MLP (-). MoE blocks are not
supported. Weights under `backbone.` (transformers renames it `model.`: both accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megakernel.layers.attention import AttentionConfig
from megakernel.layers.mamba2 import Mamba2Config
from megakernel.layers.relu2 import Relu2Config
from megakernel.models.config import (
    Block,
    ConfigError,
    as_bool,
    as_float,
    as_int,
    as_list,
    first_key,
    map_types,
    positive,
    refuse,
)
from megakernel.models.layer_types import LayerTypesConfig
from megakernel.models.registry import register_family

_KINDS = {"mamba2": "mamba2", "attention": "attention", "mlp": "relu2"}


def _presets() -> dict[str, NemotronHConfig]:
    return {
        # nvidia/Nemotron-H-8B-Base-8K
        "nemotron-h-8b": NemotronHConfig(
            vocab_size=131072, hidden_size=4096, intermediate_size=21504,
            layer_types=map_types(
                list("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"), 52,
                {"M": "mamba2", "*": "attention", "-": "mlp"}),
            rms_norm_eps=1e-5, max_position_embeddings=8192,
            attention=AttentionConfig(32, 8, 128),
            mamba2=Mamba2Config(128, 64, 128, 8, 4, True, 0.001), name="nemotron-h-8b"),
        "nemotron-h-tiny": NemotronHConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128,
            layer_types=("mamba2", "mlp", "attention", "mamba2", "mlp"), rms_norm_eps=1e-5,
            max_position_embeddings=512, attention=AttentionConfig(4, 2, 64),
            mamba2=Mamba2Config(8, 8, 16, 2, 4, True, 0.001), name="nemotron-h-tiny"),
        # hybrid_override_pattern "*-*-": the family's attention and relu^2 blocks only (what
        # the CuTe DSL kernel runs of it)
        "nemotron-h-attn-tiny": NemotronHConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128,
            layer_types=("attention", "mlp", "attention", "mlp"), rms_norm_eps=1e-5,
            max_position_embeddings=512, attention=AttentionConfig(4, 2, 64),
            mamba2=Mamba2Config(8, 8, 16, 2, 4, True, 0.001), name="nemotron-h-attn-tiny"),
    }


@register_family(architectures=("NemotronHForCausalLM",), model_types=("nemotron_h",),
                 presets=_presets, real_presets=("nemotron-h-8b",))
@dataclass(frozen=True, kw_only=True)
class NemotronHConfig(LayerTypesConfig):
    family = "nemotron_h"
    mixers = ("mamba2", "attention", "mlp")
    embed_name = "backbone.embeddings.weight"
    final_norm_name = "backbone.norm_f.weight"
    skipped_prefixes = ("mtp.", "model.mtp.", "backbone.mtp.")
    renamed_prefixes = {"model.": "backbone."}  # transformers' name for the backbone

    intermediate_size: int
    attention: AttentionConfig
    mamba2: Mamba2Config
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        positive(self, "intermediate_size")
        a = self.attention
        if a.rotary_dim or a.qk_norm or a.output_gate or a.qkv_bias:
            raise ConfigError("Nemotron-H attention has no RoPE, q/k norm, output gate or bias")
        if self.tie_word_embeddings:
            raise ConfigError("unsupported tie_word_embeddings=true for Nemotron-H (HF never "
                              "ties)")
        super().__post_init__()

    def make_blocks(self) -> tuple[Block, ...]:
        cfgs = {"mamba2": self.mamba2, "attention": self.attention,
                "mlp": Relu2Config(self.intermediate_size)}
        return tuple(Block(i, "mixer", _KINDS[t], cfgs[t], f"backbone.layers.{i}.mixer.",
                           f"backbone.layers.{i}.norm.weight")
                     for i, t in enumerate(self.layer_types))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> NemotronHConfig:
        refuse(d, attention_bias=False, mlp_bias=False, use_bias=False, mamba_proj_bias=False)
        if d.get("mlp_hidden_act", "relu2") != "relu2":
            raise ConfigError(f"unsupported mlp_hidden_act {d['mlp_hidden_act']!r}; only 'relu2'")
        if d.get("mamba_hidden_act", "silu") != "silu":
            raise ConfigError(
                f"unsupported mamba_hidden_act {d['mamba_hidden_act']!r}; only 'silu'")
        if d.get("sliding_window"):
            raise ConfigError(f"unsupported sliding_window={d['sliding_window']!r}")
        types_key = first_key(d, "layers_block_type", "layer_types")
        types = as_list(d, types_key)
        if types is None:
            pattern = d.get("hybrid_override_pattern")
            if pattern is None:
                raise ConfigError(
                    "config has neither layers_block_type nor hybrid_override_pattern")
            if not isinstance(pattern, str):
                raise ConfigError(
                    f"config field 'hybrid_override_pattern' must be a string, got {pattern!r}")
            codes = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
            bad = sorted(set(pattern) - set(codes))
            if bad:
                raise ConfigError(f"unknown hybrid_override_pattern symbols {bad}")
            types = [codes[c] for c in pattern]
        legacy = {"mamba": "linear_attention", "attention": "full_attention"}
        types = [legacy.get(t, t) if isinstance(t, str) else t for t in types]
        mapping = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "mlp"}
        for i, t in enumerate(types):
            if t == "moe":
                raise ConfigError(
                    f"layer {i}: unsupported layer type 'moe' (Nemotron-H MoE blocks are not "
                    "implemented); supported: mamba2 (M), attention (*), mlp (-)"
                )
        if "num_hidden_layers" in d and as_int(d, "num_hidden_layers") != len(types):
            raise ConfigError(f"num_hidden_layers = {d['num_hidden_layers']} but the layer "
                              f"pattern has {len(types)} layers")
        if as_bool(d, "tie_word_embeddings"):
            raise ConfigError("unsupported tie_word_embeddings=true for Nemotron-H (HF never ties)")
        heads = as_int(d, "num_attention_heads")
        hidden = as_int(d, "hidden_size")
        if heads <= 0:
            raise ConfigError(f"num_attention_heads must be positive, got {heads}")

        def num(kind: Any, *keys: str, default: Any = ...) -> Any:
            """The first present spelling of a field, read as `kind` (as_int / as_float)."""
            return kind(d, first_key(d, *keys), default)

        return cls(
            vocab_size=as_int(d, "vocab_size"),
            hidden_size=hidden,
            layer_types=map_types(types, len(types), mapping, types_key),
            intermediate_size=as_int(d, "intermediate_size"),
            rms_norm_eps=num(as_float, "layer_norm_epsilon", "rms_norm_eps", default=1e-5),
            tie_word_embeddings=False,
            max_position_embeddings=as_int(d, "max_position_embeddings", 4096),
            attention=AttentionConfig(
                num_heads=heads,
                num_kv_heads=as_int(d, "num_key_value_heads", heads),
                head_dim=num(as_int, "head_dim", "attention_head_dim", default=hidden // heads),
            ),
            mamba2=Mamba2Config(
                num_heads=as_int(d, "mamba_num_heads", 128),
                head_dim=as_int(d, "mamba_head_dim", 64),
                state_size=num(as_int, "ssm_state_size", "mamba_d_state", default=128),
                n_groups=num(as_int, "n_groups", "mamba_n_groups", default=8),
                conv_kernel=num(as_int, "conv_kernel", "mamba_d_conv", default=4),
                use_conv_bias=as_bool(d, first_key(d, "use_conv_bias", "mamba_conv_bias"), True),
                dt_min=num(as_float, "time_step_min", "mamba_dt_min", default=0.001),
            ),
            name=name,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        a, m = self.attention, self.mamba2
        names = {"mamba2": "linear_attention", "attention": "full_attention", "mlp": "mlp"}
        return {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "layers_block_type": [names[t] for t in self.layer_types],
            "num_attention_heads": a.num_heads,
            "num_key_value_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "intermediate_size": self.intermediate_size,
            "mlp_hidden_act": "relu2",
            "mamba_num_heads": m.num_heads,
            "mamba_head_dim": m.head_dim,
            "ssm_state_size": m.state_size,
            "n_groups": m.n_groups,
            "conv_kernel": m.conv_kernel,
            "use_conv_bias": m.use_conv_bias,
            "time_step_min": m.dt_min,
            "layer_norm_epsilon": self.rms_norm_eps,
            "tie_word_embeddings": False,
            "max_position_embeddings": self.max_position_embeddings,
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
        }


