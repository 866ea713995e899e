"""JIT path: compile the megakernel on first use (DSL + GPU machine) and cache the build on disk.

The cache key is the fingerprint of (kernel sources, ISA, DSL version, arch, static config), so a
source edit or a DSL upgrade rebuilds and an unchanged kernel loads in milliseconds. A cache entry
is an ordinary build directory (DIR/<arch>/{manifest.json, megakernel.cubin, megakernel.ptx}) that
the runtime loads exactly like an AOT build. Concurrent processes serialise on a lock file.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from megakernel.kernel.config.model_spec import make_spec
from megakernel.kernel.toolchain.fingerprint import fingerprint
from megakernel.models import ModelConfig

ENV_CACHE = "MEGAKERNEL_CACHE_DIR"


def cache_root() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "megakernel"


def dsl_version() -> str | None:
    """Installed nvidia-cutlass-dsl version (without importing it), None when absent."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_build(cfg: ModelConfig, batch: int, tokens: int, arch: str,
                 root: Path | None = None, **variant: Any) -> Path:
    """A build directory for (cfg, batch, tokens, arch) and any other switch of
    build_arch/make_spec in `variant` (the ReplaySSM window, speculative drafts, n-gram drafter,
    ring stages, timeline, ...): from the cache (keyed by the spec, sources and DSL version; one
    build per key, however many processes ask at once), or compiled now."""
    version = dsl_version()
    if version is None:
        from megakernel.common.errors import KernelUnavailable

        raise KernelUnavailable("no prebuilt kernel was given and the CuTe DSL "
                                "(nvidia-cutlass-dsl) is not installed to compile one; build on "
                                "another machine with `python -m megakernel build` and pass "
                                "its output directory")
    spec = make_spec(cfg, batch, tokens, arch, **variant)
    key = fingerprint(spec, version)
    root = root or cache_root()
    entry = root / key[:32]
    if (entry / arch / "manifest.json").is_file():
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key[:32]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (entry / arch / "manifest.json").is_file():  # built while we waited
                return entry
            from megakernel.kernel.toolchain.build import build_arch

            tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
            try:
                build_arch(cfg, arch, tmp, batch, tokens, **variant)
                entry.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / arch, entry / arch)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return entry
