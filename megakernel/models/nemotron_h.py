"""Nemotron-H (NemotronHForCausalLM): one block per layer (RMSNorm -> mixer -> residual); mixers
are Mamba2 (M), grouped-query attention without RoPE (*) and a relu^2 MLP (-). MoE blocks are not
supported. Weights under `backbone.` (transformers renames it `model.`: both accepted).

GGUF form (llama.cpp's `nemotron_h`, convert_hf_to_gguf.py's NemotronHModel): the layer pattern is
in the per-layer arrays `attention.head_count_kv` (non-zero: attention) and `feed_forward_length`
(non-zero: MLP; both zero: Mamba2); attention q/k rows are permuted as Llama's; Mamba2's A_log is
stored as A = -exp(A_log) [H, 1], D as [H, 1], the conv squeezed to [C, K], the gated norm as
[G, d_inner / G], dt_bias under `ssm_dt.bias` (`from_gguf_tensor` undoes each). llama.cpp writes
context_length = 2**20 for it, not the checkpoint's max_position_embeddings, and no
time_step_min (the default 0.001 is read).
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
from megakernel.models.layer_types import (
    LayerTypesConfig,
    a_log_from_gguf,
)
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
    gguf_arch = "nemotron_h"
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

    # ---- GGUF form (models/gguf.py) ------------------------------------------------------------
    @classmethod
    def hf_dict_from_gguf(cls, meta: Any) -> dict[str, Any]:
        """llama.cpp's nemotron_h keys (NemotronHModel / GraniteHybridModel.set_gguf_parameters):
        the layer pattern from the per-layer `attention.head_count_kv` and `feed_forward_length`
        arrays, Mamba2's sizes under `ssm.*`, the conv bias from the presence of its tensor."""
        n = meta.int("block_count")
        kv, ff = meta.get("attention.head_count_kv"), meta.get("feed_forward_length")
        if not (isinstance(kv, list) and isinstance(ff, list) and len(kv) == len(ff) == n):
            raise ConfigError(f"GGUF {meta.arch}.attention.head_count_kv and feed_forward_length "
                              f"must be per-layer arrays of block_count ({n}) entries (they hold "
                              f"the layer pattern), got {kv!r} and {ff!r}")
        types = []
        for i, (k, f) in enumerate(zip(kv, ff, strict=True)):
            if k and f:
                raise ConfigError(f"GGUF {meta.arch} layer {i} has both kv heads ({k}) and a "
                                  f"feed-forward length ({f}): not a Nemotron-H layer")
            types.append("full_attention" if k else "mlp" if f else "linear_attention")

        def uniform(values: list[Any], what: str, default: int) -> int:
            """The one non-zero value of a per-layer array (`default` when all are zero)."""
            found = sorted({int(v) for v in values if v})
            if len(found) > 1:
                raise ConfigError(f"GGUF {meta.arch}.{what} varies by layer ({found}); only "
                                  "uniform layers are supported")
            return found[0] if found else default

        heads = meta.int("attention.head_count")
        hidden = meta.int("embedding_length")
        nh = meta.int("ssm.time_step_rank")
        inner = meta.int("ssm.inner_size")
        if nh <= 0 or inner % nh:
            raise ConfigError(f"GGUF {meta.arch}.ssm.inner_size ({inner}) must be a multiple of "
                              f"ssm.time_step_rank ({nh}, the Mamba2 heads)")
        mamba = [i for i, t in enumerate(types) if t == "linear_attention"]
        eps_key = ("attention.layer_norm_rms_epsilon"
                   if meta.get("attention.layer_norm_rms_epsilon") is not None
                   else "attention.layer_norm_epsilon")
        return {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            **meta.vocab(),
            "hidden_size": hidden,
            "layers_block_type": types,
            "num_attention_heads": heads,
            "num_key_value_heads": uniform(kv, "attention.head_count_kv", heads),
            "head_dim": meta.int("attention.key_length", hidden // heads),
            # no MLP layer: the file holds no intermediate size, and any builds the same model
            "intermediate_size": uniform(ff, "feed_forward_length", 1),
            "mamba_num_heads": nh,
            "mamba_head_dim": inner // nh,
            "ssm_state_size": meta.int("ssm.state_size"),
            "n_groups": meta.int("ssm.group_count"),
            "conv_kernel": meta.int("ssm.conv_kernel"),
            "use_conv_bias": (not mamba
                              or f"blk.{mamba[0]}.ssm_conv1d.bias" in meta.tensor_names),
            "layer_norm_epsilon": meta.float(eps_key, 1e-5),
            "max_position_embeddings": meta.int("context_length", 4096),
        }

    def gguf_source_name(self, name: str) -> str:
        """The converter (Mamba2Model) renames dt_bias to dt_proj.bias before its name-table
        lookup."""
        return name.removesuffix("dt_bias") + "dt_proj.bias" if name.endswith(".dt_bias") else name

    def gguf_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        m = self.mamba2
        if name.endswith(".mixer.conv1d.weight"):  # squeezed [C, 1, K] -> [C, K]
            return (shape[0], shape[2])
        if name.endswith((".mixer.A_log", ".mixer.D")):  # [H] -> [H, 1]
            return (*shape, 1)
        if name.endswith(".mixer.norm.weight"):  # the gated norm per group
            return (m.n_groups, m.d_inner // m.n_groups)
        return shape

    def from_gguf_tensor(self, name: str, t: Any) -> Any:
        """Undo NemotronHModel.modify_tensors: Mamba2Model's reshapes and A = -exp(A_log), and
        LlamaModel's q/k row permutation (llama.cpp's RoPE pairs neighbours; Nemotron-H has no
        RoPE, the converter permutes anyway): rows 2i, 2i + 1 of a head -> rows i, i + d/2."""
        if name.endswith(".mixer.conv1d.weight"):
            return t.unsqueeze(1)
        if name.endswith(".mixer.A_log"):
            return a_log_from_gguf(name, t.reshape(-1))
        if name.endswith((".mixer.D", ".mixer.norm.weight")):
            return t.reshape(-1)
        a = self.attention
        for proj, heads in (("mixer.q_proj.weight", a.num_heads),
                            ("mixer.k_proj.weight", a.num_kv_heads)):
            if name.endswith(proj):
                rows = t.shape[0]
                return (t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2)
                        .reshape(t.shape))
        return t

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


