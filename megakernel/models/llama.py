"""Llama (LlamaForCausalLM): dense attention + SwiGLU, llama3 RoPE scaling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megakernel.models.config import RopeConfig
from megakernel.models.dense import DenseConfig
from megakernel.models.registry import register_family

_ROPE_1B = RopeConfig(5e5, "llama3", 32.0, 1.0, 4.0, 8192)
_ROPE_8B = RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 8192)


def _presets() -> dict[str, LlamaConfig]:
    def mk(name: str, v: int, h: int, n: int, hq: int, hkv: int, d: int, i: int,
           rope: RopeConfig, tie: bool, max_pos: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=v, hidden_size=h, num_layers=n, num_heads=hq,
                           num_kv_heads=hkv, head_dim=d, intermediate_size=i, rms_norm_eps=1e-5,
                           rope=rope, tie_word_embeddings=tie, max_position_embeddings=max_pos,
                           name=name)

    return {
        # real published shapes (meta-llama/Llama-3.2-1B, Llama-3.1-8B)
        "llama-3.2-1b": mk("llama-3.2-1b", 128256, 2048, 16, 32, 8, 64, 8192, _ROPE_1B, True,
                           131072),
        "llama-3.1-8b": mk("llama-3.1-8b", 128256, 4096, 32, 32, 8, 128, 14336, _ROPE_8B, False,
                           131072),
        # tiny shapes for tests and the CPU demo; mid-size (hidden >= 1024) for executor tests
        "llama-tiny": mk("llama-tiny", 512, 256, 2, 4, 2, 64, 512,
                         RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 64), True, 1024),
        "llama-mid": mk("llama-mid", 2048, 1024, 2, 16, 4, 64, 2816,
                        RopeConfig(5e5, "llama3", 32.0, 1.0, 4.0, 256), True, 2048),
    }


@register_family(architectures=("LlamaForCausalLM",), model_types=("llama",),
                 presets=_presets, real_presets=("llama-3.2-1b", "llama-3.1-8b"))
@dataclass(frozen=True, kw_only=True)
class LlamaConfig(DenseConfig):
    family = "llama"
    gguf_arch = "llama"

    def from_gguf_tensor(self, name: str, t: Any) -> Any:
        """llama.cpp stores q/k projection rows of each head with the two rotary halves
        interleaved (its RoPE pairs neighbours); put the halves back (rows of head h: pair i of
        the GGUF order is rows 2i, 2i + 1 -> rows i and i + d/2)."""
        for proj, heads in (("self_attn.q_proj.", self.num_heads),
                            ("self_attn.k_proj.", self.num_kv_heads)):
            if proj in name:
                rows = t.shape[0]
                return (t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2)
                        .reshape(t.shape))
        return t

    def to_hf_dict(self) -> dict[str, Any]:
        return {**super().to_hf_dict(), "attention_bias": False}
