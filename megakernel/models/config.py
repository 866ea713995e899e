"""What every model family shares: `ModelConfig`, the residual `Block`s it is made of, RoPE.

A model family is a frozen dataclass subclass of `ModelConfig` holding the family's own
hyperparameters (registered in models/registry.py); `blocks` composes them into residual blocks,
each `h += op(norm(h))` with `op` one layer kind (megakernel/layers/). Everything downstream (the
checkpoint loader, the reference, the program compiler, the executor, the kernel build) reads the
blocks, never the family. A dense transformer is a stack of (attention, SwiGLU) blocks; a hybrid
mixes recurrent and attention blocks; nothing else distinguishes them.

Anything not implemented is refused here by name (`ConfigError`), rather than computed wrongly
later.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from megakernel.common.errors import ConfigError, positive
from megakernel.common.rope import ROPE_TYPES, RopeConfig
from megakernel.models.fp8 import Fp8Format

NORM_KINDS = ("rms", "rms_1p")  # x * rsqrt(mean x^2 + eps) * w, or * (1 + w) (zero-centred)


@dataclass(frozen=True)
class Block:
    """One residual block: h += op(norm(h)), op being layer kind `kind` with config `cfg`.

    layer:  decoder layer index (several blocks may share one: attention then MLP)
    name:   the block's name within its layer ("attn", "mlp", "mixer", "ffn"); packed weights
            and counters are keyed `L{layer}.{name}.*`
    prefix: Hugging Face name prefix of the op's tensors, e.g. "model.layers.3.self_attn."
    norm:   Hugging Face name of the block's input RMSNorm weight
    """

    layer: int
    name: str
    kind: str
    cfg: Any
    prefix: str
    norm: str

    @property
    def key(self) -> str:
        return f"L{self.layer}.{self.name}"


@dataclass(frozen=True)
class MtpModule:
    """One multi-token-prediction (MTP) module, the next-n predictor of DeepSeek-V3 and
    Qwen3-Next / Qwen3.5 (reference/mtp.py runs it): from the target's hidden state g at
    position p (the LM head input) and the embedding e of token p + 1,

        x = proj [RMSNorm_embed(e) ; RMSNorm_hidden(g)]     (embedding first; proj is [H, 2H])
        x = one decoder layer of `blocks` (h += op(norm(h)), its own KV cache)
        g' = RMSNorm_final(x);  logits = the target's LM head (g')

    Names are Hugging Face tensor names; a family may share them across depths (Qwen3.5 has one
    `mtp.fc` and `mtp.norm` for all its `mtp.layers.{k}`)."""

    depth: int
    embed_norm: str  # enorm / pre_fc_norm_embedding
    hidden_norm: str  # hnorm / pre_fc_norm_hidden
    proj: str  # eh_proj / fc, [H, 2H]
    final_norm: str  # shared_head.norm / mtp.norm
    blocks: tuple[Block, ...]  # the decoder layer (layer index num_layers + depth)

    def norms(self) -> tuple[str, ...]:
        return (self.embed_norm, self.hidden_norm, self.final_norm)


Part = tuple[str, str, Any, str]  # a block's (name, kind, cfg, prefix under its layer)


def decoder_layer(i: int, mixer: Part, ffn: Part) -> tuple[Block, Block]:
    """The two blocks of pre-norm decoder layer i under `model.layers.{i}.`: the mixer (normed by
    input_layernorm) then the feed-forward (normed by post_attention_layernorm)."""
    p = f"model.layers.{i}."
    return (Block(i, *mixer[:3], p + mixer[3], p + "input_layernorm.weight"),
            Block(i, *ffn[:3], p + ffn[3], p + "post_attention_layernorm.weight"))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Fields every family shares; a family subclass adds its own, implements `make_blocks` and
    has `num_layers` (a field or a property).

    Class attributes a family sets: `family` (registry name), `norm_kind` (its RMSNorm form),
    `embed_name`, `final_norm_name`, `lm_head_name` (Hugging Face tensor names).
    """

    family: ClassVar[str] = ""
    norm_kind: ClassVar[str] = "rms"
    # random init (models/weights.py): q/k projections and norms drawn at qk_gain, residual
    # outputs at residual_gain
    qk_gain: ClassVar[float] = 1.0
    residual_gain: ClassVar[float] = 1.0
    embed_name: ClassVar[str] = "model.embed_tokens.weight"
    final_norm_name: ClassVar[str] = "model.norm.weight"
    lm_head_name: ClassVar[str] = "lm_head.weight"

    vocab_size: int
    hidden_size: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    name: str = ""
    quant: Fp8Format | None = None  # FP8 weights (models/fp8.py); None: bf16

    def __post_init__(self) -> None:
        positive(self, "vocab_size", "hidden_size", "max_position_embeddings")
        if (isinstance(self.rms_norm_eps, bool) or not isinstance(self.rms_norm_eps, float | int)
                or not self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(
                f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if self.norm_kind not in NORM_KINDS:
            raise ConfigError(f"unknown norm kind {self.norm_kind!r}")
        if not self.blocks:
            raise ConfigError("a model needs at least one layer")
        if self.quant is not None and not isinstance(self.quant, Fp8Format):
            raise ConfigError(f"quant must be an Fp8Format or None, got {self.quant!r}")

    # ---- composition ---------------------------------------------------------------------------
    def make_blocks(self) -> tuple[Block, ...]:
        raise NotImplementedError

    @cached_property
    def blocks(self) -> tuple[Block, ...]:
        """The model's residual blocks in execution order."""
        return tuple(self.make_blocks())

    # ---- multi-token prediction (reference/mtp.py) ---------------------------------------------
    def make_mtp(self) -> tuple[MtpModule, ...]:
        """The MTP modules the config enables (`mtp_layers` of a family that has them)."""
        return ()

    @cached_property
    def mtp(self) -> tuple[MtpModule, ...]:
        """The enabled MTP modules, depth 0 first (empty: the checkpoint's MTP tensors, if any,
        are skipped on load)."""
        return tuple(self.make_mtp())

    @classmethod
    def declared_mtp_layers(cls, d: dict[str, Any]) -> int:
        """How many MTP modules a Hugging Face config.json declares (0 for a family without
        them). `from_hf_dict` never enables them: `load_checkpoint(..., mtp=True)` does."""
        return 0

    def is_mtp_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to the MTP modules (enabled or not)."""
        return False

    def kind_configs(self, kind: str) -> list[Any]:
        """Distinct configs of the blocks of `kind`, in first-use order."""
        out: list[Any] = []
        for b in self.blocks:
            if b.kind == kind and b.cfg not in out:
                out.append(b.cfg)
        return out

    def kind_config(self, kind: str) -> Any:
        """The config shared by every block of `kind` (ConfigError when none or several)."""
        cfgs = self.kind_configs(kind)
        if len(cfgs) != 1:
            raise ConfigError(f"{self.name or self.family} has {len(cfgs)} distinct {kind!r} "
                              "layer configs; expected exactly one")
        return cfgs[0]

    def has_kind(self, kind: str) -> bool:
        return any(b.kind == kind for b in self.blocks)

    def recurrent_layers(self) -> list[int]:
        """Decoder layers with a recurrent block (conv window, state, ReplaySSM ring)."""
        from megakernel.layers import kind

        return sorted({b.layer for b in self.blocks if kind(b.kind).recurrent})

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        """Parameter count, counting a tied embedding once."""
        return sum(math.prod(s) for s in expected_shapes(self).values())

    # ---- Hugging Face interop (per family) -----------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        raise NotImplementedError

    def to_hf_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def hf_config(self) -> dict[str, Any]:
        """config.json: the family's fields plus the FP8 `quantization_config`."""
        d = self.to_hf_dict()
        if self.quant is not None:
            d["quantization_config"] = self.quant.to_hf()
        return d

    # checkpoint names: prefixes of tensors we skip (vision towers, MTP heads) and prefixes
    # other exporters write for ours
    skipped_prefixes: ClassVar[tuple[str, ...]] = ()
    renamed_prefixes: ClassVar[dict[str, str]] = {}

    @classmethod
    def canonical_name(cls, name: str) -> str | None:
        """Our name for a tensor found in a checkpoint; None to skip it (rotary buffers some
        exporters write, `skipped_prefixes`)."""
        if name.endswith("rotary_emb.inv_freq") or name.startswith(cls.skipped_prefixes):
            return None
        for theirs, ours in cls.renamed_prefixes.items():
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name

    # GGUF form (models/gguf.py): llama.cpp's architecture name, its metadata as Hugging Face
    # config fields, and the inverse of llama.cpp's transform of a tensor
    gguf_arch: ClassVar[str] = ""

    @classmethod
    def hf_dict_from_gguf(cls, meta: Any) -> dict[str, Any]:
        """The Hugging Face config fields of a GGUF file's metadata (`GGUFMetadata`)."""
        raise ConfigError(f"the {cls.family} family has no GGUF form")

    def gguf_source_name(self, name: str) -> str:
        """The name llama.cpp's converter looks up in the `gguf` name table for Hugging Face
        tensor `name`: `name` itself unless the converter renames it first (Mamba2's and
        Qwen3-Next's `dt_bias` -> `dt_proj.bias`)."""
        return name

    def gguf_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape (torch order) llama.cpp writes tensor `name` of Hugging Face `shape` in."""
        return shape

    def from_gguf_tensor(self, name: str, t: Any) -> Any:
        """Tensor `name` as the Hugging Face checkpoint holds it, from its GGUF form (shaped
        `gguf_shape`; identity unless llama.cpp's converter transforms it)."""
        return t


# ---- Hugging Face config parsing helpers --------------------------------------------------------
def refuse(d: dict[str, Any], **expected: Any) -> None:
    """ConfigError when a field is present with a value other than the one we implement."""
    for k, want in expected.items():
        if k in d and d[k] is not None and d[k] != want:
            raise ConfigError(f"unsupported config field {k}={d[k]!r}; only {want!r}")


def first(d: dict[str, Any], *keys: str, default: Any) -> Any:
    """The value of the first of `keys` present (and not None) in `d`, else `default`."""
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def first_key(d: dict[str, Any], *keys: str) -> str:
    """The first of `keys` present (and not None) in `d`, else the first of `keys`: the field to
    read (and to name in errors) when a value has several spellings."""
    return next((k for k in keys if d.get(k) is not None), keys[0])


def _field(d: dict[str, Any], key: str, default: Any, ok: Callable[[Any], bool], what: str
           ) -> Any:
    """d[key] when `ok` accepts it, `default` when it is absent or null (`...`: required);
    ConfigError naming the field otherwise."""
    v = d.get(key)
    if v is None:
        if default is ...:
            raise ConfigError(f"config is missing required field {key!r}")
        return default
    if not ok(v):
        raise ConfigError(f"config field {key!r} must be {what}, got {v!r}")
    return v


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def as_int(d: dict[str, Any], key: str, default: Any = ...) -> int:
    """d[key] as an int (a JSON number with no fraction); absent: `default` (None stays None)."""
    v = _field(d, key, default, lambda v: _number(v) and int(v) == v, "an integer")
    return None if v is None else int(v)


def as_float(d: dict[str, Any], key: str, default: Any = ...) -> float:
    """d[key] as a finite float; absent: `default` (None stays None)."""
    v = _field(d, key, default, _number, "a finite number")
    return None if v is None else float(v)


def as_bool(d: dict[str, Any], key: str, default: bool = False) -> bool:
    """d[key] as a bool: JSON true / false only (the string "false" is not false)."""
    return _field(d, key, default, lambda v: isinstance(v, bool), "true or false")


def as_dict(d: dict[str, Any], key: str) -> dict[str, Any]:
    """d[key] as a dict (absent or null: empty)."""
    return dict(_field(d, key, {}, lambda v: isinstance(v, dict), "an object"))


def as_list(d: dict[str, Any], key: str) -> list[Any] | None:
    """d[key] as a list (absent or null: None)."""
    return _field(d, key, None, lambda v: isinstance(v, list), "a list")


def map_types(types: Any, n: int, mapping: dict[str, str], field: str = "layer_types"
              ) -> tuple[str, ...]:
    """Hugging Face layer type names -> ours, checking the count; `field` names the list."""
    if not isinstance(types, list | tuple):
        raise ConfigError(f"config field {field!r} must be a list, got {types!r}")
    if len(types) != n:
        raise ConfigError(f"{field} has {len(types)} entries for {n} layers")
    out = []
    for i, t in enumerate(types):
        if not isinstance(t, str) or t not in mapping:
            raise ConfigError(
                f"layer {i}: unsupported layer type {t!r}; supported: {', '.join(mapping)}")
        out.append(mapping[t])
    return tuple(out)


def rope_from_hf(d: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """RoPE settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = {**as_dict(d, "rope_scaling"), **as_dict(d, "rope_parameters")}
    theta = as_float(d, "rope_theta", default_theta)
    theta = as_float(params, "rope_theta", theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "llama3":
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        return RopeConfig(theta=theta)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if params.get(k) is None]
    if missing:
        raise ConfigError(f"llama3 rope parameters are missing {missing[0]!r}")
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=as_float(params, "factor"),
        low_freq_factor=as_float(params, "low_freq_factor"),
        high_freq_factor=as_float(params, "high_freq_factor"),
        original_max_position_embeddings=as_int(params, "original_max_position_embeddings"))


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type == "llama3":
        out.update(factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                   high_freq_factor=rope.high_freq_factor,
                   original_max_position_embeddings=rope.original_max_position_embeddings)
    return out


# ---- checkpoint layout -------------------------------------------------------------------------
def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name of `cfg`'s model -> its shape, in checkpoint order."""
    from megakernel.layers import kind

    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {cfg.embed_name: (cfg.vocab_size, h)}
    for blk in cfg.blocks:
        shapes[blk.norm] = (h,)
        for local, shape in kind(blk.kind).shapes(blk, cfg).items():
            shapes[blk.prefix + local] = tuple(shape)
    shapes[cfg.final_norm_name] = (h,)
    if not cfg.tie_word_embeddings:
        shapes[cfg.lm_head_name] = (cfg.vocab_size, h)
    shapes.update(mtp_shapes(cfg))
    return shapes


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The enabled MTP modules' tensor names -> shapes (the embedding and LM head are the
    target's); empty when `cfg.mtp` is."""
    from megakernel.layers import kind

    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for m in cfg.mtp:
        shapes.update({n: (h,) for n in (m.embed_norm, m.hidden_norm)})
        shapes[m.proj] = (h, 2 * h)
        for blk in m.blocks:
            shapes[blk.norm] = (h,)
            for local, shape in kind(blk.kind).shapes(blk, cfg).items():
                shapes[blk.prefix + local] = tuple(shape)
        shapes[m.final_norm] = (h,)
    return shapes
