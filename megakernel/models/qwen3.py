"""Qwen3 (Qwen3ForCausalLM): dense attention with per-head q/k RMSNorm before RoPE, SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megakernel.models.config import RopeConfig
from megakernel.models.dense import DenseConfig
from megakernel.models.registry import register_family


def _presets() -> dict[str, Qwen3Config]:
    def mk(name: str, v: int, h: int, n: int, hq: int, hkv: int, d: int, i: int, tie: bool,
           max_pos: int) -> Qwen3Config:
        return Qwen3Config(vocab_size=v, hidden_size=h, num_layers=n, num_heads=hq,
                           num_kv_heads=hkv, head_dim=d, intermediate_size=i, rms_norm_eps=1e-6,
                           rope=RopeConfig(1e6), tie_word_embeddings=tie,
                           max_position_embeddings=max_pos, name=name)

    return {
        # real published shapes (Qwen/Qwen3-0.6B, 1.7B, 8B)
        "qwen3-0.6b": mk("qwen3-0.6b", 151936, 1024, 28, 16, 8, 128, 3072, True, 40960),
        "qwen3-1.7b": mk("qwen3-1.7b", 151936, 2048, 28, 16, 8, 128, 6144, True, 40960),
        "qwen3-8b": mk("qwen3-8b", 151936, 4096, 36, 32, 8, 128, 12288, False, 40960),
        "qwen3-tiny": mk("qwen3-tiny", 512, 256, 2, 4, 1, 128, 512, False, 1024),
    }


@register_family(architectures=("Qwen3ForCausalLM",), model_types=("qwen3",), presets=_presets,
                 real_presets=("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"))
@dataclass(frozen=True, kw_only=True)
class Qwen3Config(DenseConfig):
    family = "qwen3"
    gguf_arch = "qwen3"
    qk_norm = True

    def to_hf_dict(self) -> dict[str, Any]:
        return {**super().to_hf_dict(), "attention_bias": False}
