"""The kernel tests' one build cache: a spec is compiled once (the JIT cache), whichever test module
asks for it first (the pipeline, mma, fields and build tests share some). `lane_build` is the fast
lane's one small build per arch (tests/lanes.py); `kernel_build` any other (the slow lane)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from megakernel.kernel.config import model_spec
from megakernel.models import ModelConfig

Build = tuple[Path, dict]  # (the arch's output directory, its manifest)


_CACHE: dict[str, Build] = {}  # repr(KernelSpec) -> build, shared by both fixtures
LANE_MODEL = "llama-tiny"  # the fast lane's build: the smallest dense model, B = T = 1


def _build(cfg: ModelConfig, arch: str, batch: int = 1, tokens: int = 1,
           smem_stages: int | None = None, **variant) -> Build:  # noqa: ANN003
    # without the DSL the session fails at start (tests/conftest.py) unless
    # MEGAKERNEL_TEST_WITHOUT_DSL=1 waives it: then the builds skip
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel.kernel.toolchain.build import MANIFEST_NAME
    from megakernel.kernel.toolchain.jit import ensure_build

    key = repr(model_spec.make_spec(cfg, batch, tokens, arch, smem_stages=smem_stages,
                                    **variant))
    if key not in _CACHE:
        # the JIT cache: keyed by spec, sources and DSL version, so the test workers (and the
        # emulated cases, which launch JIT builds) compile each build once between them
        root = ensure_build(cfg, batch, tokens, arch, smem_stages=smem_stages, **variant)
        _CACHE[key] = (root / arch, json.loads((root / arch / MANIFEST_NAME).read_text()))
    return _CACHE[key]


@pytest.fixture(scope="session")
def kernel_build() -> Callable[..., Build]:
    """build_arch(cfg, arch, batch, tokens, smem_stages, **variant) -> (out_dir / arch, manifest),
    cached by the kernel spec (the static config the compiled code depends on); `variant`: the
    other make_spec switches (timeline, l2_window, replay_window)."""
    return _build


@pytest.fixture(scope="session")
def lane_build() -> Callable[[str], Build]:
    """arch -> the fast lane's build of LANE_MODEL for it (the same cache as kernel_build)."""
    from megakernel.models import preset

    return lambda arch: _build(preset(LANE_MODEL), arch)
