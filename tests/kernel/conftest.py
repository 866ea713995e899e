"""The kernel tests' one build cache: a spec is compiled once per session, whichever test module
asks for it first (the pipeline, mma, fields and build tests share some)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from megakernel.kernel import spec as spec_mod
from megakernel.models import ModelConfig

Build = tuple[Path, dict]  # (the arch's output directory, its manifest)


@pytest.fixture(scope="session")
def kernel_build(tmp_path_factory) -> Callable[..., Build]:  # noqa: ANN001
    """build_arch(cfg, arch, batch, tokens, smem_stages, **variant) -> (out_dir / arch, manifest),
    cached by the kernel spec (the static config the compiled code depends on); `variant`: the
    other make_spec switches (timeline, l2_window, replay_window)."""
    # without the DSL the session fails at start (tests/conftest.py) unless
    # MEGAKERNEL_TEST_WITHOUT_DSL=1 waives it: then the builds skip
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel.kernel.build import build_arch

    cache: dict[str, Build] = {}

    def build(cfg: ModelConfig, arch: str, batch: int = 1, tokens: int = 1,
              smem_stages: int | None = None, **variant) -> Build:  # noqa: ANN003
        key = repr(spec_mod.make_spec(cfg, batch, tokens, arch, smem_stages=smem_stages,
                                      **variant))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"build-{len(cache)}")
            m = build_arch(cfg, arch, root, batch, tokens, smem_stages=smem_stages, **variant)
            cache[key] = (root / arch, m)
        return cache[key]

    return build
