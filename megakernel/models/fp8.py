"""FP8 (e4m3) weights: the format, quantizing and dequantizing, and the packed scale layout.

A quantized tensor `X.weight` travels as e4m3 codes under its own name plus `X.weight_scale` (fp32,
`Fp8Format.scale_shape`); the weight is fp32(code) * scale (docs/FP8.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megakernel.common.errors import ConfigError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale"  # "X.weight" -> "X.weight_scale"
GRANULARITIES = ("channel", "block")
WEIGHT_FORMATS = ("bf16", "fp8")


class Fp8Error(ValueError):
    """FP8 weights that are not what their format says (bad scales, wrong shapes or dtypes)."""


@dataclass(frozen=True)
class Fp8Format:
    """How a model's FP8 weights are scaled (docs/FP8.md)."""

    granularity: str = "channel"
    block: tuple[int, int] = (128, 128)
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"unsupported FP8 scale granularity {self.granularity!r}; "
                              f"supported: {', '.join(GRANULARITIES)}")
        if (not isinstance(self.block, tuple) or len(self.block) != 2
                or not all(isinstance(b, int) and b > 0 for b in self.block)):
            raise ConfigError(f"FP8 block size must be two positive integers, got {self.block!r}")
        if self.granularity == "block" and self.block != (128, 128):
            raise ConfigError(f"FP8 block size {list(self.block)} is not supported; only "
                              "[128, 128] (the kernel's scale chunk is 128 inputs)")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale grid of a Hugging Face matrix [R, K]."""
        r, k = shape
        if self.granularity == "channel":
            return (r, 1)
        return (-(-r // self.block[0]), -(-k // self.block[1]))

    def chunk(self, k: int) -> int:
        """Inputs per packed scale along a row of length k."""
        return k if self.granularity == "channel" else self.block[1]

    def chunks(self, k: int) -> int:
        """Packed scales per row of length k (C)."""
        return -(-k // self.chunk(k))

    def row_scales(self, scale: torch.Tensor, rows: int, k: int) -> torch.Tensor:
        """The scale grid as one run of C scales per row: [rows, C] fp32."""
        s = scale.to(torch.float32)
        if self.granularity == "block":
            s = s.repeat_interleave(self.block[0], dim=0)[:rows]
        return s.reshape(rows, self.chunks(k))

    def expand(self, scale: torch.Tensor, rows: int, k: int) -> torch.Tensor:
        """The scale of every element: [rows, k] fp32."""
        return spread(self.row_scales(scale, rows, k), self.chunk(k), k)

    def describe(self) -> str:
        g = ("per output channel" if self.granularity == "channel"
             else f"per {self.block[0]}x{self.block[1]} block")
        return f"fp8 e4m3, scales {g}" + (", LM head fp8" if self.lm_head else "")

    # ---- Hugging Face form ---------------------------------------------------------------------
    def to_hf(self) -> dict[str, Any]:
        """`quantization_config` of a checkpoint in this format (the block form is transformers'
        "fp8"; the channel form is compressed-tensors')."""
        ignore = [] if self.lm_head else ["lm_head"]
        if self.granularity == "block":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(self.block), "modules_to_not_convert": ignore}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "input_activations": None,
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                "symmetric": True, "dynamic": False}}},
                "ignore": ignore}


def spread(row_scales: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Row-wise scales [R, C] (one per `chunk` inputs, the last chunk short) -> the scale of
    every element [R, k]."""
    return row_scales.repeat_interleave(chunk, dim=1)[:, :k]


def from_hf(qc: Any) -> Fp8Format | None:
    """The format of a Hugging Face `quantization_config` (None: absent); ConfigError naming what
    is not supported."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"config field 'quantization_config' must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"FP8 format {qc.get('fmt')!r} is not supported; only e4m3")
        block = qc.get("weight_block_size")
        # transformers skips the LM head (its default skips) unless the list is given
        ignore = qc.get("modules_to_not_convert")
        head = False if ignore is None else _head_quantized(ignore)
        if block is None:
            return Fp8Format("channel", lm_head=head)
        if not isinstance(block, list) or len(block) != 2:
            raise ConfigError(f"quantization_config.weight_block_size must be [rows, cols], got "
                              f"{block!r}")
        return Fp8Format("block", tuple(int(b) for b in block), lm_head=head)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ConfigError(f"unsupported quantization method {method!r}; supported: fp8 (block-scaled "
                      "e4m3) and compressed-tensors (float-quantized e4m3 weights)")


def _head_quantized(ignore: Any) -> bool:
    if not isinstance(ignore, list):
        raise ConfigError(f"the quantization config's ignore list must be a list, got {ignore!r}")
    return not any(isinstance(n, str) and n.split(".")[-1] == "lm_head" for n in ignore)


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Format:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ConfigError("compressed-tensors: exactly one config group is supported, got "
                          f"{None if not isinstance(groups, dict) else len(groups)}")
    g = next(iter(groups.values()))
    w = g.get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ConfigError(f"compressed-tensors: only 8-bit float (e4m3) weights are supported, "
                          f"got type={w.get('type')!r} num_bits={w.get('num_bits')!r}")
    if w.get("dynamic"):
        raise ConfigError("compressed-tensors: dynamic weight scales are not supported")
    strategy = w.get("strategy")
    lm_head = _head_quantized(qc.get("ignore") or [])
    if strategy in ("channel", "tensor"):
        return Fp8Format("channel", lm_head=lm_head)
    if strategy == "block":
        block = w.get("block_structure") or [128, 128]
        return Fp8Format("block", tuple(int(b) for b in block), lm_head=lm_head)
    raise ConfigError(f"compressed-tensors: weight strategy {strategy!r} is not supported; "
                      "supported: channel, tensor, block")


def parse_weights(weights: str | None) -> str:
    """A `weights=` / `--weights` value: "bf16" (the checkpoint's own form) or "fp8"."""
    w = "bf16" if weights is None else weights
    if w not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weights format {weights!r}; supported: "
                          f"{', '.join(WEIGHT_FORMATS)}")
    return w


# ---- which tensors --------------------------------------------------------------------------
def quantized_names(cfg: Any) -> list[str]:
    """Hugging Face names of the tensors `cfg`'s format stores in e4m3 (the layer kinds'
    `quantized` declarations, plus the LM head when the format says so)."""
    from megakernel.layers import kind

    fmt = cfg.quant
    if fmt is None:
        return []
    out = [blk.prefix + n for blk in cfg.blocks for n in kind(blk.kind).quantized(blk, cfg)]
    if fmt.lm_head and not cfg.tie_word_embeddings:
        out.append(cfg.lm_head_name)
    return out


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


# ---- quantize / dequantize ------------------------------------------------------------------
def quantize(w: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix [R, K] -> (e4m3 codes [R, K], fp32 scales `fmt.scale_shape`): each scale maps its
    group's largest magnitude to 448 (an all-zero group gets scale 1)."""
    x = w.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise Fp8Error("cannot quantize a matrix with non-finite values")
    r, k = x.shape
    if fmt.granularity == "channel":
        amax = x.abs().amax(dim=1, keepdim=True)
    else:
        br, bk = fmt.block
        pr, pk = -(-r // br) * br, -(-k // bk) * bk
        padded = torch.nn.functional.pad(x.abs(), (0, pk - k, 0, pr - r))
        amax = padded.reshape(pr // br, br, pk // bk, bk).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (x / fmt.expand(scale, r, k)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp32(code) * scale, elementwise in fp32: [R, K]."""
    r, k = codes.shape
    return codes.to(torch.float32) * fmt.expand(scale, r, k)


def check_scale(name: str, scale: torch.Tensor, shape: tuple[int, int], fmt: Fp8Format) -> None:
    """Fp8Error naming `name` unless its scale grid has the format's shape and is finite and
    positive."""
    want = fmt.scale_shape(shape)
    if tuple(scale.shape) != want:
        raise Fp8Error(f"{scale_name(name)}: shape {tuple(scale.shape)}, expected {want} for a "
                       f"{list(shape)} matrix ({fmt.describe()})")
    s = scale.to(torch.float32)
    if not bool(torch.isfinite(s).all()):
        raise Fp8Error(f"{scale_name(name)}: non-finite scale")
    if not bool((s > 0).all()):
        raise Fp8Error(f"{scale_name(name)}: scales must be positive, found "
                       f"{float(s.min()):g}")


def check_codes(name: str, codes: torch.Tensor) -> None:
    """Fp8Error naming `name` if any e4m3 code is NaN (S.1111.111: 0x7f, 0xff): e4m3fn has no
    infinities, and a quantizer never writes NaN, so such a code is corruption."""
    if codes.dtype != E4M3:
        raise Fp8Error(f"{name}: dtype {codes.dtype}, expected e4m3 codes ({E4M3})")
    nan = (codes.view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        first = tuple(int(i) for i in nan.nonzero()[0])
        raise Fp8Error(f"{name}: {int(nan.sum())} NaN e4m3 code(s) (0x7f/0xff), the first at "
                       f"{list(first)}")


class QuantizedWeights(Mapping):
    """A bf16 weight mapping seen in FP8: the quantized names read as e4m3 codes and their
    `_scale` names as scales, quantized on first read (one matrix at a time, so a lazily drawn
    preset is never held twice); other names pass through."""

    def __init__(self, cfg: Any, base: Mapping[str, torch.Tensor]):
        self.cfg, self.base = cfg, base
        self.names = set(quantized_names(cfg))
        self._last: tuple[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def _pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != name:
            self._last = (name, quantize(self.base[name], self.cfg.quant))
        return self._last[1]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.names:
            return self._pair(name)[0]
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self.names:
            return self._pair(name[: -len(SCALE_SUFFIX)])[1]
        return self.base[name]

    def __iter__(self) -> Iterator[str]:
        for n in self.base:
            yield n
            if n in self.names:
                yield scale_name(n)

    def __len__(self) -> int:
        return len(self.base) + len(self.names)


def dequantized(cfg: Any, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's weights with every quantized matrix dequantized to fp32 (the FP8 model's
    truth); the scale entries are consumed."""
    fmt, names = cfg.quant, set(quantized_names(cfg))
    out = {}
    for n in weights:
        if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in names:
            continue
        if n not in names:
            out[n] = weights[n]
            continue
        codes = weights[n]
        if codes.dtype != E4M3 or codes.dim() != 2:
            raise Fp8Error(f"{n}: an FP8 model's quantized matrix must be 2-D e4m3 codes, got "
                           f"{codes.dtype} {tuple(codes.shape)}")
        if scale_name(n) not in weights:
            raise Fp8Error(f"{n}: its scale {scale_name(n)!r} is missing")
        check_scale(n, weights[scale_name(n)], tuple(codes.shape), fmt)
        out[n] = dequantize(codes, weights[scale_name(n)], fmt)
    return out


__all__ = ["E4M3", "E4M3_MAX", "Fp8Error", "Fp8Format", "QuantizedWeights", "check_codes",
           "check_scale", "dequantize", "dequantized", "from_hf", "parse_weights", "quantize",
           "quantized_names", "scale_name", "spread"]
