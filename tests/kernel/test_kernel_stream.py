"""The HBM read-stream kernel (kernel/device/stream.py) on the CPU: it builds for both archs with no
spills or local memory, its SASS has the bulk copy and the mbarrier wait, its entry is the
launcher's ABI; the host twin of its reduction (measure.stream_reference) against a plain loop;
measure.read_bandwidth without a GPU or a build answers with an error field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megakernel.common.arch import ARCHS
from megakernel.measure import bandwidth as measure


@pytest.fixture(scope="module")
def stream_builds(tmp_path_factory) -> dict[str, tuple[Path, dict]]:  # noqa: ANN001
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel.kernel.toolchain.stream_build import build_stream

    root = measure.stream_build_dir(tmp_path_factory.mktemp("gpu-builds"))
    return {a: (root / a, build_stream(root, a)) for a in ARCHS}


def test_stream_builds_without_spills_for_both_archs(stream_builds):
    from megakernel.kernel.toolchain.tools import parse_ptx_entry, ptx_target

    for arch, (d, m) in stream_builds.items():
        r = m["resources"]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (arch, r)
        assert r["local_bytes"] == 0 and r["local_stores"] == 0 and r["local_loads"] == 0, r
        assert json.loads((d / "manifest.json").read_text()) == m
        ptx = (d / "stream.ptx").read_text()
        assert ptx_target(ptx) == arch
        entry = parse_ptx_entry(ptx)
        assert entry.name == m["symbol"] and entry.reqntid == tuple(m["block"])
        assert [(p.is_pointer, p.size) for p in entry.params] == [(True, 8), (True, 8), (False, 4)]
        assert m["dynamic_smem_bytes"] >= m["stages"] * m["stage_bytes"]
        print(f"stream {arch}: {r['registers']} regs, smem {m['dynamic_smem_bytes']} B")


def test_stream_sass_has_the_bulk_copy_ring(stream_builds):
    """One cp.async.bulk G2S site completing on an mbarrier (SASS UBLKCP), the expect_tx arrive,
    the mbarrier try-wait and the xor shuffle: the megakernel loader's pattern, nothing else."""
    from megakernel.kernel.toolchain.tools import sass_text

    for arch, (d, _) in stream_builds.items():
        ptx = (d / "stream.ptx").read_text()
        assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") == 1
        assert "mbarrier.arrive.expect_tx" in ptx and "shfl.sync.bfly" in ptx, arch
        sass = sass_text(str(d / "stream.cubin"))
        assert re.search(r"\bUBLKCP\.S\.G\b", sass), arch
        assert re.search(r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b", sass), arch
        assert not re.search(r"\bLDG\b", sass), arch  # the data comes only through the ring


def test_stream_manifest_loads_without_the_dsl(stream_builds):
    root = next(iter(stream_builds.values()))[0].parents[1]  # the gpu-check build dir
    for arch, (d, m) in stream_builds.items():
        man, data = measure.load_stream(root, arch)
        assert man.arch == arch and man.symbol == m["symbol"]
        assert man.smem == m["dynamic_smem_bytes"]
        assert man.block == (64, 1, 1) and man.cubin_bytes() == (d / "stream.cubin").read_bytes()
        assert [p["name"] for p in data["params"]] == ["src", "out", "chunks"]


def test_stream_config_is_checked():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed for the kernel class")
    from megakernel.kernel.device.stream import HbmStream

    with pytest.raises(ValueError, match="multiple of 128"):
        HbmStream(stage_bytes=1000)
    with pytest.raises(ValueError, match="budget"):
        HbmStream(stage_bytes=64 * 1024, stages=4)
    with pytest.raises(ValueError, match=">= 2 stages"):
        HbmStream(stages=1)


def _xor_loop(words: list[int], ctas: int, chunks: int, stage_bytes: int) -> list[int]:
    """The kernel's reduction written out: CTA c, chunk j, lane l reads word l * seg + j % seg."""
    w = stage_bytes // 4
    seg = w // 32
    out = []
    for c in range(ctas):
        acc = 0
        for j in range(chunks):
            for lane in range(32):
                acc ^= words[(c * chunks + j) * w + lane * seg + j % seg] & 0xFFFFFFFF
        out.append(acc - (1 << 32) if acc >= 1 << 31 else acc)
    return out


@pytest.mark.parametrize("ctas,chunks,stage_bytes", [(3, 5, 512), (2, 9, 1024), (1, 1, 128)])
def test_stream_reference_matches_the_kernels_reduction(ctas, chunks, stage_bytes):
    g = torch.Generator().manual_seed(ctas * 100 + chunks)
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (ctas * chunks * stage_bytes // 4,),
                          dtype=torch.int32, generator=g)
    want = _xor_loop(words.tolist(), ctas, chunks, stage_bytes)
    assert measure.stream_reference(words, ctas, chunks, stage_bytes) == want
    assert len(set(want)) == len(want) or ctas == 1  # random data: distinct per CTA


def test_stream_reference_sees_a_partial_copy():
    """A stage copied only in part (its tail left stale) changes the expected result."""
    ctas, chunks, stage = 2, 8, 1024
    g = torch.Generator().manual_seed(7)
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (ctas * chunks * stage // 4,),
                          dtype=torch.int32, generator=g)
    stale = words.clone().view(ctas, chunks, stage // 4)
    stale[:, :, stage // 8:] = torch.randint_like(stale[:, :, stage // 8:], -(1 << 30), 1 << 30,
                                                  generator=g)
    assert (measure.stream_reference(stale.flatten(), ctas, chunks, stage)
            != measure.stream_reference(words, ctas, chunks, stage))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_read_bandwidth_without_a_gpu_is_an_error_field(tmp_path):
    r = measure.read_bandwidth(tmp_path)
    assert set(r) == {"error"} and "no CUDA GPU" in r["error"]
    c = measure.copy_bandwidth()
    assert set(c) == {"error"} and "no CUDA GPU" in c["error"]


def test_missing_stream_build_names_the_build_command(tmp_path):
    from megakernel.launch.runtime import KernelUnavailable

    with pytest.raises(KernelUnavailable, match="megakernel.kernel.toolchain.stream_build --out"):
        measure.load_stream(tmp_path, "sm_90a")
    assert measure.stream_build_dir(tmp_path) == tmp_path / "stream"
