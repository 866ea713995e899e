"""What the tests run over, read from the registries (megakernel/models/registry.py, the model
families and their presets; megakernel/layers, the layer kinds) instead of lists of names: a new
family, preset or kind is tested where its peers are without being added to any test.

- FAMILIES: every registered model family, by name (sorted).
- DENSE_FAMILIES: the families whose config class is a `DenseConfig`.
- ALL_TINY: every tiny preset: a preset that is not one of its family's real presets and whose
  name ends in "-tiny" (with the variants cut down to what the CuTe DSL kernel runs, such as
  qwen3.5-attn-tiny).
- TINY: one tiny preset per family, the family's full one: the first of its tiny presets (in the
  family's order) with every layer kind of the family's real presets (qwen3.5-tiny, not
  qwen3.5-attn-tiny). A family without one is missing here (`test_presets_cover_the_tiny_models`
  names it).
- HYBRID_TINY: the presets of TINY with recurrent layers; DENSE_TINY: those of DENSE_FAMILIES.
- KINDS: every registered layer kind (sorted); RECURRENT_KINDS: those that are `recurrent`;
  KV_KINDS: those with a KV cache.
"""

from __future__ import annotations

from megakernel.layers import all_kinds
from megakernel.models import preset, presets
from megakernel.models.dense import DenseConfig
from megakernel.models.registry import load_all

FAMILIES: tuple[str, ...] = tuple(sorted(load_all()))
DENSE_FAMILIES: tuple[str, ...] = tuple(f for f in FAMILIES
                                        if issubclass(load_all()[f].cls, DenseConfig))


def kinds_of(name: str) -> set[str]:
    """The layer kinds of preset `name`'s blocks."""
    return {b.kind for b in preset(name).blocks}


def tiny_presets(family: str) -> tuple[str, ...]:
    """The family's tiny presets, in the family's order: not real, named "*-tiny"."""
    real = set(load_all()[family].real_presets)
    return tuple(n for n, cfg in presets().items()
                 if cfg.family == family and n not in real and n.endswith("-tiny"))


def family_tiny(family: str) -> str | None:
    """The family's full tiny preset: the first with every layer kind of its real presets."""
    full = set().union(*(kinds_of(n) for n in load_all()[family].real_presets))
    return next((n for n in tiny_presets(family) if full <= kinds_of(n)), None)


ALL_TINY: tuple[str, ...] = tuple(n for f in FAMILIES for n in tiny_presets(f))
TINY: tuple[str, ...] = tuple(n for n in map(family_tiny, FAMILIES) if n is not None)
HYBRID_TINY: tuple[str, ...] = tuple(n for n in TINY if preset(n).recurrent_layers())
DENSE_TINY: tuple[str, ...] = tuple(n for n in TINY if preset(n).family in DENSE_FAMILIES)

KINDS: tuple[str, ...] = tuple(sorted(all_kinds()))
RECURRENT_KINDS: tuple[str, ...] = tuple(k for k in KINDS if all_kinds()[k].recurrent)
KV_KINDS: tuple[str, ...] = tuple(k for k in KINDS if all_kinds()[k].kv_cache)


def model(name: str):  # noqa: ANN201 (ModelConfig)
    """A preset, or "smollm-shaped": SmolLM2-135M's widths on llama-tiny's two layers (hidden
    576 = 4.5 x 128, 9 heads of 64, 3 kv heads: a K that no 128-input block divides)."""
    if name == "smollm-shaped":
        return preset("llama-tiny").replace(hidden_size=576, num_heads=9, num_kv_heads=3,
                                            intermediate_size=1536, name=name)
    return preset(name)
