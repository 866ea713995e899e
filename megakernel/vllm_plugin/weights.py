"""Hugging Face-named weights from a loaded vLLM model: what `pack_weights` takes, read from
vLLM's own parameters (its fused qkv_proj and gate_up_proj split back), never from the
checkpoint again.

An FP8 model (`cfg.quant`, docs/FP8.md) comes back in megakernel's in-memory FP8 form: each
quantized `X.weight` as e4m3 codes and `X.weight_scale` as fp32 scales of
`cfg.quant.scale_shape`. The parameters are read as vLLM's FP8 linear methods hold them when
`load_weights` returns, before `process_weights_after_loading` transposes, requantizes or
prepacks them (docs/VLLM.md, "FP8 checkpoints"):

- compressed-tensors channel (W8A8 / W8A16 FP8): `weight` [N, K] e4m3, `weight_scale` [N, 1];
- compressed-tensors tensor, `fp8` per tensor: `weight` [N, K] e4m3, `weight_scale` [shards]
  (one per fused shard);
- `fp8` block [128, 128]: `weight` [N, K] e4m3, `weight_scale_inv` [ceil(N/128), ceil(K/128)].

N is the fused matrix's rows ([q | k | v], [gate | up]); a shard's scales are its rows of the
channel grid, its own per-tensor scale repeated over its rows, or its block rows (vLLM requires
every fused shard but the last to be a multiple of the block's rows).

A model class whose parameters are named otherwise than its checkpoint (Nemotron-H: `backbone`
is `model`, `embeddings` is `embed_tokens`) names them through its `hf_to_vllm_mapper`; a
parameter vLLM holds transformed is transformed back (`FROM_VLLM`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megakernel.models import fp8
from megakernel.models.config import ModelConfig
from megakernel.models.fp8 import E4M3, Fp8Error
from megakernel.models.weights import WeightError, check_weights, expected_shapes

# vLLM's scale parameters of an FP8 linear layer: the block form's, then the channel / tensor one
SCALE_PARAMS = (".weight_scale_inv", ".weight_scale")


# (vLLM's name suffix, the checkpoint's) -> the checkpoint's tensor from vLLM's parameter
FROM_VLLM: dict[tuple[str, str], Callable[[torch.Tensor], torch.Tensor]] = {
    (".A", ".A_log"): lambda a: torch.log(-a.float()),  # MambaMixer2 loads A = -exp(A_log)
}


def _checkpoint_names(cfg: ModelConfig, mapper) -> dict[str, str]:  # noqa: ANN001
    """vLLM's (unfused) parameter name -> the checkpoint's, for each tensor `cfg` expects that
    `mapper` (vLLM's WeightsMapper of the model class, or None) renames; its fusing of q/k/v and
    gate/up is left to `_shards`."""
    if mapper is None:
        return {}
    plain = dataclasses.replace(mapper, orig_to_new_stacked={})
    out = {}
    for name in expected_shapes(cfg):
        theirs = plain.map_name(name)
        if theirs is not None and theirs != name:
            out[theirs] = name
            out[fp8.scale_name(theirs)] = fp8.scale_name(name)
    return out


def _from_vllm(theirs: str, ours: str, t: torch.Tensor) -> torch.Tensor:
    for (a, b), inverse in FROM_VLLM.items():
        if theirs.endswith(a) and ours.endswith(b):
            return inverse(t)
    return t


def _shards(cfg: ModelConfig, name: str, rows: int) -> list[tuple[str, int]]:
    """The Hugging Face names and row counts a vLLM parameter of `rows` rows holds."""
    if ".qkv_proj." in name:
        attn = cfg.kind_config("attention")
        sizes = (attn.q_size, attn.kv_size, attn.kv_size)
        return [(name.replace("qkv_proj", p), r)
                for p, r in zip(("q_proj", "k_proj", "v_proj"), sizes, strict=True)]
    if ".gate_up_proj." in name:
        return [(name.replace("gate_up_proj", p), rows // 2) for p in ("gate_proj", "up_proj")]
    return [(name, rows)]


def _scale_param(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    base = name.removesuffix(".weight")
    found = [base + s for s in SCALE_PARAMS if base + s in params]
    if len(found) != 1:
        raise Fp8Error(f"vLLM's e4m3 parameter {name!r} has "
                       f"{'no scale' if not found else 'two scales ' + str(found)}")
    return params[found[0]].to(torch.float32)


def _split_scales(fmt: fp8.Fp8Format, name: str, scale: torch.Tensor, k: int,
                  sizes: list[int]) -> list[torch.Tensor]:
    """vLLM's scale parameter of a (fused) matrix [sum(sizes), K] -> each shard's scale grid in
    megakernel's form (`fmt.scale_shape`)."""
    rows = sum(sizes)
    if scale.dim() <= 1 and scale.numel() == len(sizes):  # per tensor: one per shard
        if fmt.granularity != "channel":
            raise Fp8Error(f"{name}: per-tensor scales {tuple(scale.shape)} in a model of "
                           f"{fmt.describe()}")
        return [s.reshape(1, 1).expand(r, 1).contiguous()
                for s, r in zip(scale.reshape(-1), sizes, strict=True)]
    want = fmt.scale_shape((rows, k))
    if tuple(scale.shape) != want:
        raise Fp8Error(f"{name}: vLLM's scale has shape {tuple(scale.shape)}, expected {want} "
                       f"for a {[rows, k]} matrix ({fmt.describe()})")
    if fmt.granularity == "channel":
        return list(scale.split(sizes))
    br = fmt.block[0]
    if any(r % br for r in sizes[:-1]):
        raise Fp8Error(f"{name}: fused shards {sizes} do not start on {br}-row scale blocks")
    return list(scale.split([-(-r // br) for r in sizes]))


def hf_weights(cfg: ModelConfig, model: torch.nn.Module,
               mapper=None) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """vLLM parameter names -> ours: `qkv_proj` [q | k | v] rows, `gate_up_proj` [gate | up];
    renamed through `mapper` (the model class's hf_to_vllm_mapper; module docstring); the
    vocabulary padding of vLLM's embedding and LM head dropped; a tied LM head left out.
    An FP8 model's quantized matrices come back as e4m3 codes plus `X.weight_scale` (module
    docstring), everything else in bf16. ValueError (WeightError / Fp8Error) naming what does
    not fit `cfg`: a missing or misshaped tensor, a scale missing or of another format, a matrix
    quantized that `cfg` keeps in bf16 or the other way round."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name.endswith(SCALE_PARAMS):
            continue  # read with its weight
        if t.dim() == 0:  # vLLM's attention's own scalars (q/k/v/prob scales)
            out[name] = t
            continue
        shards = _shards(cfg, name, t.shape[0])
        sizes = [r for _, r in shards]
        if sum(sizes) != t.shape[0]:
            raise WeightError(f"{name}: {t.shape[0]} rows, expected {sizes} fused")
        parts = t.split(sizes) if len(shards) > 1 else [t]
        if t.dtype == E4M3:
            if cfg.quant is None:
                raise Fp8Error(f"vLLM holds {name!r} in e4m3 but the model's config has no "
                               "FP8 quantization_config")
            scales = _split_scales(cfg.quant, name, _scale_param(params, name), t.shape[-1],
                                   sizes)
            for (part, _), codes, s in zip(shards, parts, scales, strict=True):
                out[part], out[fp8.scale_name(part)] = codes, s
        else:
            for (part, _), rows in zip(shards, parts, strict=True):
                out[part] = rows
    names = _checkpoint_names(cfg, mapper)
    out = {names.get(n, n): _from_vllm(n, names.get(n, n), t) for n, t in out.items()}
    want = expected_shapes(cfg)
    for name in (cfg.embed_name, cfg.lm_head_name):
        if name in out and name in want:
            out[name] = out[name][: want[name][0]]
    quantized = set(fp8.quantized_names(cfg))
    weights: dict[str, torch.Tensor] = {}
    for n in want:
        if n not in out:
            continue
        t = out[n]
        if n in quantized:
            if t.dtype != E4M3:
                raise Fp8Error(f"{n}: vLLM holds it in {t.dtype}, but the model's FP8 format "
                               f"({cfg.quant.describe()}) quantizes it")
            weights[n] = t.contiguous()
        elif t.dtype == E4M3:
            raise Fp8Error(f"{n}: vLLM holds it in e4m3, but the model's FP8 format keeps it "
                           "in bf16")
        else:
            weights[n] = t.to(torch.bfloat16).contiguous()
    check_weights(cfg, weights)  # names the missing or misshaped tensor
    for n in quantized:
        fp8.check_codes(n, weights[n])
        s = out[fp8.scale_name(n)].to(torch.float32).contiguous()
        fp8.check_scale(n, s, tuple(weights[n].shape), cfg.quant)
        weights[fp8.scale_name(n)] = s
    return weights
