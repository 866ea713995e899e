"""The torch reference ships as `megakernel.reference` (the repository's top-level reference/
folder, linked into the package): nothing named plain `reference` is installed or imported."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_code_imports_the_reference_by_its_package_name():
    plain = re.compile(r"^\s*(from|import)\s+reference\b", re.M)
    bad = [str(p.relative_to(ROOT)) for d in ("megakernel", "tests", "bench")
           for p in (ROOT / d).rglob("*.py") if plain.search(p.read_text())]
    assert not bad, bad
    import megakernel.reference.model as m

    assert Path(m.__file__).resolve().parent == (ROOT / "reference").resolve()


def test_the_wheel_holds_megakernel_reference_and_no_top_level_reference(tmp_path):
    """Built from a clean copy of the sources (a build/ left in the checkout would be reused)."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("megakernel", "reference"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(tmp_path / "w"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    names = zipfile.ZipFile(next((tmp_path / "w").glob("megakernel-*.whl"))).namelist()
    assert "megakernel/reference/model.py" in names
    assert "megakernel/reference/layers/attention.py" in names
    assert not [n for n in names if n.split("/")[0] == "reference"]
