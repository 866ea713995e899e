"""Weights of the hybrid families: checkpoint layout, loading, and seeded random weights.

Weights are a plain `dict[str, torch.Tensor]` keyed by the names the published checkpoints use
(the "hub layout", which is also what `save_pretrained` writes: transformers reverts its load-time
conversions when saving):

- Qwen3.5: `model.layers.{i}.linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,conv1d,
  dt_bias,A_log,norm,out_proj}`, `...self_attn.{q,k,v,o}_proj, {q,k}_norm`, `...mlp.*`. Published
  multimodal checkpoints (`Qwen3_5ForConditionalGeneration`) prefix the text model with
  `model.language_model.` and carry `model.visual.*` and `mtp.*`: the prefix is mapped to `model.`
  and the vision tower and MTP head are skipped.
- Kimi Linear: KDA weights `self_attn.{q,k,v}_proj, {q,k,v}_conv1d, f_a_proj, f_b_proj, dt_bias,
  A_log [1, 1, H, 1], b_proj, g_a_proj, g_b_proj, o_norm, o_proj` (transformers concatenates the
  three convs and moves the gate weights under `forget_gate` at load time); MLA weights
  `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm,
  kv_b_proj, o_proj`; MoE layers `block_sparse_moe.{gate.weight, gate.e_score_correction_bias,
  experts.{e}.w1 (gate), w3 (up), w2 (down), shared_experts.{gate,up,down}_proj}` (transformers
  fuses the experts into `mlp.experts.gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`); dense
  layers `mlp.{gate,up,down}_proj` (save_pretrained writes them as `block_sparse_moe.*_proj`;
  both are accepted).
- Nemotron-H: `backbone.embeddings`, `backbone.layers.{i}.norm`, `backbone.layers.{i}.mixer.*`,
  `backbone.norm_f`, `lm_head` (transformers renames `backbone.` to `model.`; both accepted).

Linear weights are [out, in]. A tied model has no "lm_head.weight" entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch

from megakernel.config import ConfigError
from megakernel.weights import WeightError

from .config import (
    PRESETS,
    HybridConfig,
    KimiLinearConfig,
    NemotronHConfig,
    Qwen35Config,
    config_from_hf_dir,
)

__all__ = [
    "WeightError",
    "expected_shapes",
    "load_checkpoint",
    "random_weights",
    "load_model",
    "save_checkpoint",
]

_DISK_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


# ---- layout -------------------------------------------------------------------------------------
def embed_name(cfg: HybridConfig) -> str:
    if cfg.family == "nemotron_h":
        return "backbone.embeddings.weight"
    return "model.embed_tokens.weight"


def final_norm_name(cfg: HybridConfig) -> str:
    return "backbone.norm_f.weight" if cfg.family == "nemotron_h" else "model.norm.weight"


def layer_prefix(cfg: HybridConfig, i: int) -> str:
    return f"backbone.layers.{i}." if cfg.family == "nemotron_h" else f"model.layers.{i}."


def expected_shapes(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of `cfg`'s model (hub layout) -> its shape, in checkpoint order."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {embed_name(cfg): (cfg.vocab_size, h)}
    for i, kind in enumerate(cfg.layer_types):
        p = layer_prefix(cfg, i)
        if isinstance(cfg, NemotronHConfig):
            shapes[p + "norm.weight"] = (h,)
            shapes.update(_mixer_shapes(cfg, kind, p + "mixer."))
            continue
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        mixer = "linear_attn." if kind == "gdn" else "self_attn."
        shapes.update(_mixer_shapes(cfg, kind, p + mixer))
        if cfg.ffn_type(i) == "mlp":
            shapes.update(_swiglu_shapes(p + "mlp.", h, cfg.intermediate_size))
        else:
            assert isinstance(cfg, KimiLinearConfig)
            shapes.update(_moe_shapes(cfg, p + "block_sparse_moe."))
    shapes[final_norm_name(cfg)] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _swiglu_shapes(p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h),
            p + "down_proj.weight": (h, inter)}


def _moe_shapes(cfg: KimiLinearConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, e = cfg.hidden_size, cfg.moe
    out: dict[str, tuple[int, ...]] = {
        p + "gate.weight": (e.num_experts, h),
        p + "gate.e_score_correction_bias": (e.num_experts,),
    }
    for x in range(e.num_experts):
        q = f"{p}experts.{x}."
        out[q + "w1.weight"] = (e.intermediate_size, h)
        out[q + "w2.weight"] = (h, e.intermediate_size)
        out[q + "w3.weight"] = (e.intermediate_size, h)
    if e.num_shared_experts:
        out.update(_swiglu_shapes(p + "shared_experts.", h,
                                  e.intermediate_size * e.num_shared_experts))
    return out


def _mixer_shapes(cfg: HybridConfig, kind: str, p: str) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    if kind == "gdn":
        assert isinstance(cfg, Qwen35Config)
        g = cfg.gdn
        return {
            p + "in_proj_qkv.weight": (g.conv_dim, h),
            p + "in_proj_z.weight": (g.value_dim, h),
            p + "in_proj_b.weight": (g.num_v_heads, h),
            p + "in_proj_a.weight": (g.num_v_heads, h),
            p + "conv1d.weight": (g.conv_dim, 1, g.conv_kernel),
            p + "dt_bias": (g.num_v_heads,),
            p + "A_log": (g.num_v_heads,),
            p + "norm.weight": (g.v_head_dim,),
            p + "out_proj.weight": (h, g.value_dim),
        }
    if kind == "attention":
        a = cfg.attention  # type: ignore[attr-defined]
        q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
        out = {
            p + "q_proj.weight": (q_out, h),
            p + "k_proj.weight": (a.num_kv_heads * a.head_dim, h),
            p + "v_proj.weight": (a.num_kv_heads * a.head_dim, h),
            p + "o_proj.weight": (h, a.num_heads * a.head_dim),
        }
        if a.qk_norm:
            out[p + "q_norm.weight"] = (a.head_dim,)
            out[p + "k_norm.weight"] = (a.head_dim,)
        return out
    if kind == "kda":
        assert isinstance(cfg, KimiLinearConfig)
        k = cfg.kda
        d, hd = k.head_dim, k.qkv_dim
        out = {}
        for n in "qkv":
            out[p + f"{n}_proj.weight"] = (hd, h)
        for n in "qkv":
            out[p + f"{n}_conv1d.weight"] = (hd, 1, k.conv_kernel)
        out.update({
            p + "f_a_proj.weight": (d, h),
            p + "f_b_proj.weight": (hd, d),
            p + "dt_bias": (hd,),
            p + "A_log": (1, 1, k.num_heads, 1),
            p + "b_proj.weight": (k.num_heads, h),
            p + "g_a_proj.weight": (d, h),
            p + "g_b_proj.weight": (hd, d),
            p + "o_norm.weight": (d,),
            p + "o_proj.weight": (h, hd),
        })
        return out
    if kind == "mla":
        assert isinstance(cfg, KimiLinearConfig)
        m = cfg.mla
        q_out = m.num_heads * m.qk_head_dim
        out = {}
        if m.q_lora_rank is None:
            out[p + "q_proj.weight"] = (q_out, h)
        else:
            out[p + "q_a_proj.weight"] = (m.q_lora_rank, h)
            out[p + "q_a_layernorm.weight"] = (m.q_lora_rank,)
            out[p + "q_b_proj.weight"] = (q_out, m.q_lora_rank)
        out.update({
            p + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, h),
            p + "kv_a_layernorm.weight": (m.kv_lora_rank,),
            p + "kv_b_proj.weight": (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim),
                                     m.kv_lora_rank),
            p + "o_proj.weight": (h, m.num_heads * m.v_head_dim),
        })
        return out
    if kind == "mamba2":
        assert isinstance(cfg, NemotronHConfig)
        m = cfg.mamba2
        out = {
            p + "in_proj.weight": (m.in_proj_size, h),
            p + "conv1d.weight": (m.conv_dim, 1, m.conv_kernel),
        }
        if m.use_conv_bias:
            out[p + "conv1d.bias"] = (m.conv_dim,)
        out.update({
            p + "dt_bias": (m.num_heads,),
            p + "A_log": (m.num_heads,),
            p + "D": (m.num_heads,),
            p + "norm.weight": (m.d_inner,),
            p + "out_proj.weight": (h, m.d_inner),
        })
        return out
    if kind == "mlp":
        assert isinstance(cfg, NemotronHConfig)
        return {p + "up_proj.weight": (cfg.intermediate_size, h),
                p + "down_proj.weight": (h, cfg.intermediate_size)}
    raise ConfigError(f"unsupported layer type {kind!r}")


# ---- checkpoint names -> our names -------------------------------------------------------------
_SKIP = {
    "qwen3_5": re.compile(r"^(model\.visual\.|mtp\.|model\.mtp\.)|rotary_emb\.inv_freq$"),
    "kimi_linear": re.compile(r"rotary_emb\.inv_freq$"),
    "nemotron_h": re.compile(r"^(mtp\.|model\.mtp\.|backbone\.mtp\.)"),
}


def canonical_name(cfg: HybridConfig, name: str) -> str:
    """Map a tensor name found in a checkpoint to our (hub layout) name."""
    if cfg.family == "qwen3_5" and name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if cfg.family == "nemotron_h" and name.startswith("model."):
        return "backbone." + name[len("model."):]
    if cfg.family == "kimi_linear":
        m = re.match(r"^(model\.layers\.\d+\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$",
                     name)
        if m:
            return m.group(1) + "mlp." + m.group(2)
    return name


# ---- checkpoint loading ------------------------------------------------------------------------
def _tensor_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded index)."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightError(
                f"{index} is not a safetensors index with a 'weight_map': {e}") from None
        files = {name: root / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise WeightError(f"shard {f.name} listed in {index.name} is missing from {root}")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise WeightError(f"no model.safetensors or model.safetensors.index.json in {root}")


def _shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def load_checkpoint(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[HybridConfig, dict[str, torch.Tensor]]:
    """Load a hybrid checkpoint directory (config.json + safetensors, single or sharded).

    Names are mapped with `canonical_name`; every name and shape is checked against
    `expected_shapes` from the file headers before any data is read, and one WeightError lists
    every missing, unexpected or misshaped tensor. `dtype=None` keeps the on-disk dtypes.
    """
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise WeightError(f"checkpoint directory {str(root)!r} does not exist")
    if dtype is not None and dtype not in _DISK_DTYPES.values():
        raise WeightError(f"unsupported dtype {dtype}; use torch.bfloat16, float16 or float32")
    cfg = config_from_hf_dir(root)
    files = _tensor_files(root)
    want = expected_shapes(cfg)
    skip = _SKIP[cfg.family]
    source: dict[str, str] = {}  # our name -> name in the file
    problems: list[str] = []
    for name in files:
        if skip.search(name):
            continue
        ours = canonical_name(cfg, name)
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied duplicate of the embedding
        if ours not in want:
            problems.append(f"unexpected tensor {name!r} (not part of this {cfg.family} model)")
        elif ours in source:
            problems.append(f"tensor {ours!r} appears twice (as {source[ours]!r} and {name!r})")
        else:
            source[ours] = name
    for ours, shape in want.items():
        if ours not in source:
            problems.append(f"missing tensor {ours!r} (expected shape {_shape_str(shape)})")
    by_file: dict[Path, list[str]] = {}
    for ours, name in source.items():
        by_file.setdefault(files[name], []).append(ours)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            for ours in names:
                s = h.get_slice(source[ours])
                shape, dt = tuple(s.get_shape()), s.get_dtype()
                if shape != want[ours]:
                    problems.append(f"tensor {source[ours]!r} has shape {_shape_str(shape)}, "
                                    f"expected {_shape_str(want[ours])}")
                elif dt not in _DISK_DTYPES:
                    problems.append(f"tensor {source[ours]!r} has unsupported dtype {dt}")
    if problems:
        more = f" (and {len(problems) - 8} more problems)" if len(problems) > 8 else ""
        raise WeightError("; ".join(problems[:8]) + more)
    weights: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as h:
            for ours in names:
                raw = h.get_tensor(source[ours])
                weights[ours] = raw.to(device=device, dtype=raw.dtype if dtype is None else dtype)
    return cfg, {n: weights[n] for n in want}


def save_checkpoint(cfg: HybridConfig, weights: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write config.json + model.safetensors in the hub layout (for tests and the oracle)."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))  # type: ignore[attr-defined]
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "model.safetensors"),
              metadata={"format": "pt"})
    return root


# ---- random weights ----------------------------------------------------------------------------
def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


_RESIDUAL_OUT = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "w2.weight")


def _inv_softplus_dt(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """dt_bias as Mamba/FLA initialise it: softplus^-1 of dt, log-uniform in [1e-3, 1e-1]."""
    u = torch.rand(shape, generator=gen)
    dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def random_tensor(cfg: HybridConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One fp32 tensor of the random init (scales chosen so a deep model stays well-conditioned):

    - RMSNorm weights 1 + N(0, 0.1^2); Qwen3.5's (1 + w) norms store w ~ N(0, 0.1^2);
    - projections N(0, 1/fan_in) (unit-variance outputs); residual-stream outputs (o_proj,
      out_proj, down_proj, expert w2) N(0, 1/(2 L fan_in)), so 2L additions stay O(1);
    - embedding and LM head N(0, 1/hidden); depthwise conv weights N(0, 1/K), biases N(0, 0.1^2);
    - decays as trained models are initialised: A_log = log U(1, 16), dt_bias = softplus^-1 of a
      log-uniform dt in [1e-3, 1e-1], D = 1 + N(0, 0.1^2); router bias N(0, 0.1^2).
    """
    gen = _generator(seed, name)
    n_layers = cfg.num_layers
    if name.endswith("A_log"):
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen))
    if name.endswith("dt_bias"):
        return _inv_softplus_dt(shape, gen)
    if name.endswith(".D"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(("e_score_correction_bias", "conv1d.bias")):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if len(shape) == 1:  # norm weights
        zero_centered = cfg.family == "qwen3_5" and not name.endswith("linear_attn.norm.weight")
        return (0.0 if zero_centered else 1.0) + 0.1 * torch.randn(shape, generator=gen)
    if name in (embed_name(cfg), "lm_head.weight"):
        return torch.randn(shape, generator=gen) / math.sqrt(cfg.hidden_size)
    fan_in = shape[-1]
    if name.endswith(_RESIDUAL_OUT):
        return torch.randn(shape, generator=gen) / math.sqrt(fan_in * 2 * n_layers)
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def random_weights(
    cfg: HybridConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Deterministic random weights for `cfg` (scales in `random_tensor`).

    Every value is bf16-representable whatever `dtype` is, so an fp32 run and a bf16 run of one
    seed describe the same model.
    """
    if dtype not in _DISK_DTYPES.values():
        raise WeightError(f"unsupported dtype {dtype}; use torch.bfloat16, float16 or float32")
    out = {}
    for name, shape in expected_shapes(cfg).items():
        t = random_tensor(cfg, name, shape, seed).to(torch.bfloat16)
        out[name] = t if dtype == torch.bfloat16 else t.to(dtype)
    return out


def load_model(
    spec: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[HybridConfig, dict[str, torch.Tensor]]:
    """A hybrid preset name -> random weights from `seed`; a directory -> its checkpoint."""
    if spec in PRESETS:
        cfg = PRESETS[spec]
        return cfg, random_weights(cfg, seed, dtype)
    if Path(spec).is_dir():
        return load_checkpoint(spec, dtype=dtype)
    raise ConfigError(
        f"{spec!r} is neither a hybrid preset ({', '.join(PRESETS)}) nor a directory")


def check_weights(cfg: HybridConfig, weights: dict[str, torch.Tensor]) -> None:
    """WeightError unless `weights` has exactly the names and shapes of `expected_shapes(cfg)`."""
    want = expected_shapes(cfg)
    problems = [f"missing tensor {n!r}" for n in want if n not in weights]
    problems += [f"unexpected tensor {n!r}" for n in weights if n not in want]
    problems += [
        f"tensor {n!r} has shape {_shape_str(tuple(weights[n].shape))}, expected "
        f"{_shape_str(s)}" for n, s in want.items()
        if n in weights and tuple(weights[n].shape) != s
    ]
    if problems:
        more = f" (and {len(problems) - 8} more problems)" if len(problems) > 8 else ""
        raise WeightError("; ".join(problems[:8]) + more)
