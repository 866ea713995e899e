"""Kimi Linear in the compiled kernel: kimi-linear-tiny on both archs with every handler it needs
(KDA_CORE or KDA_REPLAY, MLA_Q / MLA / MLA_O, ROUTER_SCORE / ROUTER, the expert slabs,
MOE_COMBINE), recurrent and by ReplaySSM (fold window 4), at (B, T) = (1, 1), (1, 4), (4, 1) on
the weight pipeline and (1, 1) on the global-memory path, within the register/spill/local
budgets (the session build cache). The global-memory path at B = 4 or T = 4 is over the register
budget with all of Kimi's handlers in one kernel, so gpu-check runs those shapes piped only."""

from __future__ import annotations

import re

import pytest

from megakernel import isa
from megakernel.common.arch import ARCHS
from megakernel.kernel.config.model_spec import program_ops
from megakernel.models import preset
from tests.kernel.helpers import specs_within_budgets

KIMI = "kimi-linear-tiny"
WINDOW = 4
SHAPES = ((1, 1, None), (1, 4, None), (4, 1, None), (1, 1, 0))  # (B, T, smem_stages)
MATH_PTX = re.compile(r"ex2\.approx\.ftz\.f32")  # the gates' and decays' exponentials


@pytest.fixture(scope="module")
def kimi_builds(kernel_build) -> dict:  # noqa: ANN001
    """(arch, B, T, smem_stages, L) -> (arch dir, manifest)."""
    return {(arch, b, t, st, w): kernel_build(preset(KIMI), arch, b, t, smem_stages=st,
                                              replay_window=w)
            for arch in ARCHS for b, t, st in SHAPES for w in (0, WINDOW)}


def test_kimi_builds_within_budgets_with_every_handler(kimi_builds):
    cfg = preset(KIMI)
    for (_, _, t, st, window), s in specs_within_budgets(kimi_builds).items():
        assert set(s.handled_ops) == program_ops(cfg, bool(window))
        assert all(isa.spec(op).device for op in s.handled_ops)
        assert s.pipelined == (st is None)
        core, other = ((isa.Op.KDA_REPLAY, isa.Op.KDA_CORE) if window
                       else (isa.Op.KDA_CORE, isa.Op.KDA_REPLAY))
        assert s.constants("kda") == (2, 16, 4)
        assert core in s.handled_ops and other not in s.handled_ops
        assert s.shape("kda").cap == (WINDOW - 1 + t if window else 0)


def test_kda_handler_is_compiled_in(kimi_builds):
    """The KDA math is in the cubins, more of it by ReplaySSM (the ring's channel decays)."""
    for arch in ARCHS:
        ptx = {w: (kimi_builds[(arch, 1, 1, None, w)][0] / "megakernel.ptx").read_text()
               for w in (0, WINDOW)}
        assert len(MATH_PTX.findall(ptx[0])) >= 8, arch
        assert len(MATH_PTX.findall(ptx[WINDOW])) > len(MATH_PTX.findall(ptx[0])), arch


@pytest.mark.parametrize("window", [0, 16])
def test_the_real_kimi_preset_builds_for_both_archs(kernel_build, window):
    """kimi-linear-48b-a3b at B = 1 (its gpu-check benchmark's build), recurrent and ReplaySSM
    L = 16: every handler compiled in, within the budgets, on the default weight pipeline."""
    cfg = preset("kimi-linear-48b-a3b")
    builds = {arch: kernel_build(cfg, arch, 1, 1, replay_window=window) for arch in ARCHS}
    for s in specs_within_budgets(builds).values():
        assert set(s.handled_ops) == program_ops(cfg, bool(window)) and s.pipelined
        assert s.constants("kda") == (32, 128, 4) and s.constants("mla") == (32, 512, 128, 64, 128)


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_work_list_and_router_norm_in_the_ptx(kernel_build, arch):
    """kimi-linear-tiny at B = 4 (a step may leave work slots unbound): the loader publishes each
    expert record it has bound (st.release.cta to shared memory) and the consumers wait for it at
    the record (ld.acquire.cta), so no binding is read after the next router rewrites the work
    list (pipeline.py); ROUTER_SCORE's RMSNorm is 1 / sqrt as every other norm, with no
    rsqrt.approx (an ulp there can flip a near-tie top-k against the executor)."""
    ptx = (kernel_build(preset(KIMI), arch, 4, 1)[0] / "megakernel.ptx").read_text()
    assert "rsqrt.approx" not in ptx
    assert len(re.findall(r"st\.release\.cta\.shared::cta\.b32", ptx)) >= 1
    assert len(re.findall(r"ld\.acquire\.cta\.shared::cta\.b32", ptx)) >= 1


def test_router_rstd_region_holds_every_row():
    """ROUTER_SCORE keeps one rstd per activation row in the `rstd` region: sized
    from the build, not a pass's rows (32 fp32 before: rows past 32 overran into the next
    region); builds without the router keep a pass's."""
    from megakernel.kernel.config.model_spec import make_spec

    for batch in (1, 33, 64):
        s = make_spec(preset(KIMI), batch, 1, "sm_90a")
        assert s.smem_regions()["rstd"][1] >= 4 * s.rows
    dense = make_spec(preset("llama-tiny"), 64, 1, "sm_90a")
    assert dense.smem_regions()["rstd"][1] == 4 * max(dense.no, 32)
