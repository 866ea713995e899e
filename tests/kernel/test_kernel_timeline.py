"""The timeline build (KernelSpec.timeline): it compiles within the resource rules for both
archs, stamps %globaltimer at the instruction's wait, wait end and finish and at the loader's
slab start and end, and the default build pays nothing for it."""

from __future__ import annotations

import re

import pytest

from megakernel.common.arch import ARCHS
from megakernel.kernel.config import model_spec
from megakernel.kernel.host import limits
from megakernel.kernel.toolchain import fingerprint
from megakernel.kernel.toolchain.build import PTX_NAME, build_arch
from megakernel.models import preset

STAMPS = {0: 3, None: 5}  # globaltimer reads added: consumers (3), plus the loader (2) when piped


def timer_reads(ptx: str) -> int:
    return len(re.findall(r"mov\.u64\s+%rd\d+,\s*%globaltimer;", ptx))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stages", [None, 0])
def test_timeline_build_stamps_only_in_the_variant(kernel_build, tmp_path, arch, stages):
    cfg = preset("llama-tiny")
    base_dir, _ = kernel_build(cfg, arch, smem_stages=stages)
    m = build_arch(cfg, arch, tmp_path, smem_stages=stages, timeline=True)  # resource rules
    res = m["resources"]
    assert res["spill_stores"] == res["spill_loads"] == res["local_bytes"] == 0
    assert m["spec"]["timeline"] is True
    base = timer_reads((base_dir / PTX_NAME).read_text())  # the watchdogs' reads only
    variant = timer_reads((tmp_path / arch / PTX_NAME).read_text())
    assert variant - base == STAMPS[stages]


def test_timeline_spec_is_a_separate_build():
    cfg = preset("llama-tiny")
    a = model_spec.make_spec(cfg, 1, 1, "sm_90a")
    b = model_spec.make_spec(cfg, 1, 1, "sm_90a", timeline=True)
    assert not a.timeline and b.timeline and a.tag != b.tag and b.tag.endswith("-timeline")
    assert fingerprint.fingerprint(a, "x") != fingerprint.fingerprint(b, "x")
    assert limits.timeline_offset(3, 5) == 3 * 5 * 16
    assert limits.timeline_int32_words(3, 5) == 3 * 5 * (16 + 2 * limits.TIMELINE_WORDS)
