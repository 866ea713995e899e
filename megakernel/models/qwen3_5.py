"""Qwen3.5 text decoder (Qwen3_5ForCausalLM / the text model of Qwen3_5ForConditionalGeneration):
gated delta rule layers and gated full-attention layers (head_dim 256, partial RoPE, (1+w) q/k
norms, sigmoid output gate), each followed by a SwiGLU; every RMSNorm but the GDN output norm is
the zero-centred (1 + w) form.

Published multimodal checkpoints prefix the text model with `model.language_model.` and carry
`model.visual.*` and `mtp.*`: the prefix is mapped to `model.` and the rest skipped.

MTP (`mtp_layers` > 0; config.json's `mtp_num_hidden_layers`, enabled by
`load_checkpoint(..., mtp=True)`, never by `from_hf_dict`, so the published configs keep parsing
to the presets): vLLM's Qwen3_5MultiTokenPredictor, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.fc` [H, 2H] and `mtp.norm` shared by the depths, and per depth k
one full-attention decoder layer `mtp.layers.{k}.` (gated attention + the dense SwiGLU); every
norm the (1 + w) form.

GGUF form (llama.cpp's `qwen35`, convert_hf_to_gguf.py's Qwen3_5TextModel): the layer pattern is
`full_attention_interval` (layer i is attention when (i + 1) % interval == 0); every (1 + w) norm
is stored as 1 + w; A_log as A = -exp(A_log); conv1d squeezed to [C, K]; dt_bias under
`ssm_dt.bias`; and with fewer key than value heads the gated delta rule's value heads are
reordered from grouped (by key head) to tiled (`from_gguf_tensor` undoes each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megakernel.layers.attention import AttentionConfig
from megakernel.layers.gdn import GDNConfig
from megakernel.layers.swiglu import SwiGLUConfig
from megakernel.models.config import (
    Block,
    ConfigError,
    MtpModule,
    RopeConfig,
    as_bool,
    as_dict,
    as_float,
    as_int,
    as_list,
    decoder_layer,
    map_types,
    positive,
    refuse,
)
from megakernel.models.layer_types import (
    LayerTypesConfig,
    a_log_from_gguf,
    v_heads_grouped,
)
from megakernel.models.registry import register_family


def _presets() -> dict[str, Qwen35Config]:
    def mk(name: str, vocab: int, hidden: int, layers: int, inter: int, heads: int, kv: int,
           head_dim: int, vk: int, vv: int, dk: int, dv: int, tie: bool, max_pos: int,
           theta: float = 1e7, interval: int = 4) -> Qwen35Config:
        return Qwen35Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            layer_types=tuple("attention" if (i + 1) % interval == 0 else "gdn"
                              for i in range(layers)),
            rms_norm_eps=1e-6, tie_word_embeddings=tie, max_position_embeddings=max_pos,
            attention=AttentionConfig(heads, kv, head_dim, head_dim // 4, RopeConfig(theta), True,
                                      True),
            gdn=GDNConfig(vk, vv, dk, dv, 4), name=name)

    return {
        # Qwen/Qwen3.5-{0.8B,2B,4B,9B}, text_config of config.json
        "qwen3.5-0.8b": mk("qwen3.5-0.8b", 248320, 1024, 24, 3584, 8, 2, 256, 16, 16, 128, 128,
                           True, 262144),
        "qwen3.5-2b": mk("qwen3.5-2b", 248320, 2048, 24, 6144, 8, 2, 256, 16, 16, 128, 128, True,
                         262144),
        "qwen3.5-4b": mk("qwen3.5-4b", 248320, 2560, 32, 9216, 16, 4, 256, 16, 32, 128, 128,
                         True, 262144),
        "qwen3.5-9b": mk("qwen3.5-9b", 248320, 4096, 32, 12288, 16, 4, 256, 16, 32, 128, 128,
                         False, 262144),
        "qwen3.5-tiny": Qwen35Config(
            vocab_size=256, hidden_size=64, intermediate_size=128,
            layer_types=("gdn", "gdn", "attention", "gdn"), rms_norm_eps=1e-6,
            tie_word_embeddings=False, max_position_embeddings=512,
            attention=AttentionConfig(4, 2, 64, 16, RopeConfig(1e6), True, True),
            gdn=GDNConfig(2, 4, 16, 8, 4), name="qwen3.5-tiny"),
        # qwen3.5-tiny's shapes with every layer full attention: the family's gated attention,
        # partial RoPE and (1 + w) norms without GDN (what the CuTe DSL kernel runs of it)
        "qwen3.5-attn-tiny": Qwen35Config(
            vocab_size=256, hidden_size=64, intermediate_size=128,
            layer_types=("attention",) * 4, rms_norm_eps=1e-6,
            tie_word_embeddings=False, max_position_embeddings=512,
            attention=AttentionConfig(4, 2, 64, 16, RopeConfig(1e6), True, True),
            gdn=GDNConfig(2, 4, 16, 8, 4), name="qwen3.5-attn-tiny"),
    }


@register_family(architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                 model_types=("qwen3_5", "qwen3_5_text"), presets=_presets,
                 real_presets=("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b"))
@dataclass(frozen=True, kw_only=True)
class Qwen35Config(LayerTypesConfig):
    family = "qwen3_5"
    gguf_arch = "qwen35"
    norm_kind = "rms_1p"
    mixers = ("gdn", "attention")
    skipped_prefixes = ("model.visual.", "mtp.", "model.mtp.")
    renamed_prefixes = {"model.language_model.": "model."}  # the multimodal checkpoint's text

    intermediate_size: int
    attention: AttentionConfig
    gdn: GDNConfig
    mtp_layers: int = 0  # enabled MTP modules (module docstring)

    def __post_init__(self) -> None:
        positive(self, "intermediate_size")
        if (isinstance(self.mtp_layers, bool) or not isinstance(self.mtp_layers, int)
                or self.mtp_layers < 0):
            raise ConfigError(f"mtp_layers must be an integer >= 0, got {self.mtp_layers!r}")
        if not (self.attention.qk_norm and self.attention.output_gate):
            raise ConfigError("Qwen3.5 attention has q/k norm and an output gate")
        super().__post_init__()

    def ffn_type(self, i: int) -> str:
        return "swiglu"

    def make_blocks(self) -> tuple[Block, ...]:
        mlp = ("mlp", "swiglu", SwiGLUConfig(self.intermediate_size), "mlp.")
        mixers = {"gdn": ("mixer", "gdn", self.gdn, "linear_attn."),
                  "attention": ("mixer", "attention", self.attention, "self_attn.")}
        return tuple(b for i, t in enumerate(self.layer_types)
                     for b in decoder_layer(i, mixers[t], mlp))

    def make_mtp(self) -> tuple[MtpModule, ...]:
        out = []
        for k in range(self.mtp_layers):
            p = f"mtp.layers.{k}."
            layer = self.num_layers + k
            blocks = (Block(layer, "mixer", "attention", self.attention, p + "self_attn.",
                            p + "input_layernorm.weight"),
                      Block(layer, "mlp", "swiglu", SwiGLUConfig(self.intermediate_size),
                            p + "mlp.", p + "post_attention_layernorm.weight"))
            out.append(MtpModule(k, "mtp.pre_fc_norm_embedding.weight",
                                 "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                                 "mtp.norm.weight", blocks))
        return tuple(out)

    @classmethod
    def declared_mtp_layers(cls, d: dict[str, Any]) -> int:
        text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
        return as_int(text, "mtp_num_hidden_layers", 0)

    def is_mtp_tensor(self, name: str) -> bool:
        return name.startswith(("mtp.", "model.mtp."))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> Qwen35Config:
        """From a `qwen3_5_text` dict, or a `qwen3_5` dict with the text model in `text_config`."""
        top = d
        if d.get("model_type") == "qwen3_5" or "text_config" in d:
            if not isinstance(d.get("text_config"), dict):
                raise ConfigError("qwen3_5 config has no text_config object")
            d = d["text_config"]
        mt = d.get("model_type", "qwen3_5_text")
        if mt != "qwen3_5_text":
            raise ConfigError(f"unsupported Qwen3.5 text model_type {mt!r} (only dense "
                              "qwen3_5_text)")
        refuse(d, hidden_act="silu", attention_bias=False)
        if as_int(d, "num_experts", 0):
            raise ConfigError("Qwen3.5 MoE text models are not supported (num_experts > 0)")
        if not as_bool(d, "attn_output_gate", True):
            raise ConfigError("unsupported attn_output_gate=false (Qwen3.5 always gates "
                              "attention)")
        rope = {**as_dict(d, "rope_scaling"), **as_dict(d, "rope_parameters")}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"unsupported rope type {rope_type!r} for Qwen3.5; only 'default'")
        theta = as_float(rope, "rope_theta", as_float(d, "rope_theta", 10000.0))
        prf = as_float(rope, "partial_rotary_factor", as_float(d, "partial_rotary_factor", 0.25))
        n = as_int(d, "num_hidden_layers")
        layer_types = as_list(d, "layer_types")
        if layer_types is None:
            interval = as_int(d, "full_attention_interval", 4)
            if interval <= 0:
                raise ConfigError(f"full_attention_interval must be positive, got {interval}")
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n)]
        head_dim = as_int(d, "head_dim", 256)
        heads = as_int(d, "num_attention_heads")
        # the multimodal wrapper's tie flag wins over the text model's
        tie = as_bool(top, "tie_word_embeddings", as_bool(d, "tie_word_embeddings"))
        return cls(
            vocab_size=as_int(d, "vocab_size"), hidden_size=as_int(d, "hidden_size"),
            layer_types=map_types(layer_types, n, {"linear_attention": "gdn",
                                                   "full_attention": "attention"}),
            intermediate_size=as_int(d, "intermediate_size"),
            rms_norm_eps=as_float(d, "rms_norm_eps", 1e-6), tie_word_embeddings=tie,
            max_position_embeddings=as_int(d, "max_position_embeddings", 32768),
            attention=AttentionConfig(
                num_heads=heads, num_kv_heads=as_int(d, "num_key_value_heads", heads),
                head_dim=head_dim, rotary_dim=int(head_dim * prf) // 2 * 2,
                rope=RopeConfig(theta), qk_norm=True, output_gate=True),
            gdn=GDNConfig(
                num_k_heads=as_int(d, "linear_num_key_heads", 16),
                num_v_heads=as_int(d, "linear_num_value_heads", 32),
                k_head_dim=as_int(d, "linear_key_head_dim", 128),
                v_head_dim=as_int(d, "linear_value_head_dim", 128),
                conv_kernel=as_int(d, "linear_conv_kernel_dim", 4)),
            name=name)

    # ---- GGUF form (models/gguf.py) ------------------------------------------------------------
    @classmethod
    def hf_dict_from_gguf(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's qwen35 keys (Qwen3NextModel.set_gguf_parameters): the gated delta rule's
        sizes under `ssm.*`, the layer pattern as `full_attention_interval`, the rotary width as
        `rope.dimension_count` (`rope.dimension_sections`, the MRoPE split, is plain RoPE for
        text positions)."""
        if meta.get("expert_count"):
            raise ConfigError(f"GGUF {meta.arch}.expert_count is set: Qwen3.5 MoE text models are "
                              "not supported")
        n = meta.int("block_count")
        heads, hidden, head_dim = meta.attention()
        rotary = meta.int("rope.dimension_count")
        prf = rotary / head_dim
        if int(head_dim * prf) // 2 * 2 != rotary:
            raise ConfigError(f"GGUF {meta.arch}.rope.dimension_count = {rotary} must be even and "
                              f"at most the head size ({head_dim})")
        interval = meta.int("full_attention_interval", 4)
        if interval <= 0:
            raise ConfigError(f"GGUF {meta.arch}.full_attention_interval must be positive, got "
                              f"{interval}")
        hv = meta.int("ssm.time_step_rank")
        inner = meta.int("ssm.inner_size")
        if hv <= 0 or inner % hv:
            raise ConfigError(f"GGUF {meta.arch}.ssm.inner_size ({inner}) must be a multiple of "
                              f"ssm.time_step_rank ({hv}, the value heads)")
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            **meta.vocab(),
            "hidden_size": hidden,
            "intermediate_size": meta.int("feed_forward_length"),
            "num_hidden_layers": n,
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(n)],
            "num_attention_heads": heads,
            "num_key_value_heads": meta.int("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": meta.int("context_length", 32768),
            "rope_parameters": {"rope_type": "default",
                                "rope_theta": meta.float("rope.freq_base", 10000.0),
                                "partial_rotary_factor": prf},
            "linear_num_key_heads": meta.int("ssm.group_count"),
            "linear_num_value_heads": hv,
            "linear_key_head_dim": meta.int("ssm.state_size"),
            "linear_value_head_dim": inner // hv,
            "linear_conv_kernel_dim": meta.int("ssm.conv_kernel"),
        }

    def gguf_source_name(self, name: str) -> str:
        """The converter renames dt_bias to dt_proj.bias before its name-table lookup."""
        return name.removesuffix("dt_bias") + "dt_proj.bias" if name.endswith(".dt_bias") else name

    def gguf_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if name.endswith(".linear_attn.conv1d.weight"):  # squeezed [C, 1, K] -> [C, K]
            return (shape[0], shape[2])
        return shape

    def from_gguf_tensor(self, name: str, t: Any) -> Any:
        """Undo Qwen3_5TextModel.modify_tensors: the +1 of every (1 + w) norm (all but the gated
        delta rule's output norm), A = -exp(A_log), the conv squeeze, and (Hk != Hv) the
        grouped -> tiled reorder of value heads (`_reorder_v_heads`) in in_proj_qkv's v rows,
        in_proj_z, in_proj_a/b, A_log, dt_bias, the conv's v channels and out_proj's columns."""
        if ".linear_attn." not in name:
            return t - 1 if name.endswith("norm.weight") else t
        local = name.rpartition(".linear_attn.")[2]
        if local == "A_log":
            t = a_log_from_gguf(name, t)
        elif local == "conv1d.weight":
            t = t.unsqueeze(1)
        g = self.gdn
        if g.num_k_heads == g.num_v_heads:
            return t

        def grouped(x: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
            return v_heads_grouped(x, dim, g.num_k_heads, g.num_v_heads, head_dim)

        if local in ("in_proj_qkv.weight", "conv1d.weight"):  # v rows / channels after q, k
            qk = 2 * g.key_dim
            return torch.cat((t[:qk], grouped(t[qk:], 0, g.v_head_dim)))
        if local == "in_proj_z.weight":
            return grouped(t, 0, g.v_head_dim)
        if local in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
            return grouped(t, 0, 1)
        if local == "out_proj.weight":
            return grouped(t, 1, g.v_head_dim)
        return t

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
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope.theta,
                                "partial_rotary_factor": a.rotary_dim / a.head_dim},
            "layer_types": ["linear_attention" if t == "gdn" else "full_attention"
                            for t in self.layer_types],
            "linear_num_key_heads": g.num_k_heads,
            "linear_num_value_heads": g.num_v_heads,
            "linear_key_head_dim": g.k_head_dim,
            "linear_value_head_dim": g.v_head_dim,
            "linear_conv_kernel_dim": g.conv_kernel,
            **({"mtp_num_hidden_layers": self.mtp_layers} if self.mtp_layers else {}),
        }
