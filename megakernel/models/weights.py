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

from megakernel.errors import UserError
from megakernel.models.config import ModelConfig, expected_shapes

__all__ = ["WeightError", "expected_shapes", "load_checkpoint", "random_weights",
           "save_checkpoint", "check_weights", "keep_fp32"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DISK_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class WeightError(UserError, ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not match its config."""


# ---- layout -------------------------------------------------------------------------------------
def tensor_roles(cfg: ModelConfig) -> dict[str, str]:
    """Every tensor name -> its random-init role (`init_stats`)."""
    from megakernel.layers import kind

    roles = {cfg.embed_name: "embed", cfg.final_norm_name: "norm", cfg.lm_head_name: "embed"}
    for blk in cfg.blocks:
        roles[blk.norm] = "norm"
        kd = kind(blk.kind)
        for local in kd.shapes(blk, cfg):
            roles[blk.prefix + local] = kd.init_role(local, blk)
    return roles


def keep_fp32(cfg: ModelConfig) -> set[str]:
    """Names of the tensors transformers keeps in fp32 (not rounded in bf16 mode)."""
    from megakernel.layers import kind

    return {blk.prefix + n for blk in cfg.blocks for n in kind(blk.kind).fp32_params
            if blk.prefix + n in expected_shapes(cfg)}


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


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu"
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a Hugging Face checkpoint directory (config.json + safetensors, single or sharded)
    of any registered family.

    `dtype=None` keeps each tensor's dtype from disk (bf16, fp16 or fp32); otherwise every tensor
    is converted to `dtype`, one at a time. A tied model's duplicate LM head is checked to equal
    the embedding and dropped.
    """
    from megakernel.models.registry import config_from_hf_dir

    root = Path(path)
    if not root.is_dir():
        raise WeightError(f"checkpoint directory {str(root)!r} does not exist")
    if dtype is not None and dtype not in DISK_DTYPES.values():
        raise WeightError(f"unsupported dtype {dtype}; use torch.bfloat16, float16 or float32")
    cfg = config_from_hf_dir(root)
    files = _tensor_files(root)
    want = expected_shapes(cfg)
    source: dict[str, str] = {}  # our name -> name in the file
    problems: list[str] = []
    head_dup = None
    for name in files:
        ours = cfg.canonical_name(name)
        if ours is None:
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
                shape, dt = tuple(s.get_shape()), s.get_dtype()
                exp = want[cfg.embed_name] if ours == "<lm_head>" else want[ours]
                if shape != exp:
                    problems.append(f"tensor {theirs!r} has shape {_shape_str(shape)}, expected "
                                    f"{_shape_str(exp)}")
                elif dt not in DISK_DTYPES:
                    problems.append(f"tensor {theirs!r} has dtype {dt}; supported on disk: "
                                    f"{', '.join(DISK_DTYPES)}")
    _raise(problems)
    from megakernel.progress import stage

    weights: dict[str, torch.Tensor] = {}
    gb = sum(math.prod(want[n]) * 2 for n in source) / 1e9  # bf16-sized: a size, for the eye
    with stage(f"reading {len(source)} tensors (~{gb:.1f} GB) from {root}", quiet=gb < 0.5):
        for ours, raw in _iter_tensors(files, source):
            weights[ours] = raw.to(device=device, dtype=raw.dtype if dtype is None else dtype)
            del raw  # drop the unconverted tensor before reading the next one
    if head_dup is not None:
        for _, head in _iter_tensors(files, {"<lm_head>": head_dup}):
            for _, emb in _iter_tensors(files, {"<embed>": source[cfg.embed_name]}):
                if not (emb.dtype == head.dtype and torch.equal(emb, head)):
                    raise WeightError(f"{head_dup!r} differs from {source[cfg.embed_name]!r} but "
                                      "config.json sets tie_word_embeddings=true")
    return cfg, {n: weights[n] for n in want}


def _iter_tensors(files: dict[str, Path], names: dict[str, str]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our name, tensor) one at a time, each file opened once; WeightError naming a
    tensor that cannot be read or is not finite."""
    for path, ours in _by_file(names, files).items():
        with _safe_open(path) as f:
            for n in ours:
                try:
                    t = f.get_tensor(names[n])
                except Exception as e:  # truncated or corrupt data
                    raise WeightError(f"cannot read tensor {names[n]!r} from {path.name}: "
                                      f"{e}") from None
                if t.is_floating_point() and not _finite(t):
                    raise WeightError(f"tensor {names[n]!r} in {path.name} holds NaN or Inf "
                                      "values")
                yield n, t
                del t  # or the suspended frame keeps it alive while the next one is read


def _finite(t: torch.Tensor) -> bool:
    """Every element finite. An fp32 sum is finite unless an element is NaN/Inf (they never cancel
    back to finite) or finite values overflow it (then the exact check decides): about half the
    cost of isfinite(t).all() on a CPU, which matters at checkpoint scale."""
    return bool(torch.isfinite(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def save_checkpoint(cfg: ModelConfig, weights: dict[str, torch.Tensor], path: str | Path
                    ) -> Path:
    """Write config.json + model.safetensors (for tests and the oracle)."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.hf_config(), indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / SINGLE_FILE),
              metadata={"format": "pt"})
    return root


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
    if dtype not in DISK_DTYPES.values():
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
