"""Model configurations for the dense families (Llama, Qwen3).

A `ModelConfig` is the one description of a model that every layer of the project shares: the
reference, the weight loader, the program compiler and the kernel build. It is built from a Hugging
Face `config.json` (dict or directory) or from a named preset with the real published shapes.
Anything we do not implement is refused here, by name, rather than computed wrongly later.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config names an architecture, field value or shape that megakernel does not support."""


FAMILIES = ("llama", "qwen3")
_ARCH_TO_FAMILY = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPE_TO_FAMILY = {"llama": "llama", "qwen3": "qwen3"}
ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is "default" or "llama3" (Llama 3.1 scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.theta <= 0:
            raise ConfigError(f"rope theta must be positive, got {self.theta}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ConfigError(
                "llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )

    def inv_freq(self, head_dim: int) -> list[float]:
        """Inverse frequencies [head_dim // 2] in float64, with llama3 scaling applied."""
        inv = [1.0 / (self.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
        if self.rope_type == "default":
            return inv
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / self.factor)
            else:
                smooth = (old / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one dense decoder-only model."""

    family: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unsupported model family {self.family!r}; supported: {FAMILIES}")
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{f} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_norm(self) -> bool:
        """Qwen3 applies a per-head RMSNorm to q and k before RoPE."""
        return self.family == "qwen3"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count, counting a tied embedding once."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face interop -----------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a Hugging Face config dict (transformers 4.x or 5.x field names)."""
        family = None
        for arch in d.get("architectures") or []:
            if arch not in _ARCH_TO_FAMILY:
                raise ConfigError(
                    f"unsupported architecture {arch!r}; supported: {sorted(_ARCH_TO_FAMILY)}"
                )
            family = _ARCH_TO_FAMILY[arch]
        if family is None:
            mt = d.get("model_type")
            if mt not in _MODEL_TYPE_TO_FAMILY:
                raise ConfigError(
                    f"unsupported model_type {mt!r} (and no supported 'architectures' entry); "
                    f"supported: {sorted(_MODEL_TYPE_TO_FAMILY)}"
                )
            family = _MODEL_TYPE_TO_FAMILY[mt]

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if d.get(flag):
                raise ConfigError(f"unsupported config field {flag}={d[flag]!r}")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ConfigError(f"unsupported pretraining_tp={d['pretraining_tp']!r}")

        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            head_dim = int(d.get("head_dim") or hidden // heads)
            cfg = cls(
                family=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                intermediate_size=int(d["intermediate_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_hf(d),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
                name=name,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing required field {e.args[0]!r}") from None
        return cfg

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"no config.json in {path}")
        return cls.from_hf_dict(json.loads(p.read_text()), name=Path(path).name)

    def to_hf_dict(self) -> dict[str, Any]:
        """The equivalent Hugging Face config dict (for save_pretrained and the oracle tests)."""
        arch = {v: k for k, v in _ARCH_TO_FAMILY.items()}[self.family]
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "llama3":
            rope.update(
                factor=self.rope.factor,
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        return {
            "architectures": [arch],
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
            "attention_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope.theta,
            "rope_parameters": rope,
        }


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    """RoPE settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "llama3":
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        return RopeConfig(theta=float(theta))
    try:
        return RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"llama3 rope parameters are missing {e.args[0]!r}") from None


# ---- presets -----------------------------------------------------------------------------------
_LLAMA3_ROPE_1B = RopeConfig(5e5, "llama3", 32.0, 1.0, 4.0, 8192)
_LLAMA3_ROPE_8B = RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    # real published shapes
    "llama-3.2-1b": ModelConfig("llama", 128256, 2048, 16, 32, 8, 64, 8192, 1e-5, _LLAMA3_ROPE_1B,
                                True, 131072, "llama-3.2-1b"),
    "llama-3.1-8b": ModelConfig("llama", 128256, 4096, 32, 32, 8, 128, 14336, 1e-5, _LLAMA3_ROPE_8B,
                                False, 131072, "llama-3.1-8b"),
    "qwen3-0.6b": ModelConfig("qwen3", 151936, 1024, 28, 16, 8, 128, 3072, 1e-6, RopeConfig(1e6),
                              True, 40960, "qwen3-0.6b"),
    "qwen3-1.7b": ModelConfig("qwen3", 151936, 2048, 28, 16, 8, 128, 6144, 1e-6, RopeConfig(1e6),
                              True, 40960, "qwen3-1.7b"),
    "qwen3-8b": ModelConfig("qwen3", 151936, 4096, 36, 32, 8, 128, 12288, 1e-6, RopeConfig(1e6),
                            False, 40960, "qwen3-8b"),
    # tiny shapes for tests and the CPU demo
    "llama-tiny": ModelConfig("llama", 512, 256, 2, 4, 2, 64, 512, 1e-5,
                              RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 64), True, 1024,
                              "llama-tiny"),
    "qwen3-tiny": ModelConfig("qwen3", 512, 256, 2, 4, 1, 128, 512, 1e-6, RopeConfig(1e6),
                              False, 1024, "qwen3-tiny"),
    # mid-size (hidden >= 1024) for executor tests
    "llama-mid": ModelConfig("llama", 2048, 1024, 2, 16, 4, 64, 2816, 1e-5,
                             RopeConfig(5e5, "llama3", 32.0, 1.0, 4.0, 256), True, 2048,
                             "llama-mid"),
}

REAL_PRESETS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b")


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def resolve_model(spec: str) -> ModelConfig:
    """A preset name or a Hugging Face checkpoint directory."""
    if spec in PRESETS:
        return PRESETS[spec]
    if Path(spec).is_dir():
        return ModelConfig.from_hf_dir(spec)
    from megakernel.hybrid.config import PRESETS as HYBRID_PRESETS

    raise ConfigError(
        f"{spec!r} is neither a preset (dense: {', '.join(PRESETS)}; hybrid: "
        f"{', '.join(HYBRID_PRESETS)}) nor a checkpoint directory"
    )
