"""The key of a compiled kernel: what a cubin is compiled from (the device-code sources, the ISA
and the layer kinds' declarations it reads, the DSL version, the static config). A build cache or a
build directory whose key differs is stale.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megakernel import isa
from megakernel.kernel.config.spec import KernelSpec

KERNEL = Path(__file__).resolve().parents[1]  # megakernel/kernel
# what a build's cubin is compiled from: the device code and the host-side spec, limits, plans and
# index arithmetic it traces through (the toolchain and the stream kernel do not change a cubin)
KERNEL_SOURCES = tuple(sorted(f"{d}/{p.name}" for d in ("device", "config", "host")
                              for p in (KERNEL / d).glob("*.py")
                              if p.name not in ("__init__.py", "stream.py")))


def source_digest() -> str:
    """sha256 over the device-code sources and the ISA (what the cubin is compiled from)."""
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        p = KERNEL / name
        h.update(name.encode())
        h.update(p.read_bytes() if p.exists() else b"<missing>")
    for pkg in ("isa", "layers"):  # the registry the device code reads its fields from
        for p in sorted((KERNEL.parent / pkg).glob("*.py")):
            h.update(f"{pkg}/{p.name}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


# set (to anything but 0): builds carry line info (build.compile_to), keyed apart from plain ones
ENV_LINE_INFO = "MEGAKERNEL_LINE_INFO"


def line_info_requested() -> bool:
    return os.environ.get(ENV_LINE_INFO, "") not in ("", "0")


def fingerprint(spec: KernelSpec, dsl_version: str, line_info: bool | None = None) -> str:
    """Key of a compiled kernel: sources + DSL version + arch + static config + ISA version (+
    line info, when the build carries it: `line_info`, default ENV_LINE_INFO)."""
    d = {"sources": source_digest(), "dsl": dsl_version, "spec": spec.to_dict(),
         "format_version": isa.FORMAT_VERSION}
    if line_info_requested() if line_info is None else line_info:
        d["line_info"] = True
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

