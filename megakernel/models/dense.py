"""Dense decoder-only transformers (Llama, Qwen3, Qwen2): a stack of attention and SwiGLU blocks.

The families differ in a few attention flags (q/k norm, q/k/v biases) and in their Hugging Face
names; this module holds the shared hyperparameters, the block composition and the Hugging Face
parsing, and each family module subclasses `DenseConfig` with its flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from megakernel.layers.attention import AttentionConfig
from megakernel.layers.swiglu import SwiGLUConfig
from megakernel.models.config import (
    Block,
    ConfigError,
    ModelConfig,
    RopeConfig,
    as_bool,
    as_float,
    as_int,
    as_list,
    decoder_layer,
    map_types,
    positive,
    rope_from_hf,
    rope_to_hf,
)


@dataclass(frozen=True, kw_only=True)
class DenseConfig(ModelConfig):
    """Shapes and constants of one dense decoder-only model."""

    # dense families draw q/k projections and norms at QK_GAIN and residual outputs at
    # RESIDUAL_GAIN (models/weights.py): attention sharp enough that greedy decoding of random
    # weights stays varied
    qk_gain: ClassVar[float] = 2.0
    residual_gain: ClassVar[float] = 2.0
    qk_norm: ClassVar[bool] = False
    qkv_bias: ClassVar[bool] = False
    # Hugging Face fields a family does not implement: refused when set (truthy)
    refused_flags: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias", "use_sliding_window")

    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)

    def __post_init__(self) -> None:
        positive(self, "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        super().__post_init__()

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(self.num_heads, self.num_kv_heads, self.head_dim,
                               rotary_dim=self.head_dim, rope=self.rope, qk_norm=self.qk_norm,
                               qkv_bias=self.qkv_bias)

    group_size = property(lambda self: self.attention.group_size)  # query heads per kv head
    q_size = property(lambda self: self.attention.q_size)
    kv_size = property(lambda self: self.attention.kv_size)

    def make_blocks(self) -> tuple[Block, ...]:
        att, mlp = self.attention, SwiGLUConfig(self.intermediate_size)
        return tuple(b for i in range(self.num_layers) for b in decoder_layer(
            i, ("attn", "attention", att, "self_attn."), ("mlp", "swiglu", mlp, "mlp.")))

    # ---- Hugging Face interop -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> DenseConfig:
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        for flag in cls.refused_flags:
            if as_bool(d, flag):
                raise ConfigError(f"unsupported config field {flag}={d[flag]!r}")
        if as_int(d, "pretraining_tp", 1) != 1:
            raise ConfigError(f"unsupported pretraining_tp={d['pretraining_tp']!r}")
        hidden = as_int(d, "hidden_size")
        heads = as_int(d, "num_attention_heads")
        if heads <= 0:
            raise ConfigError(f"num_attention_heads must be positive, got {heads}")
        layers = as_int(d, "num_hidden_layers")
        types = as_list(d, "layer_types")
        if types is not None:  # transformers 5 writes one per layer; only full attention is ours
            map_types(types, layers, {"full_attention": "attention"})
        return cls(
            vocab_size=as_int(d, "vocab_size"), hidden_size=hidden,
            num_layers=layers, num_heads=heads,
            num_kv_heads=as_int(d, "num_key_value_heads", heads),
            head_dim=as_int(d, "head_dim", hidden // heads),
            intermediate_size=as_int(d, "intermediate_size"),
            rms_norm_eps=as_float(d, "rms_norm_eps", 1e-6), rope=rope_from_hf(d),
            tie_word_embeddings=as_bool(d, "tie_word_embeddings"),
            max_position_embeddings=as_int(d, "max_position_embeddings", 8192), name=name)

    @classmethod
    def hf_dict_from_gguf(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's dense keys (`{arch}.block_count`, ...) and `GGUFMetadata.vocab`."""
        from megakernel.models.registry import family

        heads, hidden, head_dim = meta.attention()
        if meta.int("rope.dimension_count", head_dim) != head_dim:
            raise ConfigError(f"GGUF {meta.arch}.rope.dimension_count must equal the head size "
                              f"({head_dim}): partial rotary is not supported for {cls.family}")
        return {
            **meta.vocab(),
            "architectures": [family(cls.family).architectures[0]],
            "model_type": cls.family,
            "hidden_size": hidden,
            "num_hidden_layers": meta.int("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": meta.int("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "intermediate_size": meta.int("feed_forward_length"),
            "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon"),
            "rope_theta": meta.float("rope.freq_base", 10000.0),
            "max_position_embeddings": meta.int("context_length", 8192),
            "hidden_act": "silu",
        }

    def to_hf_dict(self) -> dict[str, Any]:
        from megakernel.models.registry import family

        return {
            "architectures": [family(self.family).architectures[0]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope.theta,
            "rope_parameters": rope_to_hf(self.rope),
        }
