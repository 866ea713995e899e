"""Kimi Linear (KimiLinearForCausalLM): KDA and MLA layers; a dense SwiGLU in the first
`first_k_dense` layers and an MoE with shared experts after that; plain RMSNorms.

Checkpoint names: KDA and MLA under `self_attn.`, the MoE under `block_sparse_moe.`, dense layers
under `mlp.` (save_pretrained writes them as `block_sparse_moe.*_proj`: both are accepted).

GGUF (llama.cpp's `kimi-linear`): recognised and refused (`hf_dict_from_gguf`), its tensors not
being one-to-one with the Hugging Face ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megakernel.layers.kda import KDAConfig
from megakernel.layers.mla import MLAConfig
from megakernel.layers.moe import MoEConfig
from megakernel.layers.swiglu import SwiGLUConfig
from megakernel.models.config import (
    Block,
    ConfigError,
    as_bool,
    as_dict,
    as_float,
    as_int,
    as_list,
    decoder_layer,
    first_key,
    map_types,
    positive,
    refuse,
)
from megakernel.models.layer_types import LayerTypesConfig
from megakernel.models.registry import register_family

_KIMI_48B_MLA = (4, 8, 12, 16, 20, 24, 27)  # 1-indexed full-attention layers (the rest are KDA)
_DENSE_MLP = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")


def _presets() -> dict[str, KimiLinearConfig]:
    return {
        # moonshotai/Kimi-Linear-48B-A3B-Instruct
        "kimi-linear-48b-a3b": KimiLinearConfig(
            vocab_size=163840, hidden_size=2304, intermediate_size=9216,
            layer_types=tuple("mla" if i + 1 in _KIMI_48B_MLA else "kda" for i in range(27)),
            rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=1048576,
            kda=KDAConfig(32, 128, 4), mla=MLAConfig(32, 512, 128, 64, 128, None),
            moe=MoEConfig(256, 8, 1024, 1, 2.446, 1, 1, True), first_k_dense=1,
            name="kimi-linear-48b-a3b"),
        "kimi-linear-tiny": KimiLinearConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128,
            layer_types=("kda", "mla", "kda"), rms_norm_eps=1e-5, max_position_embeddings=512,
            kda=KDAConfig(2, 16, 4), mla=MLAConfig(4, 32, 16, 8, 16, None),
            moe=MoEConfig(8, 3, 32, 1, 2.446, 4, 2, True), first_k_dense=1,
            name="kimi-linear-tiny"),
    }


def _prefix(items: list[str], value: str):  # noqa: ANN202
    for x in items:
        if x != value:
            return
        yield x


def _check_index(i: Any, n: int, field: str) -> None:
    if not isinstance(i, int) or isinstance(i, bool) or not 1 <= i <= n:
        raise ConfigError(f"linear_attn_config.{field} entry {i!r} is not a layer in 1..{n}")


@register_family(architectures=("KimiLinearForCausalLM",), model_types=("kimi_linear",),
                 presets=_presets, real_presets=("kimi-linear-48b-a3b",))
@dataclass(frozen=True, kw_only=True)
class KimiLinearConfig(LayerTypesConfig):
    family = "kimi_linear"
    gguf_arch = "kimi-linear"
    mixers = ("kda", "mla")

    intermediate_size: int  # dense MLP
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    first_k_dense: int = 1
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        positive(self, "intermediate_size")
        if self.first_k_dense < 0:
            raise ConfigError(f"first_k_dense_replace must be >= 0, got {self.first_k_dense}")
        super().__post_init__()

    def ffn_type(self, i: int) -> str:
        return "swiglu" if i < self.first_k_dense else "moe"

    def make_blocks(self) -> tuple[Block, ...]:
        ffns = {"swiglu": ("ffn", "swiglu", SwiGLUConfig(self.intermediate_size), "mlp."),
                "moe": ("ffn", "moe", self.moe, "block_sparse_moe.")}
        return tuple(b for i, t in enumerate(self.layer_types) for b in decoder_layer(
            i, ("mixer", t, self.kda if t == "kda" else self.mla, "self_attn."),
            ffns[self.ffn_type(i)]))

    @classmethod
    def canonical_name(cls, name: str) -> str | None:
        m = _DENSE_MLP.match(name)
        return m.group(1) + "mlp." + m.group(2) if m else super().canonical_name(name)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> KimiLinearConfig:
        refuse(d, hidden_act="silu", attention_bias=False, pretraining_tp=1)
        if not as_bool(d, "mla_use_nope", True):
            raise ConfigError(
                "unsupported mla_use_nope=false: MLA with RoPE is not implemented (the HF "
                "KimiLinear model applies no RoPE)"
            )
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ConfigError(
                f"unsupported moe_router_activation_func {d['moe_router_activation_func']!r}; "
                "only 'sigmoid'"
            )
        if as_int(d, "moe_layer_freq", 1) != 1:
            raise ConfigError(f"unsupported moe_layer_freq={d['moe_layer_freq']!r}; only 1")
        if as_int(d, "num_nextn_predict_layers", 0):
            raise ConfigError("unsupported num_nextn_predict_layers > 0 (MTP layers)")
        lin = as_dict(d, "linear_attn_config")
        extra = sorted(set(lin) - {"head_dim", "num_heads", "short_conv_kernel_size",
                                   "kda_layers", "full_attn_layers"})
        if extra:
            raise ConfigError(f"unsupported linear_attn_config fields: {', '.join(extra)}")
        n = as_int(d, "num_hidden_layers")
        heads = as_int(d, "num_attention_heads")
        kv_heads = as_int(d, "num_key_value_heads", heads)
        if kv_heads != heads:
            raise ConfigError(
                f"MLA needs num_key_value_heads == num_attention_heads, got {kv_heads} and "
                f"{heads}"
            )
        layer_types = as_list(d, "layer_types")
        if layer_types is None:
            if "kda_layers" in lin and "full_attn_layers" in lin:
                layer_types = [None] * n
                for field, t in (("full_attn_layers", "full_attention"),
                                 ("kda_layers", "linear_attention")):
                    entries = as_list(lin, field) or []
                    for i in entries:
                        _check_index(i, n, field)
                        layer_types[i - 1] = t
            else:
                layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                               for i in range(n)]
        first_dense = d.get("first_k_dense_replace")
        if first_dense is None:
            mlp_types = as_list(d, "mlp_layer_types")
            if mlp_types is not None:
                first_dense = sum(1 for _ in _prefix(mlp_types, "dense"))
                if any(t != "sparse" for t in mlp_types[first_dense:]):
                    raise ConfigError(f"unsupported mlp_layer_types {mlp_types!r}")
            else:
                first_dense = 1
        else:
            first_dense = as_int(d, "first_k_dense_replace")

        def num(kind: Any, *keys: str, default: Any = ...) -> Any:
            """The first present spelling of a field, read as `kind` (as_int / as_float)."""
            return kind(d, first_key(d, *keys), default)

        return cls(
            vocab_size=as_int(d, "vocab_size"),
            hidden_size=as_int(d, "hidden_size"),
            layer_types=map_types(layer_types, n, {
                "linear_attention": "kda", "full_attention": "mla"}),
            intermediate_size=as_int(d, "intermediate_size"),
            rms_norm_eps=as_float(d, "rms_norm_eps", 1e-5),
            tie_word_embeddings=as_bool(d, "tie_word_embeddings"),
            max_position_embeddings=num(as_int, "model_max_length", "max_position_embeddings",
                                        default=1048576),
            kda=KDAConfig(
                num_heads=as_int(lin, "num_heads", as_int(d, "linear_num_heads", 32)),
                head_dim=as_int(lin, "head_dim", as_int(d, "linear_head_dim", 128)),
                conv_kernel=as_int(lin, "short_conv_kernel_size",
                                   as_int(d, "linear_conv_kernel_dim", 4)),
            ),
            mla=MLAConfig(
                num_heads=heads,
                kv_lora_rank=as_int(d, "kv_lora_rank", 512),
                qk_nope_head_dim=as_int(d, "qk_nope_head_dim", 128),
                qk_rope_head_dim=as_int(d, "qk_rope_head_dim", 64),
                v_head_dim=as_int(d, "v_head_dim", 128),
                q_lora_rank=as_int(d, "q_lora_rank", None),
            ),
            moe=MoEConfig(
                num_experts=num(as_int, "num_experts", "num_local_experts", default=256),
                top_k=num(as_int, "num_experts_per_token", "num_experts_per_tok", default=8),
                intermediate_size=as_int(d, "moe_intermediate_size", 1024),
                num_shared_experts=num(as_int, "num_shared_experts", "n_shared_experts",
                                       default=1),
                routed_scaling_factor=as_float(d, "routed_scaling_factor", 2.446),
                n_group=num(as_int, "num_expert_group", "n_group", default=1),
                topk_group=as_int(d, "topk_group", 1),
                norm_topk_prob=as_bool(d, first_key(d, "moe_renormalize", "norm_topk_prob"),
                                       True),
            ),
            first_k_dense=first_dense,
            name=name,
        )

    @classmethod
    def hf_dict_from_gguf(cls, meta: Any) -> dict[str, Any]:
        """Refused: llama.cpp's converter (KimiLinearModel) writes tensors that are not one per
        Hugging Face tensor, and the GGUF loader maps names one to one."""
        raise ConfigError(
            f"GGUF architecture {meta.arch!r} (Kimi Linear) is not supported: llama.cpp's "
            "converter stacks each MoE layer's per-expert w1/w2/w3 into one 3-D "
            "ffn_gate_exps/ffn_down_exps/ffn_up_exps tensor, and splits each MLA layer's "
            "kv_b_proj into attn_k_b (transposed, [heads, kv_lora_rank, qk_nope]) and attn_v_b "
            "([heads, v_head_dim, kv_lora_rank]) without writing kv_b_proj; the GGUF loader reads "
            "one GGUF tensor per Hugging Face tensor. Load the Hugging Face checkpoint instead")

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


