"""The fast lane's kernel build: one small DSL build per arch (tests/lanes.py), so that a broken
DSL import, a device-code change that no longer traces, or a build over the kernel's budgets
fails `make test`. The other builds (every family, the pipeline, mma, the hybrids) are the slow
lane's (test_kernel_build.py and the rest)."""

from __future__ import annotations

import json

import pytest

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.kernel.host import limits


@pytest.mark.parametrize("arch", ARCHS)
def test_one_small_build_per_arch(lane_build, arch):  # noqa: ANN001
    from megakernel.kernel.toolchain.tools import ptx_target

    d, m = lane_build(arch)
    assert (d / "megakernel.cubin").stat().st_size > 10_000
    assert ptx_target((d / "megakernel.ptx").read_text()) == arch
    assert m["arch"] == arch and m["program_format_version"] == isa.FORMAT_VERSION
    assert json.loads((d / "manifest.json").read_text()) == m
    r = m["resources"]
    assert r["spill_stores"] == r["spill_loads"] == r["local_bytes"] == 0, r
    assert 0 < r["registers"] <= limits.REGISTER_BUDGET, r
    assert 0 < m["dynamic_smem_bytes"] <= limits.SMEM_BUDGET
    assert m["spec"]["smem_stages"] > 0  # the default build: the shared-memory weight ring
