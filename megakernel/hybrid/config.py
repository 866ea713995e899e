"""Model configurations for the hybrid families: Qwen3.5 (text), Kimi Linear and Nemotron-H.

One frozen dataclass per family, built from a Hugging Face `config.json` (dict or directory) or from
a named preset with the real published shapes. Each layer has a *mixer* (what mixes tokens) and,
for Qwen3.5 and Kimi, an FFN; Nemotron-H instead has one block per layer whose mixer may itself be
an MLP. Mixer kinds:

    "attention"  softmax attention over a KV cache (Qwen3.5: gated, (1+w) q/k norm, partial RoPE;
                 Nemotron-H: plain GQA without RoPE)
    "gdn"        gated delta rule (Qwen3.5 `linear_attention`)
    "kda"        Kimi delta attention, channel-wise decay (Kimi `linear_attention`)
    "mla"        multi-head latent attention with the latent cache (Kimi `full_attention`)
    "mamba2"     Mamba2 SSD layer (Nemotron-H `M` / `linear_attention`)
    "mlp"        Nemotron-H MLP block (relu^2, no gate)
FFN kinds: "mlp" (SwiGLU), "moe" (routed SwiGLU experts plus shared experts), "none".

Anything not implemented (Nemotron-H MoE blocks, RoPE in MLA, other activations, biases) is refused
here by name with a `ConfigError`, rather than computed wrongly later.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megakernel.config import ConfigError

FAMILIES = ("qwen3_5", "kimi_linear", "nemotron_h")
MIXER_KINDS = ("attention", "gdn", "kda", "mla", "mamba2", "mlp")
RECURRENT_KINDS = ("gdn", "kda", "mamba2")


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{type(obj).__name__}.{n} must be a positive integer, got {v!r}")


# ---- mixer configs -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionConfig:
    """Softmax attention. Qwen3.5: q_proj gives [q | gate] per head, (1+w) q/k RMSNorm, RoPE on the
    first `rotary_dim` dims, output times sigmoid(gate). Nemotron-H: none of these."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int = 0  # 0: no RoPE
    rope_theta: float = 10000.0
    qk_norm: bool = False  # (1 + w) RMSNorm per head on q and k
    output_gate: bool = False  # q_proj has a second half: the sigmoid gate

    def __post_init__(self) -> None:
        _positive(self, "num_heads", "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.rotary_dim < 0 or self.rotary_dim > self.head_dim or self.rotary_dim % 2:
            raise ConfigError(
                f"rotary_dim must be even and in [0, head_dim={self.head_dim}], got "
                f"{self.rotary_dim}"
            )

    def inv_freq(self) -> list[float]:
        """Inverse frequencies [rotary_dim / 2] in float64 (default RoPE)."""
        r = self.rotary_dim
        return [1.0 / (self.rope_theta ** (2 * i / r)) for i in range(r // 2)]


@dataclass(frozen=True)
class GDNConfig:
    """Gated delta rule (Qwen3.5). Value head h reads key head h // (num_v_heads / num_k_heads)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        _positive(self, "num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim")
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        if self.conv_kernel < 2:
            raise ConfigError(f"conv kernel must be >= 2, got {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: [q | k | v]."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class KDAConfig:
    """Kimi delta attention: q, k, v each num_heads x head_dim, channel-wise decay."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        _positive(self, "num_heads", "head_dim")
        if self.conv_kernel < 2:
            raise ConfigError(f"conv kernel must be >= 2, got {self.conv_kernel}")

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.qkv_dim


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 SSD mixer: in_proj -> [z | xBC | dt], conv over xBC, state [H, P, N] per head."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int = 4
    use_conv_bias: bool = True
    # Lower clamp on dt in the chunked (prefill) path, as HF's mixer does (time_step_min); the
    # single-token update (HF and mamba_ssm alike) does not clamp.
    dt_min: float = 0.0

    def __post_init__(self) -> None:
        _positive(self, "num_heads", "head_dim", "state_size", "n_groups")
        if self.num_heads % self.n_groups:
            raise ConfigError(
                f"mamba_num_heads ({self.num_heads}) must be a multiple of n_groups "
                f"({self.n_groups})"
            )
        if self.conv_kernel < 2:
            raise ConfigError(f"conv kernel must be >= 2, got {self.conv_kernel}")

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: [x (d_inner) | B (G*N) | C (G*N)]."""
        return self.d_inner + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        return self.d_inner + self.conv_dim + self.num_heads


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (Kimi). The cache holds (c, k_rope); HF applies no RoPE."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        _positive(
            self, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"
        )
        if self.q_lora_rank is not None:
            _positive(self, "q_lora_rank")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed SwiGLU experts with sigmoid, bias-corrected, group-limited top-k routing plus
    always-on shared experts (Kimi / DeepSeek-V3 style)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    num_shared_experts: int = 1  # shared MLP width = intermediate_size * num_shared_experts
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        _positive(self, "num_experts", "top_k", "intermediate_size", "n_group", "topk_group")
        if self.num_shared_experts < 0:
            raise ConfigError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.num_experts % self.n_group:
            raise ConfigError(
                f"num_experts ({self.num_experts}) must be a multiple of n_group ({self.n_group})"
            )
        if self.num_experts // self.n_group < 2:
            raise ConfigError("group-limited routing needs at least 2 experts per group")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) > n_group ({self.n_group})")
        if self.top_k > self.num_experts // self.n_group * self.topk_group:
            raise ConfigError(
                f"top_k ({self.top_k}) exceeds the experts in the {self.topk_group} chosen groups"
            )


# ---- family configs ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Fields every hybrid family shares. `layer_types[i]` is the mixer of layer i (MIXER_KINDS)."""

    family: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unsupported hybrid family {self.family!r}; supported: {FAMILIES}")
        _positive(self, "vocab_size", "hidden_size", "max_position_embeddings")
        if not self.layer_types:
            raise ConfigError("a model needs at least one layer")
        for i, t in enumerate(self.layer_types):
            if t not in self.allowed_mixers():
                raise ConfigError(
                    f"layer {i}: unsupported layer type {t!r} for {self.family}; supported: "
                    f"{', '.join(self.allowed_mixers())}"
                )
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")

    @classmethod
    def allowed_mixers(cls) -> tuple[str, ...]:
        return MIXER_KINDS

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def ffn_type(self, i: int) -> str:
        """FFN after the mixer of layer i: "mlp", "moe" or "none"."""
        return "none"

    def recurrent_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t in RECURRENT_KINDS]

    def replace(self, **changes: Any) -> HybridConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class Qwen35Config(HybridConfig):
    """Qwen3.5 text decoder (dense MLP): GDN layers and gated full-attention layers; all RMSNorms
    are the (1 + w) form except the GDN output norm."""

    family: str = "qwen3_5"
    intermediate_size: int
    attention: AttentionConfig
    gdn: GDNConfig

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "intermediate_size")
        if not (self.attention.qk_norm and self.attention.output_gate):
            raise ConfigError("Qwen3.5 attention has q/k norm and an output gate")

    @classmethod
    def allowed_mixers(cls) -> tuple[str, ...]:
        return ("gdn", "attention")

    def ffn_type(self, i: int) -> str:
        return "mlp"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> Qwen35Config:
        """From a `qwen3_5_text` dict, or a `qwen3_5` dict with the text model in `text_config`."""
        top = d
        if d.get("model_type") == "qwen3_5" or "text_config" in d:
            if not isinstance(d.get("text_config"), dict):
                raise ConfigError("qwen3_5 config has no text_config")
            d = d["text_config"]
        mt = d.get("model_type", "qwen3_5_text")
        if mt != "qwen3_5_text":
            raise ConfigError(
                f"unsupported Qwen3.5 text model_type {mt!r} (only dense qwen3_5_text)")
        _refuse(d, hidden_act="silu", attention_bias=False)
        if d.get("num_experts"):
            raise ConfigError("Qwen3.5 MoE text models are not supported (num_experts > 0)")
        if d.get("attn_output_gate", True) is not True:
            raise ConfigError("unsupported attn_output_gate=false (Qwen3.5 always gates attention)")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"unsupported rope type {rope_type!r} for Qwen3.5; only 'default'")
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        prf = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
        try:
            n = int(d["num_hidden_layers"])
            layer_types = d.get("layer_types")
            if layer_types is None:
                interval = int(d.get("full_attention_interval", 4))
                layer_types = [
                    "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                    for i in range(n)
                ]
            head_dim = int(d.get("head_dim") or 256)
            tie = top.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                layer_types=_map_types(layer_types, n, {
                    "linear_attention": "gdn", "full_attention": "attention"}),
                intermediate_size=int(d["intermediate_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(tie),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                attention=AttentionConfig(
                    num_heads=int(d["num_attention_heads"]),
                    num_kv_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
                    head_dim=head_dim,
                    rotary_dim=int(head_dim * prf) // 2 * 2,
                    rope_theta=theta,
                    qk_norm=True,
                    output_gate=True,
                ),
                gdn=GDNConfig(
                    num_k_heads=int(d.get("linear_num_key_heads", 16)),
                    num_v_heads=int(d.get("linear_num_value_heads", 32)),
                    k_head_dim=int(d.get("linear_key_head_dim", 128)),
                    v_head_dim=int(d.get("linear_value_head_dim", 128)),
                    conv_kernel=int(d.get("linear_conv_kernel_dim", 4)),
                ),
                name=name,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing required field {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        a, g = self.attention, self.gdn
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": a.num_heads,
            "num_key_value_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": a.rope_theta,
                "partial_rotary_factor": a.rotary_dim / a.head_dim,
            },
            "layer_types": [
                "linear_attention" if t == "gdn" else "full_attention" for t in self.layer_types
            ],
            "linear_num_key_heads": g.num_k_heads,
            "linear_num_value_heads": g.num_v_heads,
            "linear_key_head_dim": g.k_head_dim,
            "linear_value_head_dim": g.v_head_dim,
            "linear_conv_kernel_dim": g.conv_kernel,
        }


@dataclass(frozen=True, kw_only=True)
class KimiLinearConfig(HybridConfig):
    """Kimi Linear: KDA and MLA layers; the first `first_k_dense` layers have a dense SwiGLU MLP,
    the rest an MoE with shared experts."""

    family: str = "kimi_linear"
    intermediate_size: int  # dense MLP
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    first_k_dense: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "intermediate_size")
        if self.first_k_dense < 0:
            raise ConfigError(f"first_k_dense_replace must be >= 0, got {self.first_k_dense}")

    @classmethod
    def allowed_mixers(cls) -> tuple[str, ...]:
        return ("kda", "mla")

    def ffn_type(self, i: int) -> str:
        return "mlp" if i < self.first_k_dense else "moe"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> KimiLinearConfig:
        _refuse(d, hidden_act="silu", attention_bias=False, pretraining_tp=1)
        if d.get("mla_use_nope", True) is not True:
            raise ConfigError(
                "unsupported mla_use_nope=false: MLA with RoPE is not implemented (the HF "
                "KimiLinear model applies no RoPE)"
            )
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ConfigError(
                f"unsupported moe_router_activation_func {d['moe_router_activation_func']!r}; "
                "only 'sigmoid'"
            )
        if int(d.get("moe_layer_freq", 1)) != 1:
            raise ConfigError(f"unsupported moe_layer_freq={d['moe_layer_freq']!r}; only 1")
        if int(d.get("num_nextn_predict_layers", 0) or 0):
            raise ConfigError("unsupported num_nextn_predict_layers > 0 (MTP layers)")
        lin = dict(d.get("linear_attn_config") or {})
        extra = sorted(set(lin) - {"head_dim", "num_heads", "short_conv_kernel_size",
                                   "kda_layers", "full_attn_layers"})
        if extra:
            raise ConfigError(f"unsupported linear_attn_config fields: {', '.join(extra)}")
        try:
            n = int(d["num_hidden_layers"])
            heads = int(d["num_attention_heads"])
            kv_heads = d.get("num_key_value_heads") or heads
            if int(kv_heads) != heads:
                raise ConfigError(
                    f"MLA needs num_key_value_heads == num_attention_heads, got {kv_heads} and "
                    f"{heads}"
                )
            layer_types = d.get("layer_types")
            if layer_types is None:
                if "kda_layers" in lin and "full_attn_layers" in lin:
                    layer_types = [None] * n
                    for i in lin["full_attn_layers"]:
                        _check_index(i, n, "full_attn_layers")
                        layer_types[i - 1] = "full_attention"
                    for i in lin["kda_layers"]:
                        _check_index(i, n, "kda_layers")
                        layer_types[i - 1] = "linear_attention"
                else:
                    layer_types = [
                        "full_attention" if i and i % 4 == 0 else "linear_attention"
                        for i in range(n)
                    ]
            first_dense = d.get("first_k_dense_replace")
            if first_dense is None:
                mlp_types = d.get("mlp_layer_types")
                if mlp_types is not None:
                    first_dense = sum(1 for _ in _prefix(mlp_types, "dense"))
                    if any(t != "sparse" for t in mlp_types[first_dense:]):
                        raise ConfigError(f"unsupported mlp_layer_types {mlp_types!r}")
                else:
                    first_dense = 1
            experts = int(_first(d, "num_experts", "num_local_experts", default=256))
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                layer_types=_map_types(layer_types, n, {
                    "linear_attention": "kda", "full_attention": "mla"}),
                intermediate_size=int(d["intermediate_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(
                    _first(d, "model_max_length", "max_position_embeddings", default=1048576)),
                kda=KDAConfig(
                    num_heads=int(lin.get("num_heads", d.get("linear_num_heads", 32))),
                    head_dim=int(lin.get("head_dim", d.get("linear_head_dim", 128))),
                    conv_kernel=int(lin.get("short_conv_kernel_size",
                                            d.get("linear_conv_kernel_dim", 4))),
                ),
                mla=MLAConfig(
                    num_heads=heads,
                    kv_lora_rank=int(d.get("kv_lora_rank", 512)),
                    qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)),
                    qk_rope_head_dim=int(d.get("qk_rope_head_dim", 64)),
                    v_head_dim=int(d.get("v_head_dim") or 128),
                    q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
                ),
                moe=MoEConfig(
                    num_experts=experts,
                    top_k=int(_first(d, "num_experts_per_token", "num_experts_per_tok", default=8)),
                    intermediate_size=int(d.get("moe_intermediate_size", 1024)),
                    num_shared_experts=int(
                        _first(d, "num_shared_experts", "n_shared_experts", default=1)),
                    routed_scaling_factor=float(d.get("routed_scaling_factor", 2.446)),
                    n_group=int(_first(d, "num_expert_group", "n_group", default=1)),
                    topk_group=int(d.get("topk_group") or 1),
                    norm_topk_prob=bool(_first(d, "moe_renormalize", "norm_topk_prob",
                                               default=True)),
                ),
                first_k_dense=int(first_dense),
                name=name,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing required field {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        k, m, e = self.kda, self.mla, self.moe
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_heads,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "model_max_length": self.max_position_embeddings,
            "kv_lora_rank": m.kv_lora_rank,
            "q_lora_rank": m.q_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim,
            "mla_use_nope": True,
            "num_experts": e.num_experts,
            "num_experts_per_token": e.top_k,
            "moe_intermediate_size": e.intermediate_size,
            "num_shared_experts": e.num_shared_experts,
            "routed_scaling_factor": e.routed_scaling_factor,
            "num_expert_group": e.n_group,
            "topk_group": e.topk_group,
            "moe_renormalize": e.norm_topk_prob,
            "moe_router_activation_func": "sigmoid",
            "first_k_dense_replace": self.first_k_dense,
            "linear_attn_config": {
                "head_dim": k.head_dim,
                "num_heads": k.num_heads,
                "short_conv_kernel_size": k.conv_kernel,
                "kda_layers": [i + 1 for i, t in enumerate(self.layer_types) if t == "kda"],
                "full_attn_layers": [i + 1 for i, t in enumerate(self.layer_types) if t == "mla"],
            },
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
        }


@dataclass(frozen=True, kw_only=True)
class NemotronHConfig(HybridConfig):
    """Nemotron-H: one block per layer (RMSNorm -> mixer -> residual); mixers are Mamba2, attention
    (GQA, no RoPE) and relu^2 MLP. MoE blocks are not supported."""

    family: str = "nemotron_h"
    intermediate_size: int
    attention: AttentionConfig
    mamba2: Mamba2Config

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, "intermediate_size")
        a = self.attention
        if a.rotary_dim or a.qk_norm or a.output_gate:
            raise ConfigError("Nemotron-H attention has no RoPE, q/k norm or output gate")

    @classmethod
    def allowed_mixers(cls) -> tuple[str, ...]:
        return ("mamba2", "attention", "mlp")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> NemotronHConfig:
        _refuse(d, attention_bias=False, mlp_bias=False, use_bias=False, mamba_proj_bias=False)
        if d.get("mlp_hidden_act", "relu2") != "relu2":
            raise ConfigError(f"unsupported mlp_hidden_act {d['mlp_hidden_act']!r}; only 'relu2'")
        if d.get("mamba_hidden_act", "silu") != "silu":
            raise ConfigError(
                f"unsupported mamba_hidden_act {d['mamba_hidden_act']!r}; only 'silu'")
        if d.get("sliding_window"):
            raise ConfigError(f"unsupported sliding_window={d['sliding_window']!r}")
        types = d.get("layers_block_type") or d.get("layer_types")
        if types is None:
            pattern = d.get("hybrid_override_pattern")
            if pattern is None:
                raise ConfigError(
                    "config has neither layers_block_type nor hybrid_override_pattern")
            codes = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
            bad = sorted(set(pattern) - set(codes))
            if bad:
                raise ConfigError(f"unknown hybrid_override_pattern symbols {bad}")
            types = [codes[c] for c in pattern]
        legacy = {"mamba": "linear_attention", "attention": "full_attention"}
        types = [legacy.get(t, t) for t in types]
        mapping = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "mlp"}
        for i, t in enumerate(types):
            if t == "moe":
                raise ConfigError(
                    f"layer {i}: unsupported layer type 'moe' (Nemotron-H MoE blocks are not "
                    "implemented); supported: mamba2 (M), attention (*), mlp (-)"
                )
        tie = bool(d.get("tie_word_embeddings", False))
        if tie:
            raise ConfigError("unsupported tie_word_embeddings=true for Nemotron-H (HF never ties)")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            head_dim = int(d.get("head_dim") or d.get("attention_head_dim") or hidden // heads)
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                layer_types=_map_types(types, len(types), mapping),
                intermediate_size=int(d["intermediate_size"]),
                rms_norm_eps=float(_first(d, "layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
                tie_word_embeddings=False,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                attention=AttentionConfig(
                    num_heads=heads,
                    num_kv_heads=int(d.get("num_key_value_heads") or heads),
                    head_dim=head_dim,
                ),
                mamba2=Mamba2Config(
                    num_heads=int(d.get("mamba_num_heads", 128)),
                    head_dim=int(d.get("mamba_head_dim", 64)),
                    state_size=int(_first(d, "ssm_state_size", "mamba_d_state", default=128)),
                    n_groups=int(_first(d, "n_groups", "mamba_n_groups", default=8)),
                    conv_kernel=int(_first(d, "conv_kernel", "mamba_d_conv", default=4)),
                    use_conv_bias=bool(_first(d, "use_conv_bias", "mamba_conv_bias",
                                              default=True)),
                    dt_min=float(_first(d, "time_step_min", "mamba_dt_min", default=0.001)),
                ),
                name=name,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing required field {e.args[0]!r}") from None

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


# ---- parsing helpers ---------------------------------------------------------------------------
def _refuse(d: dict[str, Any], **expected: Any) -> None:
    """ConfigError when a field is present with a value other than the one we implement."""
    for k, want in expected.items():
        if k in d and d[k] is not None and d[k] != want:
            raise ConfigError(f"unsupported config field {k}={d[k]!r}; only {want!r}")


def _first(d: dict[str, Any], *keys: str, default: Any) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def _prefix(items: list[str], value: str):
    for x in items:
        if x != value:
            return
        yield x


def _check_index(i: Any, n: int, field: str) -> None:
    if not isinstance(i, int) or not 1 <= i <= n:
        raise ConfigError(f"linear_attn_config.{field} entry {i!r} is not a layer in 1..{n}")


def _map_types(types: list[Any], n: int, mapping: dict[str, str]) -> tuple[str, ...]:
    if len(types) != n:
        raise ConfigError(f"layer types list has {len(types)} entries for {n} layers")
    out = []
    for i, t in enumerate(types):
        if t not in mapping:
            raise ConfigError(
                f"layer {i}: unsupported layer type {t!r}; supported: {', '.join(mapping)}")
        out.append(mapping[t])
    return tuple(out)


_ARCH = {
    "Qwen3_5ForCausalLM": Qwen35Config,
    "Qwen3_5ForConditionalGeneration": Qwen35Config,
    "KimiLinearForCausalLM": KimiLinearConfig,
    "NemotronHForCausalLM": NemotronHConfig,
}
_MODEL_TYPE = {
    "qwen3_5": Qwen35Config,
    "qwen3_5_text": Qwen35Config,
    "kimi_linear": KimiLinearConfig,
    "nemotron_h": NemotronHConfig,
}


def config_from_hf_dict(d: dict[str, Any], name: str = "") -> HybridConfig:
    """Dispatch on `architectures` (first) or `model_type` to the family's parser."""
    cls = None
    for arch in d.get("architectures") or []:
        if arch not in _ARCH:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported hybrid architectures: "
                f"{', '.join(sorted(_ARCH))}"
            )
        cls = _ARCH[arch]
    if cls is None:
        mt = d.get("model_type")
        if mt not in _MODEL_TYPE:
            raise ConfigError(
                f"unsupported model_type {mt!r}; supported hybrid model types: "
                f"{', '.join(sorted(_MODEL_TYPE))}"
            )
        cls = _MODEL_TYPE[mt]
    return cls.from_hf_dict(d, name=name)


def config_from_hf_dir(path: str | Path) -> HybridConfig:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json in {path}")
    return config_from_hf_dict(json.loads(p.read_text()), name=Path(path).name)


# ---- presets -----------------------------------------------------------------------------------
def _qwen35(name: str, vocab: int, hidden: int, layers: int, inter: int, heads: int, kv: int,
            head_dim: int, vk: int, vv: int, dk: int, dv: int, tie: bool, max_pos: int,
            theta: float = 1e7, interval: int = 4) -> Qwen35Config:
    return Qwen35Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        layer_types=tuple("attention" if (i + 1) % interval == 0 else "gdn" for i in range(layers)),
        rms_norm_eps=1e-6, tie_word_embeddings=tie, max_position_embeddings=max_pos,
        attention=AttentionConfig(heads, kv, head_dim, head_dim // 4, theta, True, True),
        gdn=GDNConfig(vk, vv, dk, dv, 4), name=name,
    )


_KIMI_48B_MLA = (4, 8, 12, 16, 20, 24, 27)  # 1-indexed full-attention layers (the rest are KDA)

PRESETS: dict[str, HybridConfig] = {
    # Qwen3.5 dense text decoders (Qwen/Qwen3.5-{0.8B,2B,4B,9B}, text_config of config.json)
    "qwen3.5-0.8b": _qwen35("qwen3.5-0.8b", 248320, 1024, 24, 3584, 8, 2, 256, 16, 16, 128, 128,
                            True, 262144),
    "qwen3.5-2b": _qwen35("qwen3.5-2b", 248320, 2048, 24, 6144, 8, 2, 256, 16, 16, 128, 128,
                          True, 262144),
    "qwen3.5-4b": _qwen35("qwen3.5-4b", 248320, 2560, 32, 9216, 16, 4, 256, 16, 32, 128, 128,
                          True, 262144),
    "qwen3.5-9b": _qwen35("qwen3.5-9b", 248320, 4096, 32, 12288, 16, 4, 256, 16, 32, 128, 128,
                          False, 262144),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct
    "kimi-linear-48b-a3b": KimiLinearConfig(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216,
        layer_types=tuple("mla" if i + 1 in _KIMI_48B_MLA else "kda" for i in range(27)),
        rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=1048576,
        kda=KDAConfig(32, 128, 4), mla=MLAConfig(32, 512, 128, 64, 128, None),
        moe=MoEConfig(256, 8, 1024, 1, 2.446, 1, 1, True), first_k_dense=1,
        name="kimi-linear-48b-a3b",
    ),
    # nvidia/Nemotron-H-8B-Base-8K
    "nemotron-h-8b": NemotronHConfig(
        vocab_size=131072, hidden_size=4096, intermediate_size=21504,
        layer_types=_map_types(
            list("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"), 52,
            {"M": "mamba2", "*": "attention", "-": "mlp"}),
        rms_norm_eps=1e-5, max_position_embeddings=8192,
        attention=AttentionConfig(32, 8, 128),
        mamba2=Mamba2Config(128, 64, 128, 8, 4, True, 0.001), name="nemotron-h-8b",
    ),
    # tiny shapes for tests and the CPU demo
    "qwen3.5-tiny": Qwen35Config(
        vocab_size=256, hidden_size=64, intermediate_size=128,
        layer_types=("gdn", "gdn", "attention", "gdn"), rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=512,
        attention=AttentionConfig(4, 2, 32, 8, 1e6, True, True),
        gdn=GDNConfig(2, 4, 16, 8, 4), name="qwen3.5-tiny",
    ),
    "kimi-linear-tiny": KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128,
        layer_types=("kda", "mla", "kda"), rms_norm_eps=1e-5, max_position_embeddings=512,
        kda=KDAConfig(2, 16, 4), mla=MLAConfig(4, 32, 16, 8, 16, None),
        moe=MoEConfig(8, 3, 32, 1, 2.446, 4, 2, True), first_k_dense=1, name="kimi-linear-tiny",
    ),
    "nemotron-h-tiny": NemotronHConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128,
        layer_types=("mamba2", "mlp", "attention", "mamba2", "mlp"), rms_norm_eps=1e-5,
        max_position_embeddings=512, attention=AttentionConfig(4, 2, 16),
        mamba2=Mamba2Config(8, 8, 16, 2, 4, True, 0.001), name="nemotron-h-tiny",
    ),
}

REAL_PRESETS = ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "kimi-linear-48b-a3b",
                "nemotron-h-8b")


def preset(name: str) -> HybridConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown hybrid preset {name!r}; known: {', '.join(PRESETS)}") from None


def is_hybrid(spec: str) -> bool:
    """Whether `spec` (a preset name or checkpoint directory) names a hybrid model."""
    if spec in PRESETS:
        return True
    p = Path(spec) / "config.json"
    if not p.is_file():
        return False
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return False
    archs = d.get("architectures") or []
    return any(a in _ARCH for a in archs) or (not archs and d.get("model_type") in _MODEL_TYPE)


def resolve_hybrid(spec: str) -> HybridConfig:
    """A hybrid preset name or a Hugging Face checkpoint directory."""
    if spec in PRESETS:
        return PRESETS[spec]
    if Path(spec).is_dir():
        return config_from_hf_dir(spec)
    raise ConfigError(
        f"{spec!r} is neither a hybrid preset ({', '.join(PRESETS)}) nor a directory")
