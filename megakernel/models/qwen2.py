"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): dense attention with q/k/v projection biases, no q/k norm,
SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megakernel.models.config import ConfigError, RopeConfig, as_bool
from megakernel.models.dense import DenseConfig
from megakernel.models.registry import register_family


def _presets() -> dict[str, Qwen2Config]:
    def mk(name: str, v: int, h: int, n: int, hq: int, hkv: int, i: int, tie: bool,
           max_pos: int) -> Qwen2Config:
        return Qwen2Config(vocab_size=v, hidden_size=h, num_layers=n, num_heads=hq,
                           num_kv_heads=hkv, head_dim=h // hq, intermediate_size=i,
                           rms_norm_eps=1e-6, rope=RopeConfig(1e6), tie_word_embeddings=tie,
                           max_position_embeddings=max_pos, name=name)

    return {
        # real published shapes (Qwen/Qwen2.5-0.5B, Qwen2.5-1.5B: the base model's config.json
        # says 131072 positions for 1.5B, 32768 for 0.5B)
        "qwen2.5-0.5b": mk("qwen2.5-0.5b", 151936, 896, 24, 14, 2, 4864, True, 32768),
        "qwen2.5-1.5b": mk("qwen2.5-1.5b", 151936, 1536, 28, 12, 2, 8960, True, 131072),
        "qwen2-tiny": mk("qwen2-tiny", 512, 256, 2, 4, 2, 512, True, 1024),
    }


@register_family(architectures=("Qwen2ForCausalLM",), model_types=("qwen2",), presets=_presets,
                 real_presets=("qwen2.5-0.5b", "qwen2.5-1.5b"))
@dataclass(frozen=True, kw_only=True)
class Qwen2Config(DenseConfig):
    family = "qwen2"
    gguf_arch = "qwen2"
    qkv_bias = True
    refused_flags = ("mlp_bias",)  # q/k/v biases are Qwen2's own; sliding window checked below

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> Qwen2Config:
        if as_bool(d, "use_sliding_window"):
            raise ConfigError("unsupported use_sliding_window=true (Qwen2 sliding-window "
                              "attention is not implemented)")
        return super().from_hf_dict(d, name)  # type: ignore[return-value]

    def to_hf_dict(self) -> dict[str, Any]:
        return {**super().to_hf_dict(), "use_sliding_window": False}
