"""Weights: the Hugging Face tensor layout, checkpoint loading, and seeded random weights, for
every family.

Weights are a plain `dict[str, torch.Tensor]` keyed by Hugging Face names (linear weights [out,
in] as in torch). A tied model has no "lm_head.weight" entry: the LM head reads the embedding.
The names and shapes come from the blocks' layer kinds (`expected_shapes`); a family maps the names
found in published checkpoints to these (`ModelConfig.canonical_name`: prefixes, skipped vision
towers and MTP heads, alternative spellings).

Loading opens safetensors files lazily and converts one tensor at a time, so the host never holds
two copies of the model. Every name, shape and dtype is checked from the file headers before any
data is read, and every tensor is checked to be finite as it is read.

FP8 checkpoints (docs/FP8.md, "Checkpoints") load into the in-memory FP8 form: every name of
`fp8.quantized_names(cfg)` holds e4m3 codes and `name + "_scale"` its fp32 scale grid. Both
Hugging Face forms are read: transformers' block-scaled "fp8" (`X.weight_scale_inv`) and
compressed-tensors' float-quantized (`X.weight_scale`, per channel or per tensor); activation
scales (`X.input_scale`) are skipped, since megakernel's activations stay bf16 (weight-only FP8).

Random weights are drawn per tensor from a generator seeded by (seed, tensor name), at scales that
keep the residual stream bounded over many layers (`init_stats`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from megakernel.common.errors import UserError
from megakernel.models import fp8
from megakernel.models.config import ModelConfig, expected_shapes
from megakernel.models.fp8 import E4M3, Fp8Error, Fp8Format

__all__ = ["WeightError", "expected_shapes", "load_checkpoint", "random_weights",
           "save_checkpoint", "check_weights", "keep_fp32", "quantize_weights"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DISK_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
               "F8_E4M3": E4M3}
FP8_DISK = "F8_E4M3"
LOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what `dtype=` converts to
SCALE_DTYPES = ("F32", "BF16", "F16")  # scales on disk (read as fp32)
# a weight's scale in the checkpoint: transformers' fp8 block form, then compressed-tensors'
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
# static activation scales of W8A8 checkpoints: skipped (activations stay bf16)
ACTIVATION_SCALES = (".input_scale", ".activation_scale")


class WeightError(UserError, ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not match its config."""


# ---- layout -------------------------------------------------------------------------------------
def tensor_roles(cfg: ModelConfig) -> dict[str, str]:
    """Every tensor name -> its random-init role (`init_stats`)."""
    from megakernel.layers import kind

    roles = {cfg.embed_name: "embed", cfg.final_norm_name: "norm", cfg.lm_head_name: "embed"}
    for m in cfg.mtp:  # MTP norms in the model's RMSNorm form; the [H, 2H] fusion a projection
        roles.update({n: "norm" for n in m.norms()})
        roles[m.proj] = "proj"
    for blk in _all_blocks(cfg):
        roles[blk.norm] = "norm"
        kd = kind(blk.kind)
        for local in kd.shapes(blk, cfg):
            roles[blk.prefix + local] = kd.init_role(local, blk)
    return roles


def _all_blocks(cfg: ModelConfig) -> tuple:
    """The model's blocks, then the enabled MTP modules' decoder-layer blocks."""
    return cfg.blocks + tuple(b for m in cfg.mtp for b in m.blocks)


def keep_fp32(cfg: ModelConfig) -> set[str]:
    """Names of the tensors transformers keeps in fp32 (not rounded in bf16 mode)."""
    from megakernel.layers import kind

    want = expected_shapes(cfg)
    return {blk.prefix + n for blk in _all_blocks(cfg) for n in kind(blk.kind).fp32_params
            if blk.prefix + n in want}


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """WeightError unless `weights` has exactly the names and shapes of `expected_shapes(cfg)`
    (a tied model may carry a duplicate LM head equal to the embedding)."""
    want = expected_shapes(cfg)
    problems = [f"missing tensor {n!r} (expected shape {_shape_str(s)})"
                for n, s in want.items() if n not in weights]
    for n, t in weights.items():
        if n not in want:
            if (n == cfg.lm_head_name and cfg.tie_word_embeddings and cfg.embed_name in weights
                    and torch.equal(t, weights[cfg.embed_name])):
                continue
            problems.append(f"unexpected tensor {n!r}")
        elif tuple(t.shape) != want[n]:
            problems.append(f"tensor {n!r} has shape {_shape_str(tuple(t.shape))}, expected "
                            f"{_shape_str(want[n])}")
    _raise(problems)


def _shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(x) for x in shape) + "]"


def _raise(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 8} more problems)" if len(problems) > 8 else ""
        raise WeightError("; ".join(problems[:8]) + more)


# ---- checkpoint loading ------------------------------------------------------------------------
def _safe_open(path: Path):  # noqa: ANN202
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise WeightError(f"{path.name} is not a readable safetensors file: {e}") from None


def _tensor_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded index)."""
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {str(name): root / str(fname) for name, fname in weight_map.items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError
                ) as e:
            raise WeightError(f"{index} is not a safetensors index with a 'weight_map': "
                              f"{e}") from None
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise WeightError(f"shard {f.name} listed in {INDEX_FILE} is missing from {root}")
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        with _safe_open(single) as f:
            return {name: single for name in f.keys()}
    raise WeightError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")


def _by_file(names: dict[str, str], files: dict[str, Path]) -> dict[Path, list[str]]:
    """Our names grouped by the file holding them (`names`: ours -> name in the file)."""
    out: dict[Path, list[str]] = {}
    for ours, theirs in names.items():
        out.setdefault(files[theirs], []).append(ours)
    return out


def _scale_base(name: str) -> str | None:
    """The weight a checkpoint scale tensor scales ("X.weight_scale_inv" -> "X.weight"); None
    for any other tensor."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


def _scale_shapes(fmt: Fp8Format, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The scale shapes a checkpoint may store for an e4m3 matrix: the format's grid, and for
    channel granularity a per-tensor scale ([], [1], or compressed-tensors' [1, 1]), broadcast
    to [R, 1] on load."""
    grid = fmt.scale_shape(shape)
    if fmt.granularity != "channel":
        return [grid]
    return [grid] + [s for s in [(), (1,), (1, 1)] if s != grid]


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", quant: Fp8Format | None = None,
                    mtp: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a Hugging Face checkpoint directory (config.json + safetensors, single or sharded)
    of any registered family.

    `dtype=None` keeps each tensor's dtype from disk (bf16, fp16 or fp32); otherwise every tensor
    is converted to `dtype`, one at a time. A tied model's duplicate LM head is checked to equal
    the embedding and dropped.

    FP8 (config.json's `quantization_config`, or `quant` for a checkpoint without one: the bf16
    checkpoint quantized on load) gives the FP8 form: each name of `fp8.quantized_names(cfg)`
    as e4m3 codes plus `name + "_scale"` (fp32, `quant.scale_shape`); `dtype` applies to the
    other tensors. The checkpoint's e4m3 weights come with `X.weight_scale_inv` (transformers'
    fp8: the multiplier, w = code * scale, despite the name) or `X.weight_scale`
    (compressed-tensors): per 128x128 block for block granularity; per channel [R, 1] or per
    tensor ([], [1], [1, 1]: broadcast to [R, 1]) for channel granularity. A quantized name the
    checkpoint stores in bf16/fp16/fp32 is quantized on load (`fp8.quantize`, after `dtype`);
    an e4m3 tensor the format keeps unquantized (MLA's kv_b, an LM head) is dequantized on load
    (fp32, then as any other tensor). Activation scales (`X.input_scale`,
    `X.activation_scale`) are skipped: megakernel is weight-only FP8, its activations stay
    bf16. Scales are checked (shape and dtype from the headers; finite and positive as read)
    and e4m3 codes for NaN; WeightError names the tensor.

    MTP (multi-token prediction) modules are skipped unless `mtp=True`: then the config gets
    the depth config.json declares (`ModelConfig.declared_mtp_layers`; WeightError when it
    declares none) and the MTP tensors (`config.mtp_shapes`) are expected like any other.
    """
    from megakernel.models.registry import config_from_hf_dir

    root = Path(path)
    if not root.is_dir():
        raise WeightError(f"checkpoint directory {str(root)!r} does not exist")
    if dtype is not None and dtype not in LOAD_DTYPES:
        raise WeightError(f"unsupported dtype {dtype}; use torch.bfloat16, float16 or float32")
    cfg = config_from_hf_dir(root)
    if quant is not None and cfg.quant is None:
        cfg = cfg.replace(quant=quant)
    if mtp:
        depth = type(cfg).declared_mtp_layers(json.loads((root / "config.json").read_text()))
        if depth <= 0:
            raise WeightError(f"{root / 'config.json'} declares no MTP layers ({cfg.family})")
        cfg = cfg.replace(mtp_layers=depth)
    fmt = cfg.quant
    files = _tensor_files(root)
    want = expected_shapes(cfg)
    qnames = set(fp8.quantized_names(cfg))
    source: dict[str, str] = {}  # our name -> name in the file
    scales: dict[str, str] = {}  # our weight name -> its scale's name in the file
    problems: list[str] = []
    head_dup = None
    for name in files:
        if name.endswith(ACTIVATION_SCALES):
            continue  # W8A8's static activation scales: megakernel is weight-only FP8
        base = _scale_base(name)
        theirs = name if base is None else base
        if cfg.is_mtp_tensor(theirs):  # ours as named when enabled, else skipped
            ours = theirs if theirs in want else None
        else:
            ours = cfg.canonical_name(theirs)
        if ours is None:
            continue
        if base is not None:
            if ours in scales:
                problems.append(f"weight {base!r} has two scales ({scales[ours]!r} and "
                                f"{name!r})")
            else:
                scales[ours] = name
            continue
        if ours == cfg.lm_head_name and cfg.tie_word_embeddings:
            head_dup = name  # a tied duplicate of the embedding: checked below
            continue
        if ours not in want:
            problems.append(f"unexpected tensor {name!r} (not part of this {cfg.num_layers}-layer "
                            f"{cfg.family} model)")
        elif ours in source:
            problems.append(f"tensor {ours!r} appears twice (as {source[ours]!r} and {name!r})")
        else:
            source[ours] = name
    for ours, shape in want.items():
        if ours not in source:
            problems.append(f"missing tensor {ours!r} (expected shape {_shape_str(shape)})")
    headers = dict(source)
    if head_dup is not None:
        headers["<lm_head>"] = head_dup
    headers.update({f"<scale>{ours}": theirs for ours, theirs in scales.items()})
    meta: dict[str, tuple[tuple[int, ...], str]] = {}  # header key -> (shape, dtype)
    for f, names in _by_file(headers, files).items():
        with _safe_open(f) as h:
            present = set(h.keys())
            for ours in names:
                theirs = headers[ours]
                if theirs not in present:
                    problems.append(f"tensor {theirs!r} is listed in {INDEX_FILE} but absent from "
                                    f"{f.name}")
                    continue
                s = h.get_slice(theirs)
                meta[ours] = (tuple(s.get_shape()), s.get_dtype())
    for ours, (shape, dt) in meta.items():
        theirs = headers[ours]
        if ours.startswith("<scale>"):
            continue
        exp = want[cfg.embed_name] if ours == "<lm_head>" else want[ours]
        if shape != exp:
            problems.append(f"tensor {theirs!r} has shape {_shape_str(shape)}, expected "
                            f"{_shape_str(exp)}")
        elif dt not in DISK_DTYPES:
            problems.append(f"tensor {theirs!r} has dtype {dt}; supported on disk: "
                            f"{', '.join(DISK_DTYPES)}")
        elif dt == FP8_DISK:
            problems += _fp8_header_problems(cfg, ours, theirs, shape, scales, meta)
    for ours, theirs in scales.items():  # scales whose weight is absent or not e4m3
        if ours in source:
            weight = meta.get(ours)
        elif ours == cfg.lm_head_name and head_dup is not None:
            weight = meta.get("<lm_head>")
        else:
            problems.append(f"scale {theirs!r} has no weight {_scale_base(theirs)!r} in the "
                            "checkpoint")
            continue
        if weight is not None and weight[1] != FP8_DISK:
            problems.append(f"scale {theirs!r} scales {_scale_base(theirs)!r}, which is stored "
                            f"in {weight[1]}, not {FP8_DISK}")
    _raise(problems)
    from megakernel.common.progress import stage

    e4m3 = {ours for ours in source if meta[ours][1] == FP8_DISK}
    scale_of = _read_scales(cfg, files, source, {o: scales[o] for o in e4m3}, meta)
    weights: dict[str, torch.Tensor] = {}
    gb = sum(math.prod(want[n]) * 2 for n in source) / 1e9  # bf16-sized: a size, for the eye
    with stage(f"reading {len(source)} tensors (~{gb:.1f} GB) from {root}", quiet=gb < 0.5):
        for ours, raw in _iter_tensors(files, source):
            if ours in e4m3 and ours in qnames:  # the checkpoint's own FP8 matrix
                weights[ours] = raw.to(device=device)
                weights[fp8.scale_name(ours)] = scale_of[ours].to(device=device)
                continue
            if ours in e4m3:  # e4m3 on disk, kept unquantized by the format: its fp32 values
                raw = fp8.dequantize(raw, scale_of[ours], fmt)
            t = raw if dtype is None else raw.to(dtype)
            del raw  # drop the unconverted tensor before reading the next one
            if ours in qnames:  # an unquantized projection of an FP8 model: quantized on load
                codes, scale = fp8.quantize(t, fmt)
                weights[ours] = codes.to(device=device)
                weights[fp8.scale_name(ours)] = scale.to(device=device)
            else:
                weights[ours] = t.to(device=device)
            del t
    if head_dup is not None:
        for _, head in _iter_tensors(files, {"<lm_head>": head_dup}):
            for _, emb in _iter_tensors(files, {"<embed>": source[cfg.embed_name]}):
                if not (emb.dtype == head.dtype and torch.equal(emb, head)):
                    raise WeightError(f"{head_dup!r} differs from {source[cfg.embed_name]!r} but "
                                      "config.json sets tie_word_embeddings=true")
    out: dict[str, torch.Tensor] = {}
    for n in want:
        out[n] = weights[n]
        if n in qnames:
            out[fp8.scale_name(n)] = weights[fp8.scale_name(n)]
    return cfg, out


def _fp8_header_problems(cfg: ModelConfig, ours: str, theirs: str, shape: tuple[int, ...],
                         scales: dict[str, str],
                         meta: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """What is wrong, from the headers alone, with e4m3 tensor `theirs` (our `ours`) and its
    scale."""
    if cfg.quant is None:
        return [f"tensor {theirs!r} is stored in {FP8_DISK} but config.json has no "
                "quantization_config"]
    if len(shape) != 2:
        return [f"tensor {theirs!r} is stored in {FP8_DISK} but is not a matrix (shape "
                f"{_shape_str(shape)})"]
    if ours == "<lm_head>":
        return [f"tensor {theirs!r}: a tied LM head stored in {FP8_DISK} is not supported"]
    if ours not in scales:
        return [f"tensor {theirs!r} is stored in {FP8_DISK} but the checkpoint has no scale for "
                f"it ({theirs}_scale_inv or {theirs}_scale)"]
    sname = scales[ours]
    sshape, sdt = meta.get(f"<scale>{ours}", (None, None))
    if sshape is None:
        return []  # absent from its shard: reported already
    out = []
    allowed = _scale_shapes(cfg.quant, shape)
    if sshape not in allowed:
        out.append(f"scale {sname!r} has shape {_shape_str(sshape)}, expected "
                   f"{' or '.join(_shape_str(a) for a in allowed)} for the "
                   f"{_shape_str(shape)} matrix {theirs!r} ({cfg.quant.describe()})")
    if sdt not in SCALE_DTYPES:
        out.append(f"scale {sname!r} has dtype {sdt}; supported: {', '.join(SCALE_DTYPES)}")
    return out


def _read_scales(cfg: ModelConfig, files: dict[str, Path], source: dict[str, str],
                 scales: dict[str, str], meta: dict[str, tuple[tuple[int, ...], str]]
                 ) -> dict[str, torch.Tensor]:
    """The scales of the checkpoint's e4m3 tensors in the canonical form (fp32,
    `scale_shape`: a per-tensor scalar broadcast to [R, 1]), checked finite and positive; read
    before the weights (they are small) so each weight is converted as it is read."""
    out = {}
    for ours, s in _iter_tensors(files, scales):
        shape = meta[ours][0]
        s = s.to(torch.float32)
        if tuple(s.shape) != cfg.quant.scale_shape(shape):  # a per-tensor scale
            s = s.reshape(1, 1).expand(shape[0], 1).clone()
        try:
            fp8.check_scale(ours, s, shape, cfg.quant)
        except Fp8Error as e:
            msg = str(e).removeprefix(fp8.scale_name(ours) + ": ")
            raise WeightError(f"scale {scales[ours]!r} of {source[ours]!r}: {msg}") from None
        out[ours] = s
    return out


def _iter_tensors(files: dict[str, Path], names: dict[str, str]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our name, tensor) one at a time, each file opened once; WeightError naming a
    tensor that cannot be read, is not finite, or holds NaN e4m3 codes."""
    for path, ours in _by_file(names, files).items():
        with _safe_open(path) as f:
            for n in ours:
                try:
                    t = f.get_tensor(names[n])
                except Exception as e:  # truncated or corrupt data
                    raise WeightError(f"cannot read tensor {names[n]!r} from {path.name}: "
                                      f"{e}") from None
                if t.dtype == E4M3:
                    try:
                        fp8.check_codes(names[n], t)
                    except Fp8Error as e:
                        raise WeightError(f"{e} (in {path.name})") from None
                elif t.is_floating_point() and not _finite(t):
                    raise WeightError(f"tensor {names[n]!r} in {path.name} holds NaN or Inf "
                                      "values")
                yield n, t
                del t  # or the suspended frame keeps it alive while the next one is read


def _finite(t: torch.Tensor) -> bool:
    """Every element finite. An fp32 sum is finite unless an element is NaN/Inf (they never cancel
    back to finite) or finite values overflow it (then the exact check decides): about half the
    cost of isfinite(t).all() on a CPU, which matters at checkpoint scale."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def save_checkpoint(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], path: str | Path
                    ) -> Path:
    """Write config.json + model.safetensors (for tests and the oracle). An FP8 model (the
    in-memory FP8 form, `cfg.quant`) is written in its format's checkpoint form, with
    `quantization_config` in config.json: block granularity as transformers' fp8
    (`X.weight_scale_inv`), channel granularity as compressed-tensors (`X.weight_scale`)."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.hf_config(), indent=1))
    inv = cfg.quant is not None and cfg.quant.granularity == "block"
    scale_names = {fp8.scale_name(n) for n in fp8.quantized_names(cfg)} if inv else set()
    tensors = {(k + "_inv" if k in scale_names else k): weights[k].contiguous() for k in weights}
    save_file(tensors, str(root / SINGLE_FILE), metadata={"format": "pt"})
    return root


def quantize_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """`weights` (a bf16/fp16/fp32 model) in `cfg.quant`'s FP8 form: each quantized matrix
    becomes e4m3 codes plus its `_scale` grid. `weights` is emptied as it goes, one matrix at a
    time, so the model is never held twice."""
    names, out = set(fp8.quantized_names(cfg)), {}
    for n in list(weights):
        t = weights.pop(n)
        if n in names:
            out[n], out[fp8.scale_name(n)] = fp8.quantize(t, cfg.quant)
        else:
            out[n] = t
        del t
    return out


# ---- random weights ----------------------------------------------------------------------------
def _generator(seed: int, name: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator on `device` seeded from (seed, tensor name): each tensor is independent of the
    others (a CUDA generator draws other values than the CPU one of the same seed)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(
        int.from_bytes(digest, "little") & (2**63 - 1))


def init_stats(cfg: ModelConfig, role: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the normal init of a tensor with `role` and `shape`:

    - "norm" (the model's RMSNorms): 1 + N(0, 0.1^2), stored as w ~ N(0, 0.1^2) for the (1 + w)
      form; "norm_plain" (a layer's own plain norm): 1 + N(0, 0.1^2); "qk_norm": qk_gain times
      the model's norm;
    - "proj": N(0, 1/fan_in), unit-variance outputs; "qk_proj": N(0, qk_gain^2/fan_in), so that
      attention scores have std ~qk_gain^2 (with std ~1 attention is nearly uniform and greedy
      decoding of random weights soon repeats one token);
    - "out" (o_proj, out_proj, down, expert w2): N(0, residual_gain^2/(fan_in * 2 * L)): the 2L
      residual additions sum to a variance that does not depend on depth;
    - "embed" (embedding, untied LM head): N(0, 1/hidden), small against the layers' additions,
      so a tied LM head does not just echo the input token;
    - "conv": N(0, 1/K); "bias": N(0, 0.1^2); "D": 1 + N(0, 0.1^2).
    """
    zero_centred = cfg.norm_kind == "rms_1p"
    if role == "norm":
        return (0.0 if zero_centred else 1.0), 0.1
    if role == "norm_plain":
        return 1.0, 0.1
    if role == "qk_norm":
        g = cfg.qk_gain
        return (g - 1.0 if zero_centred else g), 0.1 * g
    if role == "embed":
        return 0.0, 1.0 / math.sqrt(cfg.hidden_size)
    if role == "proj":
        return 0.0, 1.0 / math.sqrt(shape[-1])
    if role == "qk_proj":
        return 0.0, cfg.qk_gain / math.sqrt(shape[-1])
    if role == "out":
        return 0.0, cfg.residual_gain / math.sqrt(shape[-1] * 2 * cfg.num_layers)
    if role == "conv":
        return 0.0, 1.0 / math.sqrt(shape[-1])
    if role == "bias":
        return 0.0, 0.1
    if role == "D":
        return 1.0, 0.1
    raise ValueError(f"unknown init role {role!r}")


def random_tensor(cfg: ModelConfig, role: str, shape: tuple[int, ...], gen: torch.Generator
                  ) -> torch.Tensor:
    """One bf16 tensor of the random init, on the generator's device. Decays are drawn as trained
    models are initialised: A_log = log U(1, 16), dt_bias = softplus^-1 of a log-uniform dt in
    [1e-3, 1e-1]."""
    dev = gen.device
    if role == "A_log":
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen, device=dev)).to(
            torch.bfloat16)
    if role == "dt_bias":
        u = torch.rand(shape, generator=gen, device=dev)
        dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
        return (dt + torch.log(-torch.expm1(-dt))).to(torch.bfloat16)
    mean, std = init_stats(cfg, role, shape)
    t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
    return t.normal_(mean, std, generator=gen)  # one pass, in bf16


def random_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16
                   ) -> dict[str, torch.Tensor]:
    """Deterministic random weights for `cfg` (scales in `init_stats`).

    Values are drawn in bf16 and then converted, so every dtype of one seed holds the same
    (bf16-representable) model: an fp32 run and a bf16 run describe one set of weights.
    """
    if dtype not in LOAD_DTYPES:
        raise WeightError(f"unsupported dtype {dtype}; use torch.bfloat16, float16 or float32")
    roles = tensor_roles(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        t = random_tensor(cfg, roles[name], shape, _generator(seed, name))
        out[name] = t if dtype == torch.bfloat16 else t.to(dtype)
    return out


class LazyRandomWeights(Mapping):
    """The random weights of `random_weights`, each tensor drawn on `device` when it is read and
    not kept: packing a real preset from it holds one tensor at a time next to the arena (a
    48B-parameter model packs on the GPU that serves it, with no host copy). On the CPU it holds
    exactly random_weights(cfg, seed)'s values; on a GPU other values of the same init."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu"):
        self.cfg, self.seed, self.device = cfg, seed, torch.device(device)
        self.shapes, self.roles = expected_shapes(cfg), tensor_roles(cfg)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return random_tensor(self.cfg, self.roles[name], self.shapes[name],
                             _generator(self.seed, name, self.device))

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
