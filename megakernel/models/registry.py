"""The model-family registry: `@register_family` on a family's config class, lazy lookup.

A family is one module of this package: a `ModelConfig` subclass decorated with
`@register_family(architectures=..., model_types=..., presets=...)`. Lookups import the family
modules on first use (every module of the package but the shared ones), so adding a family is
adding its module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megakernel.common.registry import Registry
from megakernel.models import fp8
from megakernel.models.config import ConfigError, ModelConfig

_SHARED = {"config", "registry", "weights", "dense", "layer_types"}


@dataclass(frozen=True)
class Family:
    name: str
    cls: type[ModelConfig]
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    presets: Callable[[], dict[str, ModelConfig]]
    real_presets: tuple[str, ...]


FAMILIES: Registry[Family] = Registry("megakernel.models", "model family", skip=_SHARED)


def _origin(cls: type) -> str:
    """Where a class is defined (a re-imported module registers its family again, harmlessly)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_family(*, architectures: tuple[str, ...], model_types: tuple[str, ...],
                    presets: Callable[[], dict[str, ModelConfig]] | None = None,
                    real_presets: tuple[str, ...] = ()):  # noqa: ANN201
    """Class decorator for a family's `ModelConfig` subclass. `presets` builds its named presets
    (called once, lazily); `real_presets` names those with published shapes."""

    def deco(cls: type[ModelConfig]) -> type[ModelConfig]:
        if not cls.family:
            raise ValueError(f"{cls.__name__} has no family name")
        old = FAMILIES.get(cls.family)
        if old is not None and _origin(old.cls) != _origin(cls):
            raise ValueError(f"model family {cls.family!r} registered twice ({_origin(old.cls)} "
                             f"and {_origin(cls)})")
        for other in FAMILIES.values():
            if other.name == cls.family:
                continue
            for what, ours, theirs in (("architecture", architectures, other.architectures),
                                       ("model_type", model_types, other.model_types)):
                clash = sorted(set(ours) & set(theirs))
                if clash:
                    raise ValueError(f"{what} {clash[0]!r} claimed by families {other.name!r} "
                                     f"and {cls.family!r}")
        FAMILIES[cls.family] = Family(cls.family, cls, tuple(architectures), tuple(model_types),
                                      presets or dict, tuple(real_presets))  # (re-)registered
        return cls

    return deco


def load_all() -> dict[str, Family]:
    """Every registered family (imports the family modules once)."""
    return FAMILIES.load_all()


def family(name: str) -> Family:
    try:
        return FAMILIES.find(name)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None


def gguf_family(arch: str, source: str = "GGUF file") -> Family:
    """The family whose `gguf_arch` is llama.cpp's architecture name `arch`."""
    fams = load_all().values()
    for f in fams:
        if f.cls.gguf_arch == arch:
            return f
    known = sorted(f.cls.gguf_arch for f in fams if f.cls.gguf_arch)
    raise ConfigError(f"{source}: unsupported GGUF architecture {arch!r}; supported: "
                      f"{', '.join(known)}")


_PRESETS: dict[str, ModelConfig] | None = None


def presets() -> dict[str, ModelConfig]:
    """Every family's presets by name."""
    global _PRESETS
    if _PRESETS is None:
        out: dict[str, ModelConfig] = {}
        for fam in load_all().values():
            made = fam.presets()
            for k, v in made.items():
                if k in out:
                    raise ValueError(f"preset {k!r} defined twice")
                if type(v) is not fam.cls or v.name != k:
                    raise ValueError(f"preset {k!r} of family {fam.name!r} is a "
                                     f"{type(v).__name__} named {v.name!r}")
                out[k] = v
            unknown = sorted(set(fam.real_presets) - set(made))
            if unknown:
                raise ValueError(f"family {fam.name!r} lists unknown real presets {unknown}")
        _PRESETS = out
    return _PRESETS


def real_presets() -> tuple[str, ...]:
    """Presets with the published shapes of real checkpoints."""
    return tuple(n for f in load_all().values() for n in f.real_presets)


def preset(name: str) -> ModelConfig:
    try:
        return presets()[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(presets())}") from None


def config_from_hf_dict(d: Any, name: str = "") -> ModelConfig:
    """Dispatch a Hugging Face config dict on `architectures` (first) or `model_type`."""
    if not isinstance(d, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
    fams = load_all()
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"config field 'architectures' must be a list of names, got {archs!r}")
    chosen = None
    for arch in archs:
        hit = [f for f in fams.values() if arch in f.architectures]
        if not hit:
            known = sorted(a for f in fams.values() for a in f.architectures)
            raise ConfigError(f"unsupported architecture {arch!r}; supported: {', '.join(known)}")
        if chosen is not None and hit[0] is not chosen:
            raise ConfigError(f"config names architectures of two families ({chosen.name} and "
                              f"{hit[0].name}): {', '.join(archs)}")
        chosen = hit[0]
    if chosen is None:
        mt = d.get("model_type")
        hit = [f for f in fams.values() if mt in f.model_types]
        if not hit:
            known = sorted(t for f in fams.values() for t in f.model_types)
            raise ConfigError(f"unsupported model_type {mt!r} (and no supported 'architectures' "
                              f"entry); supported: {', '.join(known)}")
        chosen = hit[0]
    cfg = chosen.cls.from_hf_dict(d, name=name)
    quant = fp8.from_hf(d.get("quantization_config"))
    return cfg if quant is None else cfg.replace(quant=quant)


def config_from_hf_dir(path: str | Path) -> ModelConfig:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json in {path}")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    return config_from_hf_dict(d, name=Path(path).name)
