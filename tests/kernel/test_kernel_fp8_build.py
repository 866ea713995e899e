"""FP8 weight builds (docs/FP8.md, "Kernel"; kernel/fp8_index.py) on the CPU: dense and hybrid
tiny presets with channel and block scales, both archs, the FMA GEMV (B = 1), the mma GEMV
(B = 16) and the global-memory path, within the register and shared-memory budgets with no
spills; the PTX carries the hardware e4m3 conversion (and the SASS its F2FP unpack) where the
bf16 build has none.

Every build here but the fast lane's bf16 one is the slow lane's (tests/lanes.py); the bf16 PTX
check reads the lane build.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")

from megakernel.common.arch import ARCHS  # noqa: E402
from megakernel.kernel.host import limits  # noqa: E402
from megakernel.kernel.toolchain.tools import sass_text  # noqa: E402
from megakernel.models import preset  # noqa: E402
from megakernel.models.fp8 import Fp8Format  # noqa: E402

CVT = "cvt.rn.f16x2.e4m3x2"  # the hardware conversion (PTX ISA, sm_89+)
UNPACK = "F2FP.F16.E4M3.UNPACK_B"  # its SASS
# (preset, granularity, batch, smem_stages): the FMA ring (B = 1), the mma ring (B = 16), the
# global-memory path; dense (Llama), GDN + gated attention (Qwen3.5, untied head: LM head FP8
# in the block builds), the MoE (Kimi Linear); Qwen2's QKV bias after an FP8 matrix
CASES = [(name, gran, b, stages) for name in ("llama-tiny", "qwen3.5-tiny", "kimi-linear-tiny")
         for gran in ("channel", "block") for b, stages in ((1, None), (16, None), (1, 0))]
CASES += [("qwen2-tiny", "block", 1, None)]


def _cfg(name: str, gran: str):  # noqa: ANN202
    return preset(name).replace(quant=Fp8Format(gran, lm_head=gran == "block"))


@pytest.fixture(scope="module")
def builds(kernel_build) -> dict[tuple, tuple[Path, dict]]:  # noqa: ANN001
    return {(name, gran, b, stages, arch): kernel_build(_cfg(name, gran), arch, b, 1,
                                                        smem_stages=stages)
            for name, gran, b, stages in CASES for arch in ARCHS}


def test_fp8_builds_within_budgets_without_spills(builds):
    for key, (_, m) in sorted(builds.items(), key=str):
        r, spec = m["resources"], m["spec"]
        assert spec["fp8"] == key[1], key
        assert r["spill_stores"] == r["spill_loads"] == 0, (key, r)
        assert r["local_bytes"] == r["local_stores"] == r["local_loads"] == 0, (key, r)
        assert 0 < r["registers"] <= limits.REGISTER_BUDGET, (key, r["registers"])
        assert 0 < m["dynamic_smem_bytes"] <= limits.SMEM_BUDGET, key
        assert (m["smem_stages"] == 0) == (key[3] == 0), key
        print(f"{key}: {r['registers']} regs, smem {m['dynamic_smem_bytes']} B, "
              f"{m['smem_stages']} stages")


def test_fp8_ptx_converts_in_hardware_and_mma_builds_keep_hmma(builds):
    for key, (d, _) in sorted(builds.items(), key=str):
        ptx = (d / "megakernel.ptx").read_text()
        assert CVT in ptx, key
        sass = sass_text(str(d / "megakernel.cubin"))
        assert UNPACK in sass, key
        if key[2] == 16 and key[3] is None:  # the mma GEMV: bf16 operands from the codes
            assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx, key
            assert "cvt.rn.bf16x2.f32" in ptx and "HMMA.16816.F32.BF16" in sass, key


def test_bf16_build_has_no_fp8_conversion(lane_build):  # noqa: ANN001
    for arch in ARCHS:
        d, m = lane_build(arch)
        assert m["spec"].get("fp8", "") == ""
        assert "e4m3" not in (d / "megakernel.ptx").read_text(), arch
