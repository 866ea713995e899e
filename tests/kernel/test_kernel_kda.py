"""Builds of the KDA handler (kernel/kda.py): kimi-linear-tiny on both archs, recurrent and by
ReplaySSM (KDA_REPLAY, fold window 4), at (B, T) = (1, 1) and (1, 4) on the weight pipeline and
(4, 1) on the global-memory path, within the register/spill/local budgets. Kimi's MLA and MoE
opcodes have no device handler yet: the builds leave them out (make_spec(unhandled="trap"))."""

from __future__ import annotations

import re

import pytest

from megakernel import isa
from megakernel.kernel.spec import ARCHS, make_spec
from megakernel.models import preset
from tests.kernel.helpers import specs_within_budgets

KIMI = "kimi-linear-tiny"
WINDOW = 4
SHAPES = ((1, 1, None), (4, 1, 0), (1, 4, None))  # (B, T, smem_stages)
MATH_PTX = re.compile(r"ex2\.approx\.ftz\.f32")  # the gates' and decays' exponentials


@pytest.fixture(scope="module")
def kda_builds(tmp_path_factory) -> dict:  # noqa: ANN001
    """(arch, B, T, smem_stages, L) -> (arch dir, manifest)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is needed to compile the kernel")
    from megakernel.kernel.build import build_spec

    cfg, out = preset(KIMI), {}
    for arch in ARCHS:
        for b, t, st in SHAPES:
            for window in (0, WINDOW):
                spec = make_spec(cfg, b, t, arch, smem_stages=st, replay_window=window,
                                 unhandled="trap")
                root = tmp_path_factory.mktemp(f"kda-{arch}-{b}-{t}-{window}")
                out[(arch, b, t, st, window)] = (root / arch, build_spec(spec, cfg, root))
    return out


def test_kda_builds_within_budgets(kda_builds):
    for (_, _, t, _, window), s in specs_within_budgets(kda_builds).items():
        op, other = ((isa.Op.KDA_REPLAY, isa.Op.KDA_CORE) if window
                     else (isa.Op.KDA_CORE, isa.Op.KDA_REPLAY))
        assert s.kda == (2, 16, 4) and op in s.handled_ops and other not in s.handled_ops
        assert s.kda_shape.cap == (WINDOW - 1 + t if window else 0)
        assert s.kda_shape.smem()["words"] * 4 == s.recurrent_smem_bytes


def test_kda_handler_is_compiled_in(kda_builds):
    """The KDA math is in the cubins (the tiny Kimi build has no other exponentials but the
    dense layers' SiLU), more of it by ReplaySSM (the ring's channel decays)."""
    for arch in ARCHS:
        ptx = {w: (kda_builds[(arch, 1, 1, None, w)][0] / "megakernel.ptx").read_text()
               for w in (0, WINDOW)}
        assert len(MATH_PTX.findall(ptx[0])) >= 8, arch
        assert len(MATH_PTX.findall(ptx[WINDOW])) > len(MATH_PTX.findall(ptx[0])), arch
