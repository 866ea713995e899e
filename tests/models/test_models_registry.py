"""The model-family registry (megakernel/models/registry.py): every family registered under its
Hugging Face names, dispatch of config.json dicts, presets, `resolve`, lazy loading."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from megakernel.models import (
    ConfigError,
    ModelConfig,
    config_from_hf_dict,
    config_from_hf_dir,
    family,
    preset,
    presets,
    real_presets,
    resolve,
)
from megakernel.models.registry import FAMILIES, load_all, register_family
from megakernel.models.weights import expected_shapes
from tests.layers.helpers import HF_CLASSES, hf_classes
from tests.registries import ALL_TINY

# What each family answers to, written out: a family registered under a wrong or missing name
# would silently send published checkpoints elsewhere (or nowhere).
REGISTERED = {
    "llama": (("LlamaForCausalLM",), ("llama",)),
    "qwen3": (("Qwen3ForCausalLM",), ("qwen3",)),
    "qwen2": (("Qwen2ForCausalLM",), ("qwen2",)),
    "qwen3_5": (("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                ("qwen3_5", "qwen3_5_text")),
    "kimi_linear": (("KimiLinearForCausalLM",), ("kimi_linear",)),
    "nemotron_h": (("NemotronHForCausalLM",), ("nemotron_h",)),
}
TESTS = Path(__file__).parent


def test_every_family_is_registered_with_its_hf_names() -> None:
    fams = load_all()
    assert {n: (f.architectures, f.model_types) for n, f in fams.items()} == REGISTERED
    for name, fam in fams.items():
        assert fam.name == name == fam.cls.family
        assert issubclass(fam.cls, ModelConfig)
        assert family(name) is fam


def test_registered_names_are_transformers_names() -> None:
    """Every architecture is a transformers model class, every model_type a transformers config
    type, and `to_hf_dict` writes names the family answers to."""
    import transformers
    from transformers import CONFIG_MAPPING

    for fam in load_all().values():
        for arch in fam.architectures:
            assert hasattr(transformers, arch), arch
        for mt in fam.model_types:
            assert mt in CONFIG_MAPPING, mt
        for cfg in fam.presets().values():
            d = cfg.to_hf_dict()
            assert d["architectures"][0] in fam.architectures
            assert d["model_type"] in fam.model_types


def test_every_family_has_its_test_file() -> None:
    """A family is its module plus its tests: tests/models/test_models_<family>.py."""
    for name in load_all():
        assert (TESTS / f"test_models_{name}.py").is_file(), name


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_dispatch_on_architecture_and_on_model_type(name: str) -> None:
    fam = family(name)
    cfg = next(iter(fam.presets().values()))
    d = cfg.to_hf_dict()
    for arch in fam.architectures:
        assert type(config_from_hf_dict({**d, "architectures": [arch]})) is fam.cls
    no_arch = {k: v for k, v in d.items() if k != "architectures"}
    assert config_from_hf_dict(no_arch).replace(name=cfg.name) == cfg


def test_unknown_architecture_is_refused_naming_the_supported_ones() -> None:
    d = preset("llama-3.2-1b").to_hf_dict()
    with pytest.raises(ConfigError, match="unsupported architecture 'MistralForCausalLM'") as e:
        config_from_hf_dict({**d, "architectures": ["MistralForCausalLM"]})
    for arch, _ in REGISTERED.values():
        assert all(a in str(e.value) for a in arch)
    with pytest.raises(ConfigError, match=r"unsupported architecture 'Qwen3_5MoeForCausalLM'"):
        config_from_hf_dict({"architectures": ["Qwen3_5MoeForCausalLM"],
                             "model_type": "qwen3_5_moe"})


def test_unknown_model_type_is_refused_naming_the_supported_ones() -> None:
    d = {k: v for k, v in preset("llama-3.2-1b").to_hf_dict().items() if k != "architectures"}
    with pytest.raises(ConfigError, match="unsupported model_type 'gemma'") as e:
        config_from_hf_dict({**d, "model_type": "gemma"})
    for _, types in REGISTERED.values():
        assert all(t in str(e.value) for t in types)
    with pytest.raises(ConfigError, match=r"unsupported model_type 'mamba2'"):
        config_from_hf_dict({"model_type": "mamba2"})


def test_malformed_dispatch_fields_are_refused() -> None:
    d = preset("qwen3-tiny").to_hf_dict()
    with pytest.raises(ConfigError, match="'architectures' must be a list"):
        config_from_hf_dict({**d, "architectures": "Qwen3ForCausalLM"})
    with pytest.raises(ConfigError, match="two families"):
        config_from_hf_dict({**d, "architectures": ["Qwen3ForCausalLM", "LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        config_from_hf_dict([d])


# ---- presets ------------------------------------------------------------------------------------
def test_presets_are_consistent() -> None:
    """Every preset is named by its key, belongs to one family, has a layout; real presets are
    presets of their family."""
    ps = presets()
    assert ps is presets()  # built once
    owner = {}
    for fam in load_all().values():
        for k in fam.presets():
            owner[k] = fam
    assert set(owner) == set(ps)
    for name, cfg in ps.items():
        assert cfg.name == name
        assert type(cfg) is owner[name].cls
        assert expected_shapes(cfg)
        assert preset(name) is cfg
    assert real_presets() == tuple(n for f in load_all().values() for n in f.real_presets)
    for name in real_presets():
        assert name in owner[name].presets() and preset(name).name == name
    assert len(set(real_presets())) == len(real_presets())


@pytest.mark.parametrize("name", sorted(presets()))
def test_hf_dict_round_trip(name: str) -> None:
    """to_hf_dict -> JSON -> config_from_hf_dict gives the same config, for every preset."""
    cfg = preset(name)
    d = json.loads(json.dumps(cfg.to_hf_dict()))  # what a config.json holds
    assert config_from_hf_dict(d, name=name) == cfg


def test_unknown_preset_and_spec(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown preset 'llama-99b'"):
        preset("llama-99b")
    with pytest.raises(ConfigError, match=r"unknown preset 'qwen3.5-1t'"):
        preset("qwen3.5-1t")
    for spec in ("nowhere", "no-such-model"):
        with pytest.raises(ConfigError, match=f"'{spec}' is neither a preset") as e:
            resolve(spec)
        assert all(n in str(e.value) for n in presets())  # the message lists every preset
    with pytest.raises(ConfigError, match="no config.json"):
        resolve(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        config_from_hf_dir(tmp_path)


@pytest.mark.parametrize("name", ALL_TINY)
def test_resolve_presets_and_directories(name: str, tmp_path: Path) -> None:
    assert resolve(name) is presets()[name]
    (tmp_path / "config.json").write_text(json.dumps(preset(name).to_hf_dict()))
    cfg = resolve(str(tmp_path))
    assert cfg == preset(name).replace(name=tmp_path.name)
    assert config_from_hf_dir(tmp_path) == cfg


def test_every_family_has_its_transformers_oracle() -> None:
    """tests/layers/helpers.py HF_CLASSES (the oracle of the checkpoint tests) names the
    transformers classes of every family: its model class one of the family's architectures."""
    assert sorted(HF_CLASSES) == sorted(load_all()), "HF_CLASSES: one entry per family"
    for name, fam in load_all().items():
        cfg_cls, model_cls = hf_classes(name)
        assert model_cls.__name__ in fam.architectures, name
        assert cfg_cls.model_type in fam.model_types, name


# ---- the decorator ------------------------------------------------------------------------------
@pytest.fixture
def scratch_registry() -> Iterator[dict]:
    """FAMILIES restored after a test that registers families of its own."""
    load_all()
    saved = dict(FAMILIES)
    yield FAMILIES
    FAMILIES.clear()
    FAMILIES.update(saved)


def test_register_family_refuses_clashes(scratch_registry: dict) -> None:
    llama = family("llama").cls

    @dataclass(frozen=True, kw_only=True)
    class Other(llama):  # type: ignore[misc, valid-type]
        family = "other"

    register_family(architectures=("OtherForCausalLM",), model_types=("other",))(Other)
    assert family("other").cls is Other and family("other").presets() == {}
    with pytest.raises(ValueError, match="architecture 'LlamaForCausalLM' claimed by families "
                                         "'llama' and 'other'"):
        register_family(architectures=("LlamaForCausalLM",), model_types=("x",))(Other)
    with pytest.raises(ValueError, match="model_type 'qwen3' claimed"):
        register_family(architectures=("X",), model_types=("qwen3",))(Other)

    @dataclass(frozen=True, kw_only=True)
    class Impostor(llama):  # type: ignore[misc, valid-type]
        family = "llama"

    with pytest.raises(ValueError, match="model family 'llama' registered twice"):
        register_family(architectures=("LlamaForCausalLM",), model_types=("llama",))(Impostor)

    @dataclass(frozen=True, kw_only=True)
    class Nameless(llama):  # type: ignore[misc, valid-type]
        family = ""

    with pytest.raises(ValueError, match="has no family name"):
        register_family(architectures=("Y",), model_types=("y",))(Nameless)


def test_families_load_lazily() -> None:
    """Importing megakernel.models imports no family module (nor transformers); the first lookup
    imports every one of them."""
    code = (
        "import sys\n"
        "import megakernel.models as m\n"
        "fams = [n for n in sys.modules if n.startswith('megakernel.models.')]\n"
        # the config's own modules: the base classes, the registry, the FP8 format
        "assert sorted(fams) == ['megakernel.models.config', 'megakernel.models.fp8', "
        "'megakernel.models.registry'], fams\n"
        "assert not m.FAMILIES and 'transformers' not in sys.modules\n"
        "m.preset('qwen2-tiny')\n"
        f"assert sorted(m.FAMILIES) == {sorted(REGISTERED)!r}, sorted(m.FAMILIES)\n"
        "assert 'transformers' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
